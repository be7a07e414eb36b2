"""Matrix-vector products for small decode batches, with their neighbours fused in.

At batch 1-4 a decode step is a chain of weight reads: each projection streams its whole weight
matrix for a handful of activation rows. cuBLAS runs the large ones near the memory bandwidth but
the small ones (q/k/v, o) well under it, and every norm, activation and residual add between them
is one more launch. Here one kernel does what sits around a projection:

    prologue   RMSNorm of the input rows: when one slice holds all of K, applied to the whole row
               first, in HF's order; otherwise the norm's weight as x is read and 1/rms after
               the product
    product    y = x @ W.T (+ bias), a float32 multiply-reduce, W read once in [BLOCK_N, BLOCK_K]
               tiles
    epilogue   silu(gate) * up for a fused gate/up weight, or + residual

so a decoder layer is three of these plus the q/k/v projection with rope and the KV-cache write
(qkv_rope_store) and attention; the first layer reads its rows from the embedding table. Each
program owns a few output features (GemvTable). With programmatic dependent launch a program loads
its first weight slice, then waits for the kernel before and only then reads the activations: the
slicing keeps enough programs resident for all of them to have that slice in flight while the
kernel before finishes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferrum.kernels.config import GemvTable
from ferrum.kernels.pdl import pdl_launch, pdl_mode, pdl_wait

MAX_ROWS = 16  # the most rows one launch takes (the engine's fused path uses up to KernelConfig.fused_decode_rows)


@dataclass(frozen=True)
class GemvSlicing:
    """One launch's tiling: output features per program, K per slice, warps."""

    block_n: int
    block_k: int
    num_warps: int


@triton.jit
def _gemv_tile(acc: tl.tensor, acc2: tl.tensor, ss: tl.tensor, X: tl.tensor, NW: tl.tensor,
               w_rows: tl.tensor, w_rows2: tl.tensor, xrows: tl.tensor, rmask: tl.tensor, nmask: tl.tensor,
               k: tl.tensor, K: tl.tensor, eps: tl.tensor, stride_xm: tl.tensor, NORM: tl.constexpr,
               GATED: tl.constexpr, WHOLE_K: tl.constexpr = False, w: tl.tensor | None = None,
               w2: tl.tensor | None = None) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """One BLOCK_K slice of the product (WHOLE_K: the slice is all of K, masked where K is not a
    power of two; w, w2: the slice of the weights, when already loaded)."""
    if WHOLE_K:
        kmask = k < K
        xmask = rmask[:, None] & kmask[None, :]
        wmask = nmask[:, None] & kmask[None, :]
    else:
        xmask = rmask[:, None]
        wmask = nmask[:, None]
    x = tl.load(X + xrows[:, None] * stride_xm + k[None, :], mask=xmask, other=0.0)
    if NORM:
        xf = x.to(tl.float32)
        if WHOLE_K:  # the whole row at hand: HF's order of operations exactly
            rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=1) / K + eps)
            normed = (xf * rstd[:, None]).to(x.dtype).to(tl.float32)
            x = (tl.load(NW + k, mask=kmask, other=0.0).to(tl.float32)[None, :] * normed).to(x.dtype)
        else:  # the norm's weight goes in now, the 1/rms factor after the product
            ss += xf * xf  # summed across K once, after the loop
            x = (tl.load(NW + k).to(tl.float32)[None, :] * xf).to(x.dtype)
    if w is None:
        w = tl.load(w_rows + k[None, :], mask=wmask, other=0.0)
    acc = _product(acc, x, w)
    if GATED:
        if w2 is None:
            w2 = tl.load(w_rows2 + k[None, :], mask=wmask, other=0.0)
        acc2 = _product(acc2, x, w2)
    return acc, acc2, ss


