"""Mixtures of experts on the GPU: the router's top k and the experts' products over stacked weights.

The experts' weights are stacked expert after expert: gate_up [E * 2I, H] (expert e's I gate rows, then
its I up rows), down [E * H, I]. A step's T tokens each pick k experts: P = T * k (token, expert) pairs,
pair p = t * k + j. Every shape here depends on T and k only, never on which experts were picked, so a
decode step's MoE layers run inside its CUDA graph.

    route      float32 logits against the router's weight (read as stored, widened in registers), split
               over tiles of tokens and experts and slices of the hidden features; then one kernel a tile
               of tokens: their sums, softmax, the top k by repeated arg-max (the first index of a tie),
               renormalised where the model says
    per pair   decode-sized steps (few pairs an expert): a matrix-vector program per (pair, slice of
               outputs) reading only its expert's rows, through the dense GEMV's products
               (ferrum.kernels.gemv; int4 and int8 words read in chunks of 4 a thread as its one-row
               products are, ferrum.kernels.gemv_chunks), so any storage that reads (bf16; int8, fp8,
               int4 planes) serves:
               gate/up with silu(gate) * up, then down times the pair's weight
    grouped    larger steps: the pairs sorted by expert on the device (`align`), each expert's pairs
               in blocks of BLOCK_M rows, one tensor-core product per (block, slice of outputs), the
               expert's weight slice read once per block
    combine    each token's k weighted outputs summed in float32, rounded once to the activations' dtype
               (per pair: in the down products' kernel, one program per token and slice of outputs
               reading its k experts' rows, with the residual added in the same kernel where the
               caller hands it over)

The routing weights are rounded to the activations' dtype before they multiply (as HF rounds them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferrum.kernels.config import GemvTable
from ferrum.kernels.counts import done_counts
from ferrum.kernels.gemv import MAGIC, _products, kernel_weight, slicing
from ferrum.kernels.gemv_chunks import chunk_warps, chunk_words
from ferrum.kernels.gemv_chunks import int8_inputs as gemv_int8_inputs
from ferrum.kernels.norm import rms_norm
from ferrum.kernels.pdl import pdl_launch, pdl_mode, pdl_wait
from ferrum.kernels.planes import PLAIN, factor_stride
from ferrum.kernels.quant_weight import QuantWeight

PER_PAIR_MAX_ROWS = 16  # the most tokens a step may have for the per-pair products
COMBINE_SLICE = 256  # inputs a slice of the down products' weights in the activations' dtype (all k experts')
COMBINE_UNROLLED_K = 2048  # up to this expert size their slices are unrolled, every load issued at once


@triton.jit
def _router_logits_kernel(X: tl.tensor, W: tl.tensor, PART: tl.tensor, T: tl.tensor, E: tl.tensor, H: tl.tensor,
                          stride_x: tl.tensor, K_PER: tl.tensor, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                          BLOCK_K: tl.constexpr) -> None:
    """One program per (tile of tokens, tile of experts, slice of K_PER hidden features): the slice's
    float32 partial logits, into PART[slice]."""
    _router_logits(X, W, PART, T, E, H, stride_x, K_PER, tl.program_id(0), tl.program_id(1), tl.program_id(2),
                   BLOCK_T, BLOCK_E, BLOCK_K)


@triton.jit
def _router_logits(X: tl.tensor, W: tl.tensor, PART: tl.tensor, T: tl.tensor, E: tl.tensor, H: tl.tensor,
                   stride_x: tl.tensor, K_PER: tl.tensor, token_tile: tl.tensor, expert_tile: tl.tensor,
                   split: tl.tensor, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                   NW: tl.tensor = None, XN: tl.tensor = None, eps: tl.tensor = 0.0, NORM: tl.constexpr = False,
                   BLOCK_H: tl.constexpr = 16, NORM_T: tl.constexpr = 1) -> None:
    """NORM: X's rows RMS-normed first with the weight NW (as ferrum.kernels.norm rounds them), the
    programs of expert tile 0 storing their slice of the normed rows into XN (stride_x too) for the
    experts' kernels."""
    rows = token_tile * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = expert_tile * BLOCK_E + tl.arange(0, BLOCK_E)
    rmask = rows < T
    emask = cols < E
    acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    first = split * K_PER
    rstd = tl.zeros([BLOCK_T], tl.float32)
    if NORM:
        rstd = _row_rstd(X, rows, token_tile * BLOCK_T, T, H, stride_x, eps, BLOCK_H, NORM_T)
    for k0 in range(0, K_PER, BLOCK_K):
        k = first + k0 + tl.arange(0, BLOCK_K)
        kmask = k < H
        w = tl.load(W + cols[None, :].to(tl.int64) * H + k[:, None], mask=kmask[:, None] & emask[None, :], other=0.0)
        xmask = rmask[:, None] & kmask[None, :]
        x_at = rows[:, None].to(tl.int64) * stride_x + k[None, :]
        x = tl.load(X + x_at, mask=xmask, other=0.0)
        if NORM:
            normed = (x.to(tl.float32) * rstd[:, None]).to(x.dtype).to(tl.float32)
            x = (tl.load(NW + k, mask=kmask, other=0.0).to(tl.float32)[None, :] * normed).to(x.dtype)
            if expert_tile == 0:
                tl.store(XN + x_at, x, mask=xmask)
        acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    out = (split * T + rows[:, None]).to(tl.int64) * E + cols[None, :]
    tl.store(PART + out, acc, mask=rmask[:, None] & emask[None, :])


