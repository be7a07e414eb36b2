"""Matrix-vector products for small decode batches, with their neighbours fused in.

At batch 1-4 a decode step is a chain of weight reads: each projection streams its whole weight
matrix for a handful of activation rows. cuBLAS runs the large ones near the memory bandwidth but
the small ones (q/k/v, o) well under it, and every norm, activation and residual add between them
is one more launch. Here one kernel does what sits around a projection:

    prologue   RMSNorm of the input rows (the norm's weight applied, HF's rounding)
    product    y = x @ W.T (+ bias), float32 accumulation, W read once in [BLOCK_N, BLOCK_K] tiles
    epilogue   silu(gate) * up for a fused gate/up weight, or + residual

so a decoder layer is four of these plus rope/cache write and attention. Rows are padded to
ROWS (16 for the tensor-core variant); each program owns BLOCK_N output features and loops over K.
With PDL, a program is launched while the kernel before it still runs, and waits for it
(griddepcontrol) before touching memory that kernel writes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

MAX_ROWS = 4  # decode batches up to this size take the fused kernels


@dataclass(frozen=True)
class GemvConfig:
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    dot: bool = True  # tensor-core dot with rows padded to 16, else a float32 multiply-reduce


@triton.jit
def _gemv_tile(acc, acc2, ss, X, NW, w_rows, w_rows2, rows, rmask, nmask, k,
               stride_xm, NORM: tl.constexpr, GATED: tl.constexpr, DOT: tl.constexpr, PRECISION: tl.constexpr,
               w=None):
    """One BLOCK_K slice of the product (w: the slice of W, when already loaded)."""
    x = tl.load(X + rows[:, None] * stride_xm + k[None, :], mask=rmask[:, None], other=0.0)
    if NORM:  # the norm's weight goes in now, the 1/rms factor after the product
        xf = x.to(tl.float32)
        ss += xf * xf  # summed across K once, after the loop
        x = (tl.load(NW + k).to(tl.float32)[None, :] * xf).to(x.dtype)
    if w is None:
        w = tl.load(w_rows + k[None, :], mask=nmask[:, None], other=0.0)
    if DOT:
        acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
    else:
        acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    if GATED:
        w2 = tl.load(w_rows2 + k[None, :], mask=nmask[:, None], other=0.0)
        if DOT:
            acc2 = tl.dot(x, tl.trans(w2), acc2, input_precision=PRECISION)
        else:
            acc2 += tl.sum(x.to(tl.float32)[:, None, :] * w2.to(tl.float32)[None, :, :], axis=2)
    return acc, acc2, ss


@triton.jit
def _gemv_kernel(X, W, B, R, NW, OUT, M, N, K, stride_xm, stride_wn, stride_rm, stride_om, eps,
                 ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NORM: tl.constexpr, BIAS: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
                 DOT: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    act_ty = X.dtype.element_ty
    pid = tl.program_id(0)
    rows = tl.arange(0, ROWS)
    rmask = rows < M
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    acc2 = tl.zeros([ROWS, BLOCK_N], tl.float32)
    ss = tl.zeros([ROWS, BLOCK_K], tl.float32)
    w_rows = W + n[:, None].to(tl.int64) * stride_wn
    w_rows2 = W + (n + N)[:, None].to(tl.int64) * stride_wn
    if PDL:
        # the weights do not depend on the kernel before: the first slice is on its way while
        # that kernel finishes; X and R are read only after it has
        w0 = tl.load(w_rows + kk[None, :], mask=nmask[:, None], other=0.0)
        gdc_wait()
        if PDL == 1:
            gdc_launch_dependents()
        acc, acc2, ss = _gemv_tile(acc, acc2, ss, X, NW, w_rows, w_rows2, rows, rmask, nmask, kk, stride_xm,
                                   NORM, GATED, DOT, PRECISION, w0)
        k_begin = BLOCK_K
    else:
        k_begin = 0
    for k0 in range(k_begin, K, BLOCK_K):
        acc, acc2, ss = _gemv_tile(acc, acc2, ss, X, NW, w_rows, w_rows2, rows, rmask, nmask, k0 + kk, stride_xm,
                                   NORM, GATED, DOT, PRECISION)
    if PDL == 2:
        gdc_launch_dependents()  # the next kernel's programs may take their places from now on
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=1) / K + eps)
        acc = acc * rstd[:, None]
        acc2 = acc2 * rstd[:, None]
    if BIAS:
        acc += tl.load(B + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc2 += tl.load(B + N + n, mask=nmask, other=0.0).to(tl.float32)[None, :]
    y = acc.to(act_ty).to(tl.float32)  # the projection's output, rounded as a bf16 matmul rounds it
    if GATED:
        up = acc2.to(act_ty).to(tl.float32)
        y = (y / (1.0 + tl.exp(-y))).to(act_ty).to(tl.float32) * up
    if RESIDUAL:
        y = y.to(act_ty).to(tl.float32) + tl.load(R + rows[:, None] * stride_rm + n[None, :],
                                                  mask=rmask[:, None] & nmask[None, :], other=0.0).to(tl.float32)
    y = y.to(act_ty)
    tl.store(OUT + rows[:, None] * stride_om + n[None, :], y.to(OUT.dtype.element_ty),
             mask=rmask[:, None] & nmask[None, :])


def default_config(n: int, k: int, rows: int) -> GemvConfig:
    """The multiply-reduce variant (measured faster than the tensor-core one once a norm is fused
    in, scripts/gemv_bench.py on an H100): 8 output features per program, the widest K slice that
    divides K, narrower for more rows (registers hold rows x 8 x BLOCK_K products)."""
    block_k = 1024 // triton.next_power_of_2(rows)
    while k % block_k:
        block_k //= 2
    return GemvConfig(block_n=8, block_k=max(block_k, 1), num_warps=8 if block_k >= 1024 else 4,
                      num_stages=2, dot=False)


def gemv(x: torch.Tensor, weight: torch.Tensor, *, bias: torch.Tensor | None = None,
         norm_weight: torch.Tensor | None = None, eps: float = 1e-6, gated: bool = False,
         residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
         config: GemvConfig | None = None, pdl: int = 0) -> torch.Tensor:
    """x: [M, K] with M <= 16; weight: [N, K] (or [2N, K] gate then up when gated). pdl: 0 an
    ordinary launch, 1 or 2 a programmatic dependent launch letting the next kernel start right
    after this one's wait (1) or after its main loop (2).
    Returns [M, N]: x (RMS-normed first when norm_weight is given) times weight.T, plus bias,
    then silu(gate) * up when gated, then + residual."""
    m, k = x.shape
    rows_w, k_w = weight.shape
    assert k == k_w, (x.shape, weight.shape)
    assert weight.stride(1) == 1 and x.stride(1) == 1
    n = rows_w // 2 if gated else rows_w
    cfg = config or default_config(n, k, m)
    assert k % cfg.block_k == 0, f"K={k} must be a multiple of block_k={cfg.block_k}"
    rows = max(16, triton.next_power_of_2(m)) if cfg.dot else triton.next_power_of_2(m)
    assert m <= 16
    out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else x, residual if residual is not None else x,
        norm_weight if norm_weight is not None else x, out,
        m, n, k, x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), eps,
        ROWS=rows, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        NORM=norm_weight is not None, BIAS=bias is not None, GATED=gated, RESIDUAL=residual is not None,
        DOT=cfg.dot, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **({"launch_pdl": True} if pdl else {}),
    )
    return out


@triton.jit
def _qkv_rope_kernel(X, W, B, NW, POS, COS, SIN, SLOTS, QOUT, KC, VC, M, K,
                     stride_xm, stride_wn, stride_cs, stride_qt, stride_qh, stride_kc, stride_kh, eps,
                     H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, BIAS: tl.constexpr):
    """The q/k/v projection with rope and the KV-cache write as its epilogue: each program owns
    BLOCK_H dims of the first half of one head and the matching dims of the second half, the
    pairs the rotation mixes."""
    act_ty = X.dtype.element_ty
    pid = tl.program_id(0)
    per_head: tl.constexpr = (D // 2) // BLOCK_H
    head = pid // per_head
    d = (pid % per_head) * BLOCK_H + tl.arange(0, BLOCK_H)
    n = head * D + d
    rows = tl.arange(0, ROWS)
    rmask = rows < M
    nmask = d < D // 2
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([ROWS, BLOCK_H], tl.float32)
    acc2 = tl.zeros([ROWS, BLOCK_H], tl.float32)
    ss = tl.zeros([ROWS, BLOCK_K], tl.float32)
    w_rows = W + n[:, None].to(tl.int64) * stride_wn
    w_rows2 = W + (n + D // 2)[:, None].to(tl.int64) * stride_wn
    for k0 in range(0, K, BLOCK_K):
        acc, acc2, ss = _gemv_tile(acc, acc2, ss, X, NW, w_rows, w_rows2, rows, rmask, nmask, k0 + kk, stride_xm,
                                   NORM, True, False, "ieee")
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=1) / K + eps)
        acc = acc * rstd[:, None]
        acc2 = acc2 * rstd[:, None]
    if BIAS:
        acc += tl.load(B + n).to(tl.float32)[None, :]
        acc2 += tl.load(B + n + D // 2).to(tl.float32)[None, :]
    x1 = acc.to(act_ty).to(tl.float32)
    x2 = acc2.to(act_ty).to(tl.float32)
    slot = tl.load(SLOTS + rows, mask=rmask, other=0)
    if head < H + KV:
        pos = tl.load(POS + rows, mask=rmask, other=0)
        c = tl.load(COS + pos[:, None] * stride_cs + d[None, :]).to(act_ty).to(tl.float32)
        s = tl.load(SIN + pos[:, None] * stride_cs + d[None, :]).to(act_ty).to(tl.float32)
        y1 = x1 * c - x2 * s
        y2 = x2 * c + x1 * s
    else:
        y1 = x1
        y2 = x2
    if head < H:
        dst = QOUT + rows[:, None] * stride_qt + head * stride_qh
    elif head < H + KV:
        dst = KC + slot[:, None] * stride_kc + (head - H) * stride_kh
    else:
        dst = VC + slot[:, None] * stride_kc + (head - H - KV) * stride_kh
    tl.store(dst + d[None, :], y1.to(act_ty), mask=rmask[:, None])
    tl.store(dst + D // 2 + d[None, :], y2.to(act_ty), mask=rmask[:, None])


def qkv_rope_store(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   norm_weight: torch.Tensor | None, eps: float, positions: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """RMSNorm (optional) -> q/k/v projection -> rope on q and k -> k and v into their cache
    slots, in one kernel for a few decode rows. Returns q: [M, H, D]."""
    m, k = x.shape
    assert m <= 16 and weight.stride(1) == 1 and x.stride(1) == 1
    rows = triton.next_power_of_2(m)
    block_h = min(4, head_dim // 2)
    block_k = 1024 // rows
    while k % block_k:
        block_k //= 2
    q = torch.empty(m, num_heads, head_dim, dtype=x.dtype, device=x.device)
    grid = ((num_heads + 2 * num_kv_heads) * (head_dim // 2) // block_h,)
    _qkv_rope_kernel[grid](
        x, weight, bias if bias is not None else x, norm_weight if norm_weight is not None else x,
        positions, cos, sin, slots, q, k_cache, v_cache, m, k,
        x.stride(0), weight.stride(0), cos.stride(0), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), eps,
        H=num_heads, KV=num_kv_heads, D=head_dim, ROWS=rows, BLOCK_H=block_h, BLOCK_K=block_k,
        NORM=norm_weight is not None, BIAS=bias is not None, num_warps=8 if block_k >= 1024 else 4, num_stages=2,
    )
    return q