@triton.jit
def _product(acc: tl.tensor, x: tl.tensor, w: tl.tensor) -> tl.tensor:
    """acc [ROWS, BLOCK_N] + x [ROWS, BLOCK_K] @ w [BLOCK_N, BLOCK_K].T, a float32 multiply-reduce."""
    acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def _row_offsets(IDX: tl.tensor, rows: tl.tensor, rmask: tl.tensor, X_GATHER: tl.constexpr,
                 R_GATHER: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """The rows of X and of R that the product's rows 0..M-1 read: themselves, or IDX's entries
    (set before the step: read before the PDL wait)."""
    xrows = rows.to(tl.int64)
    rrows = rows.to(tl.int64)
    if X_GATHER or R_GATHER:
        picked = tl.load(IDX + rows, mask=rmask, other=0).to(tl.int64)
        if X_GATHER:
            xrows = picked
        if R_GATHER:
            rrows = picked
    return xrows, rrows


@triton.jit
def _first_weights(w_rows: tl.tensor, w_rows2: tl.tensor, nmask: tl.tensor, kk: tl.tensor, K: tl.tensor,
                   GATED: tl.constexpr, PDL: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """The weights of a program's first K slice, loaded before pdl_wait: they do not depend on the
    kernel before."""
    wmask = nmask[:, None] & (kk < K)[None, :]
    w = tl.load(w_rows + kk[None, :], mask=wmask, other=0.0)
    w2 = w
    if GATED:
        w2 = tl.load(w_rows2 + kk[None, :], mask=wmask, other=0.0)
    pdl_wait(PDL)
    return w, w2


@triton.jit
def _gemv_kernel(X: tl.tensor, W: tl.tensor, B: tl.tensor, R: tl.tensor, NW: tl.tensor, OUT: tl.tensor,
                 IDX: tl.tensor, M: tl.tensor, N: tl.tensor, K: tl.tensor, stride_xm: tl.tensor,
                 stride_wn: tl.tensor, stride_rm: tl.tensor, stride_om: tl.tensor, eps: tl.tensor,
                 ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NORM: tl.constexpr, BIAS: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
                 WHOLE_K: tl.constexpr, PDL: tl.constexpr = 0,
                 X_GATHER: tl.constexpr = False, R_GATHER: tl.constexpr = False) -> None:
    """X_GATHER / R_GATHER: X / R are tables whose rows IDX[0..M-1] are the input / residual rows
    (the embedding table, for the first layer: no separate gather kernel; see STEP_START)."""
    act_ty = X.dtype.element_ty
    pid = tl.program_id(0)
    rows = tl.arange(0, ROWS)
    rmask = rows < M
    cols = tl.arange(0, BLOCK_N)
    n = pid * BLOCK_N + cols
    nmask = n < N
    kk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    acc2 = tl.zeros([ROWS, BLOCK_N], tl.float32)
    ss = tl.zeros([ROWS, BLOCK_K], tl.float32)
    w_rows = W + n[:, None].to(tl.int64) * stride_wn
    w_rows2 = W + (n + N)[:, None].to(tl.int64) * stride_wn
    xrows, rrows = _row_offsets(IDX, rows, rmask, X_GATHER, R_GATHER)
    k_begin = 0
    if PDL > 0:  # the first slice's weights are on their way while the kernel before finishes
        w, w2 = _first_weights(w_rows, w_rows2, nmask, kk, K, GATED, PDL)
        acc, acc2, ss = _gemv_tile(acc, acc2, ss, X, NW, w_rows, w_rows2, xrows, rmask, nmask, kk, K, eps,
                                   stride_xm, NORM, GATED, WHOLE_K, w, w2)
        k_begin += BLOCK_K
    elif WHOLE_K:  # one slice: the norm is applied before the product, as HF applies it
        acc, acc2, ss = _gemv_tile(acc, acc2, ss, X, NW, w_rows, w_rows2, xrows, rmask, nmask, kk, K, eps, stride_xm,
                                   NORM, GATED, True)
    if not WHOLE_K:
        for k0 in range(k_begin, K, BLOCK_K):
            acc, acc2, ss = _gemv_tile(acc, acc2, ss, X, NW, w_rows, w_rows2, xrows, rmask, nmask, k0 + kk, K, eps,
                                       stride_xm, NORM, GATED)
    if NORM and not WHOLE_K:
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
        y = y.to(act_ty).to(tl.float32) + tl.load(R + rrows[:, None] * stride_rm + n[None, :],
                                                  mask=rmask[:, None] & nmask[None, :], other=0.0).to(tl.float32)
    y = y.to(act_ty)
    tl.store(OUT + rows[:, None] * stride_om + n[None, :], y.to(OUT.dtype.element_ty),
             mask=rmask[:, None] & nmask[None, :])


def slicing(k: int, rows: int, table: GemvTable, norm: bool = False) -> GemvSlicing:
    """The tiling of a projection over K inputs for `rows` rows, by `table` (see GemvTable: at one
    row, the whole of K in one slice up to its limit with or without a fused norm, else k_slice-wide
    slices; for 2-4 rows the slices shrink with the rows, so that the rows x features x slice
    products stay in registers)."""
    if rows > 1:
        block_k = table.k_slice // triton.next_power_of_2(rows)
        while k % block_k:
            block_k //= 2
        return GemvSlicing(table.features_per_program, max(block_k, 1), table.num_warps)
    whole_limit = table.whole_k_with_norm if norm else table.whole_k_without_norm
    if k <= whole_limit or (k <= table.whole_k_with_norm and k % table.k_slice):
        return GemvSlicing(table.features_per_program, triton.next_power_of_2(k), table.num_warps)
    block_k = table.k_slice
    while k % block_k:
        block_k //= 2
    return GemvSlicing(table.features_per_program, max(block_k, 1), table.num_warps)


def gemv(x: torch.Tensor, weight: torch.Tensor, table: GemvTable, *, bias: torch.Tensor | None = None,
         norm_weight: torch.Tensor | None = None, eps: float = 1e-6, gated: bool = False,
         residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
         x_rows: torch.Tensor | None = None, residual_rows: torch.Tensor | None = None,
         pdl: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K] with M <= 16; weight: [N, K] (or [2N, K] gate then up when gated).
    Returns [M, N]: x (RMS-normed first when norm_weight is given) times weight.T, plus bias,
    then silu(gate) * up when gated, then + residual. x_rows / residual_rows (int64 [M], the same
    tensor when both are given): x / residual are tables and these rows of them are the M rows.
    pdl: launched with programmatic dependent launch (never for a launch reading rows of a table:
    that is the step's first kernel, see STEP_START). out: [M, N] to write the result into."""
    index = x_rows if x_rows is not None else residual_rows
    assert x_rows is None or residual_rows is None or x_rows is residual_rows
    m = index.shape[0] if index is not None else x.shape[0]
    k = x.shape[1]
    rows_w, k_w = weight.shape
    assert k == k_w, (x.shape, weight.shape)
    assert weight.stride(1) == 1 and x.stride(1) == 1 and m <= MAX_ROWS
    n = rows_w // 2 if gated else rows_w
    cfg = slicing(k, m, table, norm=norm_weight is not None)
    whole_k = cfg.block_k >= k
    assert whole_k or k % cfg.block_k == 0, f"K={k} must be a multiple of {cfg.block_k}"
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    assert out.shape == (m, n) and out.stride(1) == 1, (out.shape, m, n)
    pdl = pdl and x_rows is None
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, weight, bias if bias is not None else x, residual if residual is not None else x,
        norm_weight if norm_weight is not None else x, out, index if index is not None else x,
        m, n, k, x.stride(0), weight.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), eps,
        ROWS=triton.next_power_of_2(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        NORM=norm_weight is not None, BIAS=bias is not None, GATED=gated, RESIDUAL=residual is not None,
        WHOLE_K=whole_k, PDL=pdl_mode(pdl), X_GATHER=x_rows is not None, R_GATHER=residual_rows is not None,
        num_warps=cfg.num_warps, num_stages=2, **pdl_launch(pdl),
    )
    return out


@triton.jit
def _qkv_rope_kernel(X: tl.tensor, W: tl.tensor, B: tl.tensor, NW: tl.tensor, POS: tl.tensor,
                     COS: tl.tensor, SIN: tl.tensor, SLOTS: tl.tensor, QOUT: tl.tensor, KC: tl.tensor,
                     VC: tl.tensor, IDX: tl.tensor, M: tl.tensor, K: tl.tensor, stride_xm: tl.tensor,
                     stride_wn: tl.tensor, stride_cs: tl.tensor, stride_qt: tl.tensor, stride_qh: tl.tensor,
                     stride_kc: tl.tensor, stride_kh: tl.tensor, eps: tl.tensor,
                     H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, BIAS: tl.constexpr,
                     WHOLE_K: tl.constexpr, PDL: tl.constexpr = 0, X_GATHER: tl.constexpr = False) -> None:
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
    # the step's positions, slots (and ids) are set before it starts (see _decode_kernel): read
    # before the wait
    xrows, _ = _row_offsets(IDX, rows, rmask, X_GATHER, False)
    slot = tl.load(SLOTS + rows, mask=rmask, other=0)
    pos = tl.load(POS + rows, mask=rmask, other=0)
    c = tl.load(COS + pos[:, None] * stride_cs + d[None, :]).to(act_ty).to(tl.float32)
    s = tl.load(SIN + pos[:, None] * stride_cs + d[None, :]).to(act_ty).to(tl.float32)
    k_begin = 0
    if PDL > 0:  # the first slice's weights are on their way while the kernel before finishes
        w, w2 = _first_weights(w_rows, w_rows2, nmask, kk, K, True, PDL)
        acc, acc2, ss = _gemv_tile(acc, acc2, ss, X, NW, w_rows, w_rows2, xrows, rmask, nmask, kk, K, eps, stride_xm,
                                   NORM, True, WHOLE_K, w, w2)
        k_begin = BLOCK_K
    elif WHOLE_K:
        acc, acc2, ss = _gemv_tile(acc, acc2, ss, X, NW, w_rows, w_rows2, xrows, rmask, nmask, kk, K, eps, stride_xm,
                                   NORM, True, True)
    if not WHOLE_K:
        for k0 in range(k_begin, K, BLOCK_K):
            acc, acc2, ss = _gemv_tile(acc, acc2, ss, X, NW, w_rows, w_rows2, xrows, rmask, nmask, k0 + kk, K, eps,
                                       stride_xm, NORM, True)
    if NORM and not WHOLE_K:
        rstd = 1.0 / tl.sqrt(tl.sum(ss, axis=1) / K + eps)
        acc = acc * rstd[:, None]
        acc2 = acc2 * rstd[:, None]
    if BIAS:
        acc += tl.load(B + n).to(tl.float32)[None, :]
        acc2 += tl.load(B + n + D // 2).to(tl.float32)[None, :]
    x1 = acc.to(act_ty).to(tl.float32)
    x2 = acc2.to(act_ty).to(tl.float32)
    if head < H + KV:
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


# STEP_START: the kernels of a decode step read before their PDL wait what the step's inputs hold
# (ids, positions, slots, lengths, tables, the older KV cache), written by the step before (its
# argmax/advance kernel) or by host copies. So the step's first kernel, the first layer's (which
# reads its rows from the embedding table), is launched without PDL: it starts only once the
# step before has completed, and every later kernel launches after it. (In a CUDA graph the first
# node waits for the work before it anyway.)


def qkv_block_k(k: int, rows: int, table: GemvTable) -> int:
    """K slice of the q/k/v kernel. A program holds four weight rows (the rotation's pairs): at one
    row from K = table.qkv_two_slices_from on, two slices keep twice the programs resident, so that
    all of them load their first slice while the kernel before runs (a 1B step 15 us shorter on an
    H100 than with one slice; the norm's 1/rms then comes after the product)."""
    block_k = slicing(k, rows, table).block_k
    return min(block_k, k // 2) if rows == 1 and k >= table.qkv_two_slices_from else block_k


def qkv_rope_store(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   norm_weight: torch.Tensor | None, eps: float, positions: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, table: GemvTable,
                   x_rows: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """RMSNorm (optional) -> q/k/v projection -> rope on q and k -> k and v into their cache
    slots, in one kernel for a few decode rows. Returns q: [M, H, D]. x_rows (int64 [M]): x is a
    table (the embedding) and these are the rows (then launched without PDL: see STEP_START)."""
    m = x_rows.shape[0] if x_rows is not None else x.shape[0]
    k = x.shape[1]
    assert m <= MAX_ROWS and weight.stride(1) == 1 and x.stride(1) == 1
    rows = triton.next_power_of_2(m)
    block_h = 1  # two rows per program (dim i and i + D/2), as the plain projections
    block_k = qkv_block_k(k, m, table)
    whole_k = block_k >= k
    while not whole_k and k % block_k:
        block_k //= 2
    q = torch.empty(m, num_heads, head_dim, dtype=x.dtype, device=x.device)
    grid = ((num_heads + 2 * num_kv_heads) * (head_dim // 2) // block_h,)
    pdl = pdl and x_rows is None
    _qkv_rope_kernel[grid](
        x, weight, bias if bias is not None else x, norm_weight if norm_weight is not None else x,
        positions, cos, sin, slots, q, k_cache, v_cache, x_rows if x_rows is not None else x, m, k,
        x.stride(0), weight.stride(0), cos.stride(0), q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), eps,
        H=num_heads, KV=num_kv_heads, D=head_dim, ROWS=rows, BLOCK_H=block_h, BLOCK_K=block_k,
        NORM=norm_weight is not None, BIAS=bias is not None, WHOLE_K=whole_k, PDL=pdl_mode(pdl),
        X_GATHER=x_rows is not None,
        num_warps=4, num_stages=2,
        **pdl_launch(pdl),
    )
    return q