@triton.jit
def _row_rstd(X: tl.tensor, rows: tl.tensor, first: tl.tensor, T: tl.tensor, H: tl.tensor, stride_x: tl.tensor,
              eps: tl.tensor, BLOCK_H: tl.constexpr, NORM_T: tl.constexpr) -> tl.tensor:
    """1 / RMS over its H features of each of `rows` [BLOCK_T] of X (the tile's rows from `first`; rows
    past T: unused), read NORM_T rows at a time (the step's tokens rounded up to a power of two), in
    unrolled chunks of at most 4096 values (all loads issued before the sums)."""
    r = first + tl.arange(0, NORM_T)
    chunk: tl.constexpr = min(BLOCK_H, max(16, 4096 // NORM_T))
    sumsq = tl.zeros([NORM_T], tl.float32)
    for c in tl.static_range(BLOCK_H // chunk):
        h = c * chunk + tl.arange(0, chunk)
        x = tl.load(X + r[:, None].to(tl.int64) * stride_x + h[None, :], mask=(r < T)[:, None] & (h < H)[None, :],
                    other=0.0).to(tl.float32)
        sumsq += tl.sum(x * x, axis=1)
    part = 1.0 / tl.sqrt(sumsq / H + eps)  # [NORM_T]
    return tl.sum(tl.where(r[None, :] == rows[:, None], part[None, :], 0.0), axis=1)


@triton.jit
def _route_top_kernel(PART: tl.tensor, CHOSEN: tl.tensor, WEIGHTS: tl.tensor, T: tl.tensor, E: tl.tensor,
                      SPLITS: tl.tensor, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr,
                      BLOCK_TOP: tl.constexpr, NORMALIZE: tl.constexpr) -> None:
    """One program a tile of tokens: the partial logits summed, softmax, the top k by repeated arg-max."""
    _top_k(PART, CHOSEN, WEIGHTS, tl.program_id(0) * BLOCK_T, T, E, SPLITS, BLOCK_T, BLOCK_E, TOP_K, BLOCK_TOP,
           NORMALIZE)


@triton.jit
def _top_k(PART: tl.tensor, CHOSEN: tl.tensor, WEIGHTS: tl.tensor, first: tl.tensor, T: tl.tensor, E: tl.tensor,
           SPLITS: tl.tensor, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, TOP_K: tl.constexpr,
           BLOCK_TOP: tl.constexpr, NORMALIZE: tl.constexpr) -> None:
    """Tokens first..first+BLOCK_T: their partial logits (PART [SPLITS, T, E]) summed, softmax, the top k
    by repeated arg-max (the first index of a tie), renormalised where NORMALIZE says."""
    rows = first + tl.arange(0, BLOCK_T)
    rmask = rows < T
    cols = tl.arange(0, BLOCK_E)
    emask = cols < E
    logits = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
    for split in range(0, SPLITS):  # (.cg: from L2, where other programs' partials are)
        logits += tl.load(PART + (split * T + rows[:, None]).to(tl.int64) * E + cols[None, :],
                          mask=rmask[:, None] & emask[None, :], other=0.0, cache_modifier=".cg")
    logits = tl.where(emask[None, :], logits, float("-inf"))
    p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
    p = p / tl.sum(p, axis=1)[:, None]
    slots = tl.arange(0, BLOCK_TOP)
    top = tl.zeros([BLOCK_T, BLOCK_TOP], tl.float32)
    which = tl.zeros([BLOCK_T, BLOCK_TOP], tl.int32)
    for j in tl.static_range(TOP_K):
        best = tl.max(p, axis=1)
        index = tl.min(tl.where(p == best[:, None], cols[None, :], BLOCK_E), axis=1)  # the first of a tie
        top = tl.where(slots[None, :] == j, best[:, None], top)
        which = tl.where(slots[None, :] == j, index[:, None], which)
        p = tl.where(cols[None, :] == index[:, None], -1.0, p)
    if NORMALIZE:
        top = top / tl.sum(top, axis=1)[:, None]
    out = rows[:, None] * TOP_K + slots[None, :]
    smask = rmask[:, None] & (slots < TOP_K)[None, :]
    tl.store(CHOSEN + out, which, mask=smask)
    tl.store(WEIGHTS + out, top, mask=smask)


@triton.jit
def _route_small_kernel(X: tl.tensor, W: tl.tensor, PART: tl.tensor, DONE: tl.tensor, CHOSEN: tl.tensor,
                        WEIGHTS: tl.tensor, NW: tl.tensor, XN: tl.tensor, T: tl.tensor, E: tl.tensor, H: tl.tensor,
                        stride_x: tl.tensor, K_PER: tl.tensor, eps: tl.tensor, BLOCK_T: tl.constexpr,
                        BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_ALL_E: tl.constexpr, TOP_K: tl.constexpr,
                        BLOCK_TOP: tl.constexpr, NORMALIZE: tl.constexpr, PICK_T: tl.constexpr,
                        NORM: tl.constexpr = False, BLOCK_H: tl.constexpr = 16) -> None:
    """Steps of at most BLOCK_T tokens, in one launch: each program (tile of experts, slice of the hidden
    features) stores its partial logits as _router_logits_kernel does, then counts itself done; the last
    program to finish sums them and picks every token's top k (_top_k, over PICK_T rows: the step's
    tokens rounded up to a power of two, not the product's 16), then sets the count back to 0 for the
    next launch. NORM: the rows RMS-normed first (_router_logits), so the norm needs no kernel of its own.
    Launched plainly, not with programmatic dependent launch: on an H200 the Qwen3-30B-A3B shape's batch-1
    step was 0.17-0.54 ms slower with it (its early start lets the experts' 8 x 2I / BLOCK_N waiting programs
    launch during the projection before; benchmarks/moe.md)."""
    _router_logits(X, W, PART, T, E, H, stride_x, K_PER, 0, tl.program_id(0), tl.program_id(1), BLOCK_T,
                   BLOCK_E, BLOCK_K, NW, XN, eps, NORM, BLOCK_H, PICK_T)
    tl.debug_barrier()  # every thread's partials stored before the count that announces them
    programs = tl.num_programs(0) * tl.num_programs(1)
    done = tl.atomic_add(DONE, 1, sem="acq_rel", scope="gpu")
    if done == programs - 1:
        _top_k(PART, CHOSEN, WEIGHTS, 0, T, E, tl.num_programs(1), PICK_T, BLOCK_ALL_E, TOP_K, BLOCK_TOP, NORMALIZE)
        tl.atomic_xchg(DONE, 0, sem="relaxed", scope="gpu")


ROUTER_SLICE = 128  # hidden features a program of the router's logits reads (512: 16.6 us against 11.6, H100)
ROUTER_PARTIAL_ELEMENTS = 1 << 21  # at most this many float32 partial logits (8 MiB): fewer slices on long steps


def router_warps(tokens: int, experts: int) -> int:
    """A router program's warps: 1 for a single token over many experts, whose pick then reduces within one
    warp (Qwen3-30B-A3B's 128 experts on an H200: 2.759 -> 2.713 ms a token at batch 1), else 4 (1 warp was
    4-6 us slower at 4-16 tokens on Qwen3 and 0.9 us slower for 1 token over Mixtral's 8; benchmarks/moe.md)."""
    return 1 if tokens == 1 and experts >= 64 else 4


def route(x: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H], the router's weight [E, H] (any float dtype) -> chosen experts [T, k] int32 and their
    softmax weights [T, k] float32 (renormalised over the chosen when `normalize`). The logits split over
    tiles of tokens, of experts and slices of the hidden features (a decode step's one token still
    spreads over many programs: the router is latency, not bytes), then the top k of their sums: for at
    most 16 tokens in one launch (the last program to finish picks), else two kernels."""
    routed = route_normed(x, weight, top_k, normalize)
    return routed.chosen, routed.weights


@dataclass(frozen=True)
class Routed:
    """What `route_normed` returns: each token's chosen experts [T, k] int32 and their weights [T, k]
    float32, and the rows the experts take ([T, H]: x itself, or x RMS-normed)."""

    chosen: torch.Tensor
    weights: torch.Tensor
    x: torch.Tensor


def route_normed(x: torch.Tensor, weight: torch.Tensor, top_k: int, normalize: bool,
                 norm_weight: torch.Tensor | None = None, eps: float = 1e-6) -> Routed:
    """`route`, with the block's RMSNorm (weight `norm_weight`) applied to x first where given: for at most
    16 tokens inside the router's one launch, which also writes the normed rows the experts take (one
    kernel fewer a layer); for more, the norm kernel first."""
    tokens, hidden = x.shape
    experts = weight.shape[0]
    assert weight.shape[1] == hidden and weight.is_contiguous() and x.stride(1) == 1
    chosen = torch.empty(tokens, top_k, dtype=torch.int32, device=x.device)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=x.device)
    block_t, block_e = 16, 16
    padded_t = triton.cdiv(tokens, block_t) * block_t
    splits = max(1, min(triton.cdiv(hidden, ROUTER_SLICE), ROUTER_PARTIAL_ELEMENTS // (padded_t * experts)))
    k_per = triton.cdiv(triton.cdiv(hidden, splits), ROUTER_SLICE) * ROUTER_SLICE
    splits = triton.cdiv(hidden, k_per)
    partial = torch.empty(splits, tokens, experts, dtype=torch.float32, device=x.device)
    picks = dict(TOP_K=top_k, BLOCK_TOP=max(2, triton.next_power_of_2(top_k)), NORMALIZE=normalize)
    if tokens <= block_t:
        normed = torch.empty_like(x) if norm_weight is not None else x
        _route_small_kernel[(triton.cdiv(experts, block_e), splits)](
            x, weight, partial, done_counts(x.device), chosen, weights,
            norm_weight if norm_weight is not None else weight, normed, tokens, experts, hidden, x.stride(0), k_per,
            eps, BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=128, BLOCK_ALL_E=max(16, triton.next_power_of_2(experts)),
            num_warps=router_warps(tokens, experts), PICK_T=triton.next_power_of_2(tokens),
            NORM=norm_weight is not None,
            BLOCK_H=triton.next_power_of_2(hidden), **picks,
        )
        return Routed(chosen, weights, normed)
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, eps)[0]
    _router_logits_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(experts, block_e), splits)](
        x, weight, partial, tokens, experts, hidden, x.stride(0), k_per,
        BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=128, num_warps=4,
    )
    _route_top_kernel[(triton.cdiv(tokens, block_t),)](
        partial, chosen, weights, tokens, experts, splits, BLOCK_T=block_t,
        BLOCK_E=max(16, triton.next_power_of_2(experts)), num_warps=4, **picks,
    )
    return Routed(chosen, weights, x)


@triton.jit
def _pair_gemv_kernel(X: tl.tensor, W: tl.tensor, S: tl.tensor, Z: tl.tensor, OUT: tl.tensor, CHOSEN: tl.tensor,
                      N: tl.tensor, K: tl.tensor, rows_e: tl.tensor, stride_xm: tl.tensor, stride_wn: tl.tensor,
                      stride_sn: tl.tensor, stride_om: tl.tensor, magic: tl.tensor, TOP_K: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, WHOLE_K: tl.constexpr, QUANT: tl.constexpr,
                      GROUP: tl.constexpr, PLANES: tl.constexpr, ASM: tl.constexpr, WPT: tl.constexpr = 1,
                      PDL: tl.constexpr = 0, A8: tl.constexpr = False) -> None:
    """One program per (pair, BLOCK_N outputs): silu(gate) * up of its expert's gate rows n and up rows
    N + n (`rows_e` rows an expert) times its token's row of X, into the pair's row of OUT. WPT: int4 /
    int8 words read WPT at a time (the dense GEMV's chunks, ferrum.kernels.gemv_chunks; A8: int4 times x
    as int8, gemv_chunks.int8_inputs). PDL: waits for the kernel before first (which rows to read comes
    from the router)."""
    pdl_wait(PDL)
    act_ty = X.dtype.element_ty
    pair = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    first = tl.load(CHOSEN + pair).to(tl.int64) * rows_e  # the expert's first row of the stack
    one = tl.arange(0, 1)
    xrows = (one + pair // TOP_K).to(tl.int64)
    z_first = Z + first * factor_stride(stride_sn, QUANT)  # INT4_K's super-block factors: a row of their own
    acc, acc2 = _products(X, W + first * stride_wn, S + first * stride_sn, z_first, X, n, n + N, nmask,
                          xrows, one < 1, K, 0.0, stride_xm, stride_wn, stride_sn, magic, 1, BLOCK_N, BLOCK_K, False,
                          True, QUANT, GROUP, PLANES, WHOLE_K, 0, ASM, WPT, A8)
    y = acc.to(act_ty).to(tl.float32)  # [1, BLOCK_N]
    up = acc2.to(act_ty).to(tl.float32)
    y = (y / (1.0 + tl.exp(-y))).to(act_ty).to(tl.float32) * up
    tl.store(OUT + pair * stride_om + n[None, :], y.to(OUT.dtype.element_ty), mask=nmask[None, :])


@triton.jit
def _combine_down_kernel(X: tl.tensor, W: tl.tensor, S: tl.tensor, Z: tl.tensor, OUT: tl.tensor, CHOSEN: tl.tensor,
                         RW: tl.tensor, R: tl.tensor, N: tl.tensor, K: tl.tensor, rows_e: tl.tensor,
                         stride_xm: tl.tensor, stride_wn: tl.tensor, stride_sn: tl.tensor, stride_om: tl.tensor,
                         stride_rm: tl.tensor, magic: tl.tensor, TOP_K: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, WHOLE_K: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr,
                         PLANES: tl.constexpr, ASM: tl.constexpr, RESIDUAL: tl.constexpr,
                         WPT: tl.constexpr = 1, PDL: tl.constexpr = 0, BLOCK_TOP: tl.constexpr = 2,
                         K_SLICES: tl.constexpr = 0, A8: tl.constexpr = False) -> None:
    """One program per (token, BLOCK_N outputs): the down rows n of each of the token's k experts times
    its pair's row of X (the activations), each rounded, times the pair's routing weight (rounded to the
    activations' dtype, as HF rounds it), summed in float32 and rounded once to OUT's dtype (RESIDUAL:
    plus R's row, rounded again). The per-pair down products, their sum and the residual add in one
    kernel. Weights in the activations' dtype: the k experts' rows are loaded at once, as one
    [BLOCK_TOP, BLOCK_N, BLOCK_K] tile a K slice (K_SLICES > 0: that many slices unrolled, all loads at
    once), and reduced once; expert by expert, each expert's loads would wait behind the previous
    expert's reduction, k memory round trips in a row. Quantized stacks go expert by expert, in the order
    of the choice (ferrum.kernels.gemv's products take one weight at a time). WPT, PDL and A8 as
    _pair_gemv_kernel's."""
    pdl_wait(PDL)
    act_ty = X.dtype.element_ty
    token = tl.program_id(0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    if QUANT == 0:  # PLAIN (ferrum.kernels.planes): the activations' dtype
        j = tl.arange(0, BLOCK_TOP)
        jmask = j < TOP_K
        pairs = token * TOP_K + j
        experts = tl.load(CHOSEN + pairs, mask=jmask, other=0).to(tl.int64)
        w_rows = W + (experts[:, None] * rows_e + n[None, :]) * stride_wn  # [BLOCK_TOP, BLOCK_N]
        x_rows = X + pairs.to(tl.int64)[:, None] * stride_xm  # [BLOCK_TOP, 1]
        wmask = (jmask[:, None] & nmask[None, :])[:, :, None]
        products = tl.zeros([BLOCK_TOP, BLOCK_N, BLOCK_K], tl.float32)
        if K_SLICES > 0:  # short K: the slices unrolled, every load issued before the products
            for i in tl.static_range(K_SLICES):
                products = _expert_slice(products, w_rows, x_rows, wmask, jmask, i * BLOCK_K, K, BLOCK_K)
        else:
            for k0 in range(0, K, BLOCK_K):
                products = _expert_slice(products, w_rows, x_rows, wmask, jmask, k0, K, BLOCK_K)
        acc = tl.sum(products, axis=2)  # [BLOCK_TOP, BLOCK_N]
        rw = tl.load(RW + pairs, mask=jmask, other=0.0).to(act_ty).to(tl.float32)
        total = tl.sum(acc.to(act_ty).to(tl.float32) * rw[:, None], axis=0)[None, :]
    else:
        one = tl.arange(0, 1)
        total = tl.zeros([1, BLOCK_N], tl.float32)
        for jj in tl.static_range(TOP_K):
            pair = token * TOP_K + jj
            first = tl.load(CHOSEN + pair).to(tl.int64) * rows_e  # the expert's first row of the stack
            z_first = Z + first * factor_stride(stride_sn, QUANT)
            acc1, _ = _products(X, W + first * stride_wn, S + first * stride_sn, z_first, X, n, n, nmask,
                                (one + pair).to(tl.int64), one < 1, K, 0.0, stride_xm, stride_wn, stride_sn, magic, 1,
                                BLOCK_N, BLOCK_K, False, False, QUANT, GROUP, PLANES, WHOLE_K, 0, ASM, WPT, A8)
            total += acc1.to(act_ty).to(tl.float32) * tl.load(RW + pair).to(act_ty).to(tl.float32)
    y = total.to(act_ty)
    if RESIDUAL:
        y = (y.to(tl.float32) + tl.load(R + token * stride_rm + n[None, :], mask=nmask[None, :],
                                        other=0.0).to(tl.float32)).to(act_ty)
    tl.store(OUT + token * stride_om + n[None, :], y, mask=nmask[None, :])


@triton.jit
def _expert_slice(products: tl.tensor, w_rows: tl.tensor, x_rows: tl.tensor, wmask: tl.tensor, jmask: tl.tensor,
                  k0: tl.tensor, K: tl.tensor, BLOCK_K: tl.constexpr) -> tl.tensor:
    """products [BLOCK_TOP, BLOCK_N, BLOCK_K] + the weight rows w_rows [BLOCK_TOP, BLOCK_N] times their pair's
    row of x (x_rows [BLOCK_TOP, 1]) over inputs k0..k0+BLOCK_K, elementwise (reduced by the caller)."""
    k = k0 + tl.arange(0, BLOCK_K)
    kmask = k < K
    w = tl.load(w_rows[:, :, None] + k[None, None, :], mask=wmask & kmask[None, None, :], other=0.0)
    x = tl.load(x_rows + k[None, :], mask=jmask[:, None] & kmask[None, :], other=0.0)
    return products + w.to(tl.float32) * x.to(tl.float32)[:, None, :]


@dataclass(frozen=True)
class Alignment:
    """The step's pairs sorted by expert, each expert's in blocks of `block_m` (`align`)."""

    order: torch.Tensor  # [P] int32: pair ids, by expert
    counts: torch.Tensor  # [E] int64: pairs each expert has
    pair_start: torch.Tensor  # [E] int64: where each expert's pairs start in `order`
    block_start: torch.Tensor  # [E] int64: each expert's first block
    block_expert: torch.Tensor  # [max_blocks] int64: each block's expert (E: a block past the last)
    block_m: int


def align(chosen: torch.Tensor, num_experts: int, block_m: int) -> Alignment:
    """Sorts the pairs of `chosen` [T, k] by expert with device ops of static shapes (no host sync):
    expert e's pairs fill ceil(count_e / block_m) blocks; there are at most P / block_m + min(E, P)."""
    flat = chosen.reshape(-1).long()
    pairs = flat.shape[0]
    order = torch.argsort(flat, stable=True).to(torch.int32)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    max_blocks = triton.cdiv(pairs, block_m) + min(num_experts, pairs)
    block_expert = torch.searchsorted(block_end, torch.arange(max_blocks, device=flat.device), right=True)
    return Alignment(order, counts, torch.cumsum(counts, 0) - counts, block_end - blocks, block_expert, block_m)


@triton.jit
def _grouped_kernel(X: tl.tensor, W: tl.tensor, OUT: tl.tensor, RW: tl.tensor, ORDER: tl.tensor, COUNTS: tl.tensor,
                    PAIR_START: tl.tensor, BLOCK_START: tl.tensor, BLOCK_EXPERT: tl.tensor, E: tl.tensor,
                    N: tl.tensor, K: tl.tensor, rows_e: tl.tensor, stride_xm: tl.tensor, stride_wn: tl.tensor,
                    stride_om: tl.tensor, TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr, X_BY_PAIR: tl.constexpr,
                    PRECISION: tl.constexpr) -> None:
    """One program per (block of one expert's pairs, BLOCK_N outputs); GATED: silu(gate) * up of the
    expert's gate rows n and up rows N + n; WEIGHTED: times the pair's routing weight; X_BY_PAIR: X's rows
    are the pairs' (else the tokens'). Blocks past the last expert's return at once."""
    act_ty = X.dtype.element_ty
    block = tl.program_id(0)
    expert = tl.load(BLOCK_EXPERT + block)
    if expert >= E:
        return
    local = (block - tl.load(BLOCK_START + expert)) * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = local < tl.load(COUNTS + expert)
    pair = tl.load(ORDER + tl.load(PAIR_START + expert) + local, mask=valid, other=0)
    if X_BY_PAIR:
        xrow = pair.to(tl.int64)
    else:
        xrow = (pair // TOP_K).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = n < N
    w_cols = W + (expert.to(tl.int64) * rows_e + n)[None, :] * stride_wn  # [1, BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kmask = k < K
        x = tl.load(X + xrow[:, None] * stride_xm + k[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_cols + k[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        acc = tl.dot(x, w, acc, input_precision=PRECISION)
        if GATED:
            w2 = tl.load(w_cols + N * stride_wn + k[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
            acc2 = tl.dot(x, w2, acc2, input_precision=PRECISION)
    y = acc.to(act_ty).to(tl.float32)
    if GATED:
        up = acc2.to(act_ty).to(tl.float32)
        y = (y / (1.0 + tl.exp(-y))).to(act_ty).to(tl.float32) * up
    if WEIGHTED:
        y = y.to(act_ty).to(tl.float32) * tl.load(RW + pair, mask=valid, other=0.0).to(act_ty).to(tl.float32)[:, None]
    tl.store(OUT + pair[:, None].to(tl.int64) * stride_om + n[None, :], y.to(OUT.dtype.element_ty),
             mask=valid[:, None] & nmask[None, :])


@dataclass(frozen=True)
class GroupedTiles:
    """The grouped products' tiling."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def grouped_tiles(pairs: int, num_experts: int) -> GroupedTiles:
    """16-row blocks while an expert has few pairs, 64 once most have many."""
    if pairs >= 16 * num_experts:
        return GroupedTiles(64, 128, 64, 8, 3)
    return GroupedTiles(16, 64, 64, 4, 3)


def per_pair_fits(tokens: int, top_k: int, num_experts: int) -> bool:
    """Whether a step of `tokens` tokens takes the per-pair products: while the pairs are few against the
    experts (few pairs share an expert, whose rows each pair's programs would read again)."""
    return tokens <= PER_PAIR_MAX_ROWS and 2 * tokens * top_k <= num_experts


def _dot_precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def experts(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor | QuantWeight,
            down: torch.Tensor | QuantWeight, num_experts: int, table: GemvTable | None = None,
            per_pair: bool | None = None, residual: torch.Tensor | None = None, pdl: bool = False) -> torch.Tensor:
    """The experts' weighted sum for each token of x [T, H]: chosen / weights [T, k] from `route`,
    gate_up [E * 2I, H] and down [E * H, I] stacked (tensors in x's dtype, or QuantWeights of the stacks
    for the per-pair products). `per_pair`: force one way (None: per pair while the pairs are few against
    the experts; ferrum.models.layers.moe hands larger steps their quantized stacks dequantized). Returns
    [T, H] in x's dtype, plus `residual` [T, H] (rounded after the sum, as adding it afterwards would).
    Per pair, the down products, the sum over each token's experts and the residual are one kernel
    (_combine_down_kernel). pdl: the per-pair kernels launched with programmatic dependent launch. `table`
    slices the per-pair products (default GemvTable()); its int8_inputs makes int4 stacks take x as int8."""
    tokens, hidden = x.shape
    top_k = chosen.shape[1]
    pairs = tokens * top_k
    gu, dn = kernel_weight(gate_up), kernel_weight(down)
    inter = gu.out_rows // (2 * num_experts)
    assert gu.in_features == hidden and dn.out_rows == num_experts * hidden and dn.in_features == inter
    quantized = isinstance(gate_up, QuantWeight) or isinstance(down, QuantWeight)
    if per_pair is None:
        per_pair = quantized or per_pair_fits(tokens, top_k, num_experts)
    act = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    if residual is not None:
        assert residual.shape == x.shape and residual.stride(1) == 1, (residual.shape, x.shape)
    if per_pair:
        table = table or GemvTable()
        cfg = slicing(gu.in_features, 1, table, min_k=gu.planes, n=2 * inter)
        gu.check_slice(cfg.block_k)
        wpt = chunk_words(gu.quant, gu.planes, gu.group, hidden, cfg.block_k)
        _pair_gemv_kernel[(pairs, triton.cdiv(inter, cfg.block_n))](
            x, gu.data, gu.scale, gu.zero, act, chosen, inter, hidden, 2 * inter, x.stride(0), gu.stride_wn,
            gu.stride_sn, act.stride(0), MAGIC, TOP_K=top_k, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            WHOLE_K=cfg.block_k >= hidden, QUANT=gu.quant, GROUP=gu.group, PLANES=gu.planes, ASM=gu.data.is_cuda,
            WPT=wpt, num_warps=chunk_warps(cfg.block_k, wpt, gu.planes, cfg.num_warps), num_stages=2,
            PDL=pdl_mode(pdl), A8=gemv_int8_inputs(gu.quant, wpt, table), **pdl_launch(pdl),
        )
        combined = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
        cfg = slicing(inter, 1, table, min_k=dn.planes, n=hidden)
        dn.check_slice(cfg.block_k)
        wpt = chunk_words(dn.quant, dn.planes, dn.group, inter, cfg.block_k)
        block_k, k_slices = cfg.block_k, 0
        if dn.quant == PLAIN and inter <= COMBINE_UNROLLED_K:  # all k experts' rows at once, in unrolled slices
            block_k = min(COMBINE_SLICE, triton.next_power_of_2(inter))
            k_slices = triton.cdiv(inter, block_k)
        _combine_down_kernel[(tokens, triton.cdiv(hidden, cfg.block_n))](
            act, dn.data, dn.scale, dn.zero, combined, chosen, weights, residual if residual is not None else x,
            hidden, inter, hidden, act.stride(0), dn.stride_wn, dn.stride_sn, combined.stride(0),
            residual.stride(0) if residual is not None else 0, MAGIC,
            TOP_K=top_k, BLOCK_N=cfg.block_n, BLOCK_K=block_k, WHOLE_K=block_k >= inter, K_SLICES=k_slices,
            QUANT=dn.quant,
            GROUP=dn.group, PLANES=dn.planes, ASM=dn.data.is_cuda, RESIDUAL=residual is not None, WPT=wpt,
            num_warps=chunk_warps(cfg.block_k, wpt, dn.planes, cfg.num_warps), num_stages=2,
            PDL=pdl_mode(pdl), BLOCK_TOP=max(2, triton.next_power_of_2(top_k)),
            A8=gemv_int8_inputs(dn.quant, wpt, table), **pdl_launch(pdl),
        )
        return combined
    out = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    if quantized:
        raise ValueError("the grouped expert products take weights in the activations' dtype")
    tiles = grouped_tiles(pairs, num_experts)
    aligned = align(chosen, num_experts, tiles.block_m)
    for w, src, dst, rows_e, gated in ((gate_up, x, act, 2 * inter, True), (down, act, out, hidden, False)):
        assert isinstance(w, torch.Tensor)
        n = rows_e // 2 if gated else rows_e
        _grouped_kernel[(aligned.block_expert.shape[0], triton.cdiv(n, tiles.block_n))](
            src, w, dst, weights, aligned.order, aligned.counts, aligned.pair_start, aligned.block_start,
            aligned.block_expert, num_experts, n, w.shape[1], rows_e, src.stride(0), w.stride(0), dst.stride(0),
            TOP_K=top_k, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, GATED=gated,
            WEIGHTED=not gated, X_BY_PAIR=not gated, PRECISION=_dot_precision(x),
            num_warps=tiles.num_warps, num_stages=tiles.num_stages,
        )
    summed = out.view(tokens, top_k, hidden).sum(dim=1).to(x.dtype)
    return summed if residual is None else summed + residual
