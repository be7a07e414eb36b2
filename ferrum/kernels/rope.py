"""Rope on q and k (after a per-head RMSNorm for Qwen3) and the write of k and v into their KV-cache
slots (an fp8 cache: over its layer's scales, ferrum.kernels.kv_fp8), for a step's packed tokens."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels.kv_fp8 import cache_value, scales_arg
from ferrum.kernels.pdl import pdl_launch, pdl_mode, pdl_wait


@triton.jit
def _rotated(SRC: tl.tensor, mask: tl.tensor, pos: tl.tensor, COS: tl.tensor, SIN: tl.tensor, stride_cs: tl.tensor,
             NW: tl.tensor, eps: tl.tensor, OUT: tl.tensor, D: tl.constexpr,
             QK_NORM: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """The heads at SRC ([rows, 1] pointers to each head's first half; `mask` [rows, 1]), normed (QK_NORM,
    weight NW) and rotated at position `pos`: the two halves, in OUT's dtype."""
    half = tl.arange(0, D // 2)[None, :]
    ty = OUT.dtype.element_ty
    x1 = tl.load(SRC + half, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(SRC + D // 2 + half, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:  # Qwen3: per-head RMSNorm before the rotation
        rstd = (1.0 / tl.sqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / D + eps))[:, None]
        x1 = (x1 * rstd).to(ty).to(tl.float32) * tl.load(NW + half).to(tl.float32)
        x2 = (x2 * rstd).to(ty).to(tl.float32) * tl.load(NW + D // 2 + half).to(tl.float32)
        x1 = x1.to(ty).to(tl.float32)
        x2 = x2.to(ty).to(tl.float32)
    c = tl.load(COS + pos * stride_cs + half).to(ty).to(tl.float32)
    s = tl.load(SIN + pos * stride_cs + half).to(ty).to(tl.float32)
    return (x1 * c - x2 * s).to(ty), (x2 * c + x1 * s).to(ty)


@triton.jit
def _rope_store_kernel(QKV: tl.tensor, POS: tl.tensor, COS: tl.tensor, SIN: tl.tensor, SLOTS: tl.tensor,
                       QOUT: tl.tensor, KC: tl.tensor, VC: tl.tensor, KVS: tl.tensor, QNW: tl.tensor, KNW: tl.tensor,
                       stride_t: tl.tensor, stride_qt: tl.tensor, stride_qh: tl.tensor, stride_cs: tl.tensor,
                       stride_kc: tl.tensor, stride_kh: tl.tensor, eps: tl.tensor,
                       H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr,
                       BLOCK_H: tl.constexpr, PDL: tl.constexpr = 0) -> None:
    """One program a token and a part (0: its q heads, 1: its k heads, 2: its v heads), all of the part's
    heads as one [BLOCK_H, D / 2] tile a half (one program a head was latency-bound: 17 us for 256 decode
    tokens of the 8B shape on an H100)."""
    pdl_wait(PDL)
    t = tl.program_id(0)
    part = tl.program_id(1)
    half = tl.arange(0, D // 2)[None, :]
    rows = tl.arange(0, BLOCK_H)[:, None]
    base = QKV + t * stride_t
    slot = tl.load(SLOTS + t)
    if part == 2:  # v: copied into the cache as it is
        m = rows < KV
        src = base + (H + KV + rows) * D + half
        dst = VC + slot * stride_kc + rows * stride_kh + half
        tl.store(dst, cache_value(tl.load(src, mask=m), VC, KVS, 1), mask=m)
        tl.store(dst + D // 2, cache_value(tl.load(src + D // 2, mask=m), VC, KVS, 1), mask=m)
    elif part == 0:  # (q and the cache may differ in dtype: a pointer of each)
        m = rows < H
        y1, y2 = _rotated(base + rows * D, m, tl.load(POS + t), COS, SIN, stride_cs, QNW, eps, QOUT, D, QK_NORM)
        q_dst = QOUT + t * stride_qt + rows * stride_qh + half
        tl.store(q_dst, y1, mask=m)
        tl.store(q_dst + D // 2, y2, mask=m)
    else:
        m = rows < KV
        y1, y2 = _rotated(base + (H + rows) * D, m, tl.load(POS + t), COS, SIN, stride_cs, KNW, eps, QOUT, D,
                          QK_NORM)
        k_dst = KC + slot * stride_kc + rows * stride_kh + half
        tl.store(k_dst, cache_value(y1, KC, KVS, 0), mask=m)
        tl.store(k_dst + D // 2, cache_value(y2, KC, KVS, 0), mask=m)


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
    _rope_store_kernel[(tokens, 3)](
        qkv, positions, cos, sin, slots, q, k_cache, v_cache, scales_arg(kv_scale, k_cache),
        q_norm if q_norm is not None else qkv, k_norm if k_norm is not None else qkv,
        qkv.stride(0), q.stride(0), q.stride(1), cos.stride(0), k_cache.stride(0), k_cache.stride(1), eps,
        H=num_heads, KV=num_kv_heads, D=head_dim, QK_NORM=q_norm is not None,
        BLOCK_H=triton.next_power_of_2(max(num_heads, num_kv_heads)), PDL=pdl_mode(pdl), num_warps=4,
        **pdl_launch(pdl),
    )
    return q

