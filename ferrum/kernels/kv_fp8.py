"""An fp8 (e4m3) KV cache's values, for the kernels that write and read it: each k is stored as
k / k_scale and each v as v / v_scale, the layer's two scales at KVS[0] and KVS[1]
(ferrum.models.attention.layout, ferrum.engine.kv_calibration)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = tl.constexpr(torch.finfo(torch.float8_e4m3fn).max)  # 448


@triton.jit
def e4m3_round(x: tl.tensor) -> tl.tensor:
    """float32 x (|x| <= 448) rounded to the nearest e4m3 value, ties to even, as float32: normal values
    keep 3 mantissa bits (the carry may step the exponent), those below 2^-6 go to multiples of 2^-9.
    The cast to e4m3 after it is exact (Triton's interpreter rounds values just under a power of two
    to half of it)."""
    bits = x.to(tl.int32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576).to(tl.float32, bitcast=True)
    size = tl.abs(x)
    subnormal = ((size * 512.0 + 12582912.0) - 12582912.0) * 0.001953125  # 1.5 * 2^23: round to an integer
    subnormal = tl.where(x < 0, -subnormal, subnormal)  # -0 stays -0
    return tl.where(size < 0.015625, subnormal, normal)


@triton.jit
def cache_value(y: tl.tensor, CACHE: tl.tensor, KVS: tl.tensor, WHICH: tl.constexpr) -> tl.tensor:
    """y as the cache at CACHE stores it: its dtype, or for an fp8 cache y over scale KVS[WHICH], saturated."""
    if CACHE.dtype.element_ty == tl.float8e4nv:
        scaled = tl.clamp(y.to(tl.float32) / tl.load(KVS + WHICH), -FP8_MAX, FP8_MAX)
        return e4m3_round(scaled).to(tl.float8e4nv)
    return y.to(CACHE.dtype.element_ty)


@triton.jit
def cache_scale(CACHE: tl.tensor, KVS: tl.tensor, WHICH: tl.constexpr) -> tl.tensor:
    """What a value read from the cache at CACHE is multiplied by: scale KVS[WHICH] for an fp8 cache, else 1."""
    if CACHE.dtype.element_ty == tl.float8e4nv:
        return tl.load(KVS + WHICH)
    return 1.0


def scales_arg(kv_scale: torch.Tensor | None, k_cache: torch.Tensor) -> torch.Tensor:
    """What the kernels' KVS points at: an fp8 cache's scales ([2] float32, required), else any tensor (unread)."""
    if k_cache.dtype == torch.float8_e4m3fn:
        if kv_scale is None:
            raise ValueError("an fp8 KV cache needs its layer's kv_scale")
        return kv_scale
    return k_cache
