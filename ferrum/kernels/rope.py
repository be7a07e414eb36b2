"""Rope on q and k (after a per-head RMSNorm for Qwen3) and the write of k and v into their KV-cache
slots (an fp8 cache: over its layer's scales, ferrum.kernels.kv_fp8), for a step's packed tokens."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels.kv_fp8 import cache_value, scales_arg
from ferrum.kernels.pdl import pdl_launch, pdl_mode, pdl_wait


@triton.jit
def _rope_store_kernel(QKV: tl.tensor, POS: tl.tensor, COS: tl.tensor, SIN: tl.tensor, SLOTS: tl.tensor,
                       QOUT: tl.tensor, KC: tl.tensor, VC: tl.tensor, KVS: tl.tensor, QNW: tl.tensor, KNW: tl.tensor,
                       stride_t: tl.tensor, stride_qt: tl.tensor, stride_qh: tl.tensor, stride_cs: tl.tensor,
                       stride_kc: tl.tensor, stride_kh: tl.tensor, eps: tl.tensor,
                       H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr,
                       PDL: tl.constexpr = 0) -> None:
    pdl_wait(PDL)
    t = tl.program_id(0)
    head = tl.program_id(1)  # 0..H-1 q heads, H..H+KV-1 k heads, then v heads
    half = tl.arange(0, D // 2)
    base = QKV + t * stride_t + head * D
    slot = tl.load(SLOTS + t)
    if head >= H + KV:  # v: copied into the cache as it is
        kvh = head - H - KV
        dst = VC + slot * stride_kc + kvh * stride_kh
        tl.store(dst + half, cache_value(tl.load(base + half), VC, KVS, 1))
        tl.store(dst + D // 2 + half, cache_value(tl.load(base + D // 2 + half), VC, KVS, 1))
    else:
        x1 = tl.load(base + half).to(tl.float32)
        x2 = tl.load(base + D // 2 + half).to(tl.float32)
        if QK_NORM:  # Qwen3: per-head RMSNorm before the rotation
            rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
            nw = QNW if head < H else KNW
            x1 = (x1 * rstd).to(QOUT.dtype.element_ty).to(tl.float32) * tl.load(nw + half).to(tl.float32)
            x2 = (x2 * rstd).to(QOUT.dtype.element_ty).to(tl.float32) * tl.load(nw + D // 2 + half).to(tl.float32)
            x1 = x1.to(QOUT.dtype.element_ty).to(tl.float32)
            x2 = x2.to(QOUT.dtype.element_ty).to(tl.float32)
        pos = tl.load(POS + t)
        c = tl.load(COS + pos * stride_cs + half).to(QOUT.dtype.element_ty).to(tl.float32)
        s = tl.load(SIN + pos * stride_cs + half).to(QOUT.dtype.element_ty).to(tl.float32)
        y1 = (x1 * c - x2 * s).to(QOUT.dtype.element_ty)
        y2 = (x2 * c + x1 * s).to(QOUT.dtype.element_ty)
        if head < H:  # (q and the cache may differ in dtype: a pointer of each)
            q_dst = QOUT + t * stride_qt + head * stride_qh
            tl.store(q_dst + half, y1)
            tl.store(q_dst + D // 2 + half, y2)
        else:
            k_dst = KC + slot * stride_kc + (head - H) * stride_kh
            tl.store(k_dst + half, cache_value(y1, KC, KVS, 0))
            tl.store(k_dst + D // 2 + half, cache_value(y2, KC, KVS, 0))


def rope_and_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   num_heads: int, num_kv_heads: int, head_dim: int,
                   q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                   eps: float = 1e-6, pdl: bool = False, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """qkv: [T, (H + 2 KV) * D]. Rotates q and k (after a per-head norm when given), writes k and v
    into their cache slots, returns q: [T, H, D]. pdl: launched with programmatic dependent launch.
    kv_scale: an fp8 cache's k and v scales ([2] float32)."""
    tokens = qkv.shape[0]
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    _rope_store_kernel[(tokens, num_heads + 2 * num_kv_heads)](
        qkv, positions, cos, sin, slots, q, k_cache, v_cache, scales_arg(kv_scale, k_cache),
        q_norm if q_norm is not None else qkv, k_norm if k_norm is not None else qkv,
        qkv.stride(0), q.stride(0), q.stride(1), cos.stride(0), k_cache.stride(0), k_cache.stride(1), eps,
        H=num_heads, KV=num_kv_heads, D=head_dim, QK_NORM=q_norm is not None, PDL=pdl_mode(pdl), num_warps=1,
        **pdl_launch(pdl),
    )
    return q

