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

The weight is a tensor in the activations' dtype or a `QuantWeight`: the same prologues and
epilogues for every kind, the product float32 from the stored values exactly, a scale applied
once where it can be:

    int8, fp8  the bytes read as int32 words of 4 inputs, int4 as words of 8, each word read as
               "planes": input i of every word as float32 by a shift, a mask and an OR into the
               mantissa of 2^e (the bits land as 2^e + q exactly, no conversion instruction), times
               input i of x, each word's sum started from minus its x times the offsets 2^e, so no
               subtraction an input. x is read as [rows, words, inputs a word], 16 (8) contiguous
               bytes a thread lined up with that thread's word, so the planes need no data movement;
               a tile is [words, BLOCK_N] with threads along the words (coalesced) and the sums stay
               per word through the K loop. int4: each word's sum times its group's scale, plus the
               zero times the sum of the word's x; int8: the per-channel scale after the K loop (with
               group scales, each word's sum times its group's scale, and with zeros per group
               (INT8_ZERO) plus the zero times the sum of the word's x, as int4).
               fp8's planes come from the hardware's conversion (e4m3 pairs to half precision, then
               float32: 1.5 instructions an input, exact), its per-channel scale after the K loop;
               K not whole words: [BLOCK_N, BLOCK_K] tiles as for bf16, converted to float32.

A quantized row is 2x (int8, fp8) or 4x (int4) fewer bytes: its kind has its own table
(KernelConfig.gemv_table). Measured on an H100 (scripts/quant_gemv_bench.py, Llama-3.1-8B shapes,
batch 1, the 32-layer chain with the bf16 head): bf16 95% of its weight-bytes floor, int8 87-89%,
fp8 88%, int4 60%. Dropping the subtraction an input took int8 from 78% and int4 from 55% (then 58
-> 60%: a word's offsets from two sums of x); fp8 read as planes instead of tiles (which sum across
threads every slice) went from 80% to 85%, and to 88% in 1024-input slices; int4 reading
int64 words of 16 inputs (8-byte loads) fell to 26% (x's planes no longer line up with the words, so
every slice moves through shared memory); capping int4's 96 registers a thread at 80 or 64 (more
warps resident) spilled: 3.07 and 3.97 ms against 2.60. At 4 rows the chain is 3-7x its floor: an
input's instructions repeat a row.

int4 and int8 at one row read four words a thread instead (ferrum.kernels.gemv_chunks: 16-byte
loads, one scale and zero a chunk): the int4 chain 2.60 -> 2.19 ms (60% -> 71-72% of its floor),
int8 2.96 -> 2.86 ms (89% -> 93-94%); fp8 in chunks was slower and keeps the planes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferrum.kernels.config import GemvTable
from ferrum.kernels.gemv_chunks import chunk_products, chunk_warps, chunk_words, int8_inputs
from ferrum.kernels.kv_fp8 import cache_value, scales_arg
from ferrum.kernels.pdl import pdl_launch, pdl_mode, pdl_wait
from ferrum.kernels.planes import (
    FP8,
    INT4,
    INT4_K,
    INT8,
    INT8_ZERO,
    PER_CHANNEL,
    PLAIN,
    SUPER_GROUPS,
    factor_stride,
    fp8_planes,
    group_factors,
    plane,
)
from ferrum.kernels.quant_weight import QuantWeight

MAX_ROWS = 16  # the most rows one launch takes (the engine's fused path uses up to KernelConfig.fused_decode_rows)

PLANES = {PLAIN: 1, PER_CHANNEL: 1, INT4: 8, INT8: 4, FP8: 4, INT8_ZERO: 4, INT4_K: 8}  # inputs a word
MAGIC = 0x4B000000  # the float 2^23: a small integer OR-ed into its mantissa is 2^23 + it


@dataclass(frozen=True)
class GemvSlicing:
    """One launch's tiling: output features per program, K per slice, warps."""

    block_n: int
    block_k: int
    num_warps: int


@dataclass(frozen=True)
class KernelWeight:
    """A weight as the kernels take it: `data` holds the tiles (int4, int8: the stored bytes viewed
    as int32 words), `scale` and `zero` their factors (`data` itself where there are none), with
    the row strides of `data` and of the scales, in elements."""

    data: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    stride_wn: int
    stride_sn: int
    quant: int  # PLAIN, PER_CHANNEL, INT4, INT4_K, INT8, FP8 or INT8_ZERO (ferrum.kernels.planes)
    group: int  # int4's inputs per scale, int8 / fp8 with groups theirs; 1: a scale per row
    out_rows: int
    in_features: int

    @property
    def planes(self) -> int:
        """Inputs a word (the kernels' PLANES): the narrowest K slice; K slices are multiples of it."""
        return PLANES[self.quant]

    def check_slice(self, block_k: int) -> None:
        if block_k % self.planes:
            raise ValueError(f"quantized GEMV: a K slice of {block_k} inputs is not whole words of {self.planes}; "
                             "widen the table's k_slice")


def kernel_weight(weight: torch.Tensor | QuantWeight) -> KernelWeight:
    """`weight` as the GEMV kernels read it; ValueError naming what is off in a QuantWeight's layout."""
    if isinstance(weight, torch.Tensor):
        assert weight.dim() == 2 and weight.stride(1) == 1, (weight.shape, weight.stride())
        return KernelWeight(weight, weight, weight, weight.stride(0), 0, PLAIN, 1, weight.shape[0], weight.shape[1])
    q, scale, n = weight.qweight, weight.scale, weight.out_features
    if q.dim() != 2 or q.stride(1) != 1:
        raise ValueError(f"{weight.kind} weight: qweight must be 2-D with unit stride along K, got "
                         f"{tuple(q.shape)} strides {q.stride()}")
    if weight.kind in ("int8", "fp8") and weight.group_size:
        stored = torch.int8 if weight.kind == "int8" else torch.float8_e4m3fn
        k, g = weight.in_features, weight.group_size
        groups = -(-k // g)
        if (q.dtype != stored or scale.dtype != torch.float32 or tuple(scale.shape) != (n, groups)
                or scale.stride(1) != 1 or k % 4 or q.stride(0) % 4 or g < 16 or g & (g - 1)):
            raise ValueError(f"{weight.kind} weight with groups of {g}: expected qweight {stored} [N, K] with K a "
                             f"multiple of 4, a float32 scale [N, ceil(K/group)] = [{n}, {groups}] with unit stride "
                             f"along the groups and a power-of-two group >= 16; got qweight {q.dtype} "
                             f"{tuple(q.shape)}, scale {scale.dtype} {tuple(scale.shape)} {scale.stride()}")
        zeros = scale if weight.zero is None else weight.zero
        if weight.zero is not None:  # int8 with a zero per group too (w = q * scale + zero): the GEMMs take it
            if weight.kind != "int8" or zeros.dtype != torch.float32 or zeros.shape != scale.shape or (
                    zeros.stride() != scale.stride()):
                raise ValueError(f"{weight.kind} weight with zeros per group: expected int8 and a float32 zero of the "
                                 f"scale's shape and strides {tuple(scale.shape)} {scale.stride()}, got "
                                 f"{zeros.dtype} {tuple(zeros.shape)} {zeros.stride()}")
        words = q.view(torch.int32)
        quant = FP8 if weight.kind == "fp8" else INT8 if weight.zero is None else INT8_ZERO
        return KernelWeight(words, scale, zeros, words.stride(0), scale.stride(0), quant, g, n, k)
    if weight.kind in ("int8", "fp8"):
        stored = torch.int8 if weight.kind == "int8" else torch.float8_e4m3fn
        if q.dtype != stored or scale.dtype != torch.float32 or tuple(scale.shape) != (n,) or scale.stride(0) != 1:
            raise ValueError(f"{weight.kind} weight: expected qweight {stored} [N, K] and a contiguous float32 scale "
                             f"[N]; got qweight {q.dtype} {tuple(q.shape)}, scale {scale.dtype} {tuple(scale.shape)}")
        if weight.in_features % 4 == 0 and q.stride(0) % 4 == 0:
            words = q.view(torch.int32)  # four inputs a word
            return KernelWeight(words, scale, scale, words.stride(0), 1, INT8 if weight.kind == "int8" else FP8, 1, n,
                                weight.in_features)
        return KernelWeight(q, scale, scale, q.stride(0), 1, PER_CHANNEL, 1, n, weight.in_features)
    if weight.kind != "int4":
        raise ValueError(f"GEMV: unknown quantized weight kind {weight.kind!r}")
    k, g, zero = weight.in_features, weight.group_size, weight.zero
    if q.dtype != torch.uint8 or zero is None or g < 16 or g & (g - 1) or k % 8 or q.stride(0) % 4:
        raise ValueError(f"int4 weight: expected uint8 qweight [N, K/2] with K a multiple of 8 (words of 8 inputs), "
                         f"a zero, and a power-of-two group size >= 16; got qweight {q.dtype} {tuple(q.shape)} "
                         f"strides {q.stride()}, zero {'missing' if zero is None else 'set'}, group size {g}")
    groups = -(-k // g)  # input k is in group k // g; the last group may hold fewer than g inputs
    words = q.view(torch.int32)  # K is a multiple of 8: a row is whole words (a word never spans two groups)
    if weight.sub_scales:
        supers = -(-groups // SUPER_GROUPS)
        if (g != 32 or scale.dtype != torch.int16 or zero.dtype != torch.int64 or tuple(scale.shape) != (n, groups)
                or tuple(zero.shape) != (n, supers) or scale.stride(1) != 1 or zero.stride(1) != 1
                or zero.stride(0) != -(-scale.stride(0) // SUPER_GROUPS)):
            raise ValueError(f"int4 weight with sub-scales: expected groups of 32, int16 sub-scales [N, ceil(K/32)] = "
                             f"[{n}, {groups}] and int64 super-block factors [N, ceil(K/256)] = [{n}, {supers}], both "
                             f"with unit stride along K and rows of ceil(groups / 8) factors; got group {g}, "
                             f"{scale.dtype} {tuple(scale.shape)} {scale.stride()} and {zero.dtype} "
                             f"{tuple(zero.shape)} {zero.stride()}")
        return KernelWeight(words, scale, zero, words.stride(0), scale.stride(0), INT4_K, g, n, k)
    if (tuple(scale.shape) != (n, groups) or tuple(zero.shape) != (n, groups) or scale.stride(1) != 1
            or zero.stride() != scale.stride() or zero.dtype != scale.dtype):
        raise ValueError(f"int4 weight: scale and zero must be [N, ceil(K/group)] = [{n}, {groups}] with unit stride "
                         f"along the groups and the same strides; got {tuple(scale.shape)} {scale.stride()} and "
                         f"{tuple(zero.shape)} {zero.stride()}")
    return KernelWeight(words, scale, zero, words.stride(0), scale.stride(0), INT4, g, n, k)


@triton.jit
def _load_weights(w_rows: tl.tensor, nmask: tl.tensor, k0: tl.tensor, K: tl.tensor, BLOCK_K: tl.constexpr,
                  WHOLE_K: tl.constexpr) -> tl.tensor:
    """The [BLOCK_N, BLOCK_K] slice of inputs k0..k0+BLOCK_K of the weight rows at w_rows, as stored;
    masked along K where the slice is all of K."""
    k = k0 + tl.arange(0, BLOCK_K)
    if WHOLE_K:
        wmask = nmask[:, None] & (k < K)[None, :]
    else:
        wmask = nmask[:, None]
    return tl.load(w_rows + k[None, :], mask=wmask, other=0.0)


@triton.jit
def _product(acc: tl.tensor, x: tl.tensor, w: tl.tensor) -> tl.tensor:
    """acc [ROWS, BLOCK_N] + x [ROWS, BLOCK_K] @ w [BLOCK_N, BLOCK_K].T, a float32 multiply-reduce."""
    acc += tl.sum(x.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :], axis=2)
    return acc


@triton.jit
def _gemv_tile(acc: tl.tensor, acc2: tl.tensor, ss: tl.tensor, X: tl.tensor, NW: tl.tensor,
               w_rows: tl.tensor, w_rows2: tl.tensor, xrows: tl.tensor, rmask: tl.tensor, nmask: tl.tensor,
               k0: tl.tensor, K: tl.tensor, eps: tl.tensor, stride_xm: tl.tensor, BLOCK_K: tl.constexpr,
               NORM: tl.constexpr, GATED: tl.constexpr, WHOLE_K: tl.constexpr = False, w: tl.tensor | None = None,
               w2: tl.tensor | None = None) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """The slice of inputs k0..k0+BLOCK_K of the product, weights read as [BLOCK_N, BLOCK_K] tiles
    (WHOLE_K: the slice is all of K, masked where K is not a power of two; w, w2: the slice of the
    weights, when already loaded)."""
    k = k0 + tl.arange(0, BLOCK_K)
    if WHOLE_K:
        kmask = k < K
        xmask = rmask[:, None] & kmask[None, :]
    else:
        xmask = rmask[:, None]
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
        w = _load_weights(w_rows, nmask, k0, K, BLOCK_K, WHOLE_K)
    acc = _product(acc, x, w)
    if GATED:
        if w2 is None:
            w2 = _load_weights(w_rows2, nmask, k0, K, BLOCK_K, WHOLE_K)
        acc2 = _product(acc2, x, w2)
    return acc, acc2, ss


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
def _first_weights(w_rows: tl.tensor, w_rows2: tl.tensor, nmask: tl.tensor, K: tl.tensor, BLOCK_K: tl.constexpr,
                   GATED: tl.constexpr, PDL: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """The weights of a program's first K slice, loaded before pdl_wait: they do not depend on the
    kernel before."""
    w = _load_weights(w_rows, nmask, 0, K, BLOCK_K, True)
    w2 = w
    if GATED:
        w2 = _load_weights(w_rows2, nmask, 0, K, BLOCK_K, True)
    pdl_wait(PDL)
    return w, w2


@triton.jit
def _chunk1(n: tl.constexpr) -> tl.tensor:
    """arange(0, n) that the compiler sees as runs of 1 (its loads: one element a thread, threads
    along it; the same values)."""
    r = tl.arange(0, n)
    return tl.where(r >= 0, r, 0)


@triton.jit
def _load_words(w_cols: tl.tensor, nmask: tl.tensor, k0: tl.tensor, K: tl.tensor, BLOCK_K: tl.constexpr,
                WHOLE_K: tl.constexpr, PLANES: tl.constexpr) -> tl.tensor:
    """The words of inputs k0..k0+BLOCK_K of the weight rows whose starts are w_cols [1, BLOCK_N]:
    [BLOCK_K / PLANES, BLOCK_N] int32, one word a thread with consecutive threads on consecutive
    words of a row (coalesced), the layout that x's planes have (see _planes_slice)."""
    kw = k0 // PLANES + _chunk1(BLOCK_K // PLANES)
    if WHOLE_K:
        wmask = nmask[None, :] & (kw < K // PLANES)[:, None]
    else:
        wmask = nmask[None, :] & (kw >= 0)[:, None]
    return tl.load(w_cols + kw[:, None], mask=wmask, other=0)


@triton.jit
def _planes_slice(acc: tl.tensor, acc2: tl.tensor, ss: tl.tensor, X: tl.tensor, NW: tl.tensor, w_cols: tl.tensor,
                  w_cols2: tl.tensor, s_cols: tl.tensor, s_cols2: tl.tensor, z_cols: tl.tensor, z_cols2: tl.tensor,
                  xrows: tl.tensor, rmask: tl.tensor, nmask: tl.tensor, k0: tl.tensor, K: tl.tensor, eps: tl.tensor,
                  stride_xm: tl.tensor, magic: tl.tensor, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
                  GATED: tl.constexpr, GROUP: tl.constexpr, PLANES: tl.constexpr, WHOLE_K: tl.constexpr = False,
                  w: tl.tensor | None = None, w2: tl.tensor | None = None, QUANT: tl.constexpr = 0,
                  ASM: tl.constexpr = False) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """One K slice for weights read as planes (int4, int8): x as [ROWS, KW, PLANES] (KW = BLOCK_K /
    PLANES words; 16 or 8 contiguous bytes a thread), the norm as _gemv_tile applies it; acc, acc2
    [ROWS, KW, BLOCK_N] (summed over KW after the K loop), ss [ROWS, KW]."""
    KW: tl.constexpr = BLOCK_K // PLANES
    k = k0 + PLANES * tl.arange(0, KW)[:, None] + tl.arange(0, PLANES)[None, :]
    if WHOLE_K:
        kmask = k < K
        xmask = rmask[:, None, None] & kmask[None, :, :]
    else:
        xmask = rmask[:, None, None]
    x = tl.load(X + xrows[:, None, None] * stride_xm + k[None, :, :], mask=xmask, other=0.0)
    xf = x.to(tl.float32)
    if NORM:
        if WHOLE_K:  # the whole row at hand: HF's order of operations exactly
            rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(xf * xf, axis=2), axis=1) / K + eps)
            normed = (xf * rstd[:, None, None]).to(x.dtype).to(tl.float32)
            nw = tl.load(NW + k, mask=kmask, other=0.0).to(tl.float32)
        else:  # the norm's weight goes in now, the 1/rms factor after the product
            ss += tl.sum(xf * xf, axis=2)
            normed = xf
            nw = tl.load(NW + k).to(tl.float32)
        xf = (nw[None, :, :] * normed).to(x.dtype).to(tl.float32)
    if w is None:
        w = _load_words(w_cols, nmask, k0, K, BLOCK_K, WHOLE_K, PLANES)
    acc = _planes_product(acc, xf, w, s_cols, z_cols, nmask, k0, K, magic, GROUP, PLANES, WHOLE_K, QUANT, ASM)
    if GATED:
        if w2 is None:
            w2 = _load_words(w_cols2, nmask, k0, K, BLOCK_K, WHOLE_K, PLANES)
        acc2 = _planes_product(acc2, xf, w2, s_cols2, z_cols2, nmask, k0, K, magic, GROUP, PLANES, WHOLE_K, QUANT,
                               ASM)
    return acc, acc2, ss


@triton.jit
def _planes_product(acc: tl.tensor, xf: tl.tensor, w: tl.tensor, s_cols: tl.tensor, z_cols: tl.tensor,
                    nmask: tl.tensor, k0: tl.tensor, K: tl.tensor, magic: tl.tensor, GROUP: tl.constexpr,
                    PLANES: tl.constexpr, WHOLE_K: tl.constexpr, QUANT: tl.constexpr = 0,
                    ASM: tl.constexpr = False) -> tl.tensor:
    """acc [ROWS, KW, BLOCK_N] + each word's products: plane i of the words w [KW, BLOCK_N] times
    plane i of xf [ROWS, KW, PLANES] (float32, input PLANES * j + i at [:, j, i]), summed over the
    planes; int4: times the word's group scale, plus its zero times the sum of the word's x (int8's
    per-channel scale comes after the K loop)."""
    p = tl.arange(0, PLANES)
    if QUANT == 5:  # fp8: the hardware's conversion, no offsets
        f0, f1, f2, f3 = fp8_planes(w, ASM)
        x0 = tl.sum(tl.where(p[None, None, :] == 0, xf, 0.0), axis=2)[:, :, None]
        x1 = tl.sum(tl.where(p[None, None, :] == 1, xf, 0.0), axis=2)[:, :, None]
        x2 = tl.sum(tl.where(p[None, None, :] == 2, xf, 0.0), axis=2)[:, :, None]
        x3 = tl.sum(tl.where(p[None, None, :] == 3, xf, 0.0), axis=2)[:, :, None]
        fp8_part = x0 * f0[None, :, :] + x1 * f1[None, :, :] + x2 * f2[None, :, :] + x3 * f3[None, :, :]
        if GROUP > 1:  # block scales: each word's group's
            return acc + fp8_part * _word_scales(s_cols, nmask, k0, K, w.shape[0], GROUP, PLANES, WHOLE_K)[None, :, :]
        return acc + fp8_part
    if PLANES == 4:
        w = w ^ -2139062144  # 0x80808080: each byte's q + 128
    # each word's sum starts from minus its x times the planes' offsets: the offsets cancel within
    # the word, before the float32 sums grow
    # (the even planes share one offset, the odd ones another: two sums of x a word, not a product an input)
    x_even = tl.sum(tl.where(p[None, None, :] % 2 == 0, xf, 0.0), axis=2)
    x_odd = tl.sum(tl.where(p[None, None, :] % 2 == 1, xf, 0.0), axis=2)
    if PLANES == 8:  # each input's float from _plane less its value: 2^8 + 8, 2^4 + 8 (q - 8)
        c = 264.0 * x_even + 24.0 * x_odd
    else:  # 2^16 + 128, 2^8 + 128 (q)
        c = 65664.0 * x_even + 384.0 * x_odd
    part = tl.broadcast_to(-c[:, :, None], acc.shape)
    for i in tl.static_range(PLANES):
        x_i = tl.sum(tl.where(p[None, None, :] == i, xf, 0.0), axis=2)  # in-thread: the compiler picks the register
        part += x_i[:, :, None] * plane(w, magic, i, PLANES)[None, :, :]
    if PLANES == 8:
        g = (k0 + 8 * _chunk1(w.shape[0])) // GROUP  # each word's group (a word never spans two)
        if WHOLE_K:  # words past K (their x and w are 0) read no scale; the last group may be ragged
            gmask = nmask[None, :] & (g < (K + GROUP - 1) // GROUP)[:, None]
        else:
            gmask = nmask[None, :] & (g >= 0)[:, None]
        s, z = group_factors(s_cols, z_cols, g[:, None], gmask, QUANT)
        acc += part * s[None, :, :] + (x_even + x_odd)[:, :, None] * z[None, :, :]
    elif GROUP > 1:  # int8 with a scale per group (and with INT8_ZERO its zero times the word's x sum)
        acc += part * _word_scales(s_cols, nmask, k0, K, w.shape[0], GROUP, PLANES, WHOLE_K)[None, :, :]
        if QUANT == 6:
            acc += (x_even + x_odd)[:, :, None] * _word_scales(z_cols, nmask, k0, K, w.shape[0], GROUP, PLANES,
                                                                WHOLE_K)[None, :, :]
    else:
        acc += part
    return acc


@triton.jit
def _word_scales(s_cols: tl.tensor, nmask: tl.tensor, k0: tl.tensor, K: tl.tensor, KW: tl.constexpr,
                 GROUP: tl.constexpr, PLANES: tl.constexpr, WHOLE_K: tl.constexpr) -> tl.tensor:
    """The scales [KW, BLOCK_N] of the groups the slice's words at k0 are in (a word never spans two;
    words past K, whose x is 0, read none)."""
    g = (k0 + PLANES * _chunk1(KW)) // GROUP
    gmask = nmask[None, :] & (g < (K + GROUP - 1) // GROUP)[:, None]
    return tl.load(s_cols + g[:, None], mask=gmask, other=0.0).to(tl.float32)


@triton.jit
def _planes_products(X: tl.tensor, W: tl.tensor, S: tl.tensor, Z: tl.tensor, NW: tl.tensor, n: tl.tensor,
                     n2: tl.tensor, nmask: tl.tensor, xrows: tl.tensor, rmask: tl.tensor, K: tl.tensor,
                     eps: tl.tensor, stride_xm: tl.tensor, stride_wn: tl.tensor, stride_sn: tl.tensor,
                     magic: tl.tensor, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     NORM: tl.constexpr, GATED: tl.constexpr, GROUP: tl.constexpr, PLANES: tl.constexpr,
                     WHOLE_K: tl.constexpr, PDL: tl.constexpr, QUANT: tl.constexpr = 0,
                     ASM: tl.constexpr = False) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """_tile_products for weights read as planes: the sums stay [ROWS, KW, BLOCK_N] through the K
    loop and are summed over KW once."""
    KW: tl.constexpr = BLOCK_K // PLANES
    w_cols = W + n[None, :].to(tl.int64) * stride_wn
    w_cols2 = W + n2[None, :].to(tl.int64) * stride_wn
    s_cols, s_cols2 = S + (n * stride_sn)[None, :], S + (n2 * stride_sn)[None, :]
    stride_zn = factor_stride(stride_sn, QUANT)
    z_cols, z_cols2 = Z + (n * stride_zn)[None, :], Z + (n2 * stride_zn)[None, :]
    acc = tl.zeros([ROWS, KW, BLOCK_N], tl.float32)
    acc2 = tl.zeros([ROWS, KW, BLOCK_N], tl.float32)
    ss = tl.zeros([ROWS, KW], tl.float32)
    k_begin = 0
    if PDL > 0:  # the first slice's weights are on their way while the kernel before finishes
        w = _load_words(w_cols, nmask, 0, K, BLOCK_K, True, PLANES)
        w2 = w
        if GATED:
            w2 = _load_words(w_cols2, nmask, 0, K, BLOCK_K, True, PLANES)
        pdl_wait(PDL)
        acc, acc2, ss = _planes_slice(acc, acc2, ss, X, NW, w_cols, w_cols2, s_cols, s_cols2, z_cols, z_cols2, xrows,
                                      rmask, nmask, 0, K, eps, stride_xm, magic, BLOCK_K, NORM, GATED, GROUP, PLANES,
                                      WHOLE_K, w, w2, QUANT, ASM)
        k_begin += BLOCK_K
    elif WHOLE_K:
        acc, acc2, ss = _planes_slice(acc, acc2, ss, X, NW, w_cols, w_cols2, s_cols, s_cols2, z_cols, z_cols2, xrows,
                                      rmask, nmask, 0, K, eps, stride_xm, magic, BLOCK_K, NORM, GATED, GROUP, PLANES,
                                      True, None, None, QUANT, ASM)
    if not WHOLE_K:
        for k0 in range(k_begin, K, BLOCK_K):
            acc, acc2, ss = _planes_slice(acc, acc2, ss, X, NW, w_cols, w_cols2, s_cols, s_cols2, z_cols, z_cols2,
                                          xrows, rmask, nmask, k0, K, eps, stride_xm, magic, BLOCK_K, NORM, GATED,
                                          GROUP, PLANES, False, None, None, QUANT, ASM)
    return tl.sum(acc, axis=1), tl.sum(acc2, axis=1), tl.sum(ss, axis=1)


@triton.jit
def _tile_products(X: tl.tensor, W: tl.tensor, NW: tl.tensor, n: tl.tensor, n2: tl.tensor, nmask: tl.tensor,
                   xrows: tl.tensor, rmask: tl.tensor, K: tl.tensor, eps: tl.tensor, stride_xm: tl.tensor,
                   stride_wn: tl.tensor, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   NORM: tl.constexpr, GATED: tl.constexpr, WHOLE_K: tl.constexpr,
                   PDL: tl.constexpr) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """The products of the rows with weight rows n (and n2: gated) over all of K, weights read as
    [BLOCK_N, BLOCK_K] tiles: (acc, acc2 [ROWS, BLOCK_N], the rows' sums of squares [ROWS] where
    the norm's 1/rms comes after the product)."""
    acc = tl.zeros([ROWS, BLOCK_N], tl.float32)
    acc2 = tl.zeros([ROWS, BLOCK_N], tl.float32)
    ss = tl.zeros([ROWS, BLOCK_K], tl.float32)
    w_rows = W + n[:, None].to(tl.int64) * stride_wn
    w_rows2 = W + n2[:, None].to(tl.int64) * stride_wn
    k_begin = 0
    if PDL > 0:  # the first slice's weights are on their way while the kernel before finishes
        w, w2 = _first_weights(w_rows, w_rows2, nmask, K, BLOCK_K, GATED, PDL)
        acc, acc2, ss = _gemv_tile(acc, acc2, ss, X, NW, w_rows, w_rows2, xrows, rmask, nmask, 0, K, eps, stride_xm,
                                   BLOCK_K, NORM, GATED, WHOLE_K, w, w2)
        k_begin += BLOCK_K
    elif WHOLE_K:  # one slice: the norm is applied before the product, as HF applies it
        acc, acc2, ss = _gemv_tile(acc, acc2, ss, X, NW, w_rows, w_rows2, xrows, rmask, nmask, 0, K, eps, stride_xm,
                                   BLOCK_K, NORM, GATED, True)
    if not WHOLE_K:
        for k0 in range(k_begin, K, BLOCK_K):
            acc, acc2, ss = _gemv_tile(acc, acc2, ss, X, NW, w_rows, w_rows2, xrows, rmask, nmask, k0, K, eps,
                                       stride_xm, BLOCK_K, NORM, GATED)
    return acc, acc2, tl.sum(ss, axis=1)


@triton.jit
def _products(X: tl.tensor, W: tl.tensor, S: tl.tensor, Z: tl.tensor, NW: tl.tensor, n: tl.tensor, n2: tl.tensor,
              nmask: tl.tensor, xrows: tl.tensor, rmask: tl.tensor, K: tl.tensor, eps: tl.tensor,
              stride_xm: tl.tensor, stride_wn: tl.tensor, stride_sn: tl.tensor, magic: tl.tensor,
              ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr,
              GATED: tl.constexpr, QUANT: tl.constexpr, GROUP: tl.constexpr, PLANES: tl.constexpr,
              WHOLE_K: tl.constexpr, PDL: tl.constexpr, ASM: tl.constexpr = False,
              WPT: tl.constexpr = 1, A8: tl.constexpr = False) -> tuple[tl.tensor, tl.tensor]:
    """x (RMS-normed when NORM) times weight rows n and n2 (gated) over all of K, float32 [ROWS,
    BLOCK_N] each, per-channel scales applied: by tiles or, for int4 / int8 / fp8 words, by planes
    (int4 and int8 with WPT > 1: in chunks of WPT words a thread, ferrum.kernels.gemv_chunks; A8: int4
    times x as int8, gemv_chunks.int8_inputs)."""
    if PLANES > 1 and WPT > 1:  # (one row: chunk_words)
        acc, acc2, sumsq = chunk_products(X, W, S, Z, NW, n, n2, nmask, xrows, K, eps, stride_xm, stride_wn,
                                          stride_sn, magic, BLOCK_N, BLOCK_K, NORM, GATED, GROUP, WPT, PLANES, QUANT,
                                          WHOLE_K, PDL, A8, ASM)
    elif PLANES > 1:
        acc, acc2, sumsq = _planes_products(X, W, S, Z, NW, n, n2, nmask, xrows, rmask, K, eps, stride_xm, stride_wn,
                                            stride_sn, magic, ROWS, BLOCK_N, BLOCK_K, NORM, GATED, GROUP, PLANES,
                                            WHOLE_K, PDL, QUANT, ASM)
    else:
        acc, acc2, sumsq = _tile_products(X, W, NW, n, n2, nmask, xrows, rmask, K, eps, stride_xm, stride_wn, ROWS,
                                          BLOCK_N, BLOCK_K, NORM, GATED, WHOLE_K, PDL)
    if (QUANT == 1 or QUANT == 3 or QUANT == 5) and GROUP == 1:  # int8 / fp8: the per-output-channel scales
        acc = acc * tl.load(S + n, mask=nmask, other=0.0)[None, :]
        if GATED:
            acc2 = acc2 * tl.load(S + n2, mask=nmask, other=0.0)[None, :]
    if NORM and not WHOLE_K:
        rstd = 1.0 / tl.sqrt(sumsq / K + eps)
        acc = acc * rstd[:, None]
        acc2 = acc2 * rstd[:, None]
    return acc, acc2


@triton.jit
def _gemv_kernel(X: tl.tensor, W: tl.tensor, S: tl.tensor, Z: tl.tensor, B: tl.tensor, R: tl.tensor, NW: tl.tensor,
                 OUT: tl.tensor, IDX: tl.tensor, M: tl.tensor, N: tl.tensor, K: tl.tensor, stride_xm: tl.tensor,
                 stride_wn: tl.tensor, stride_sn: tl.tensor, stride_rm: tl.tensor, stride_om: tl.tensor,
                 eps: tl.tensor, magic: tl.tensor, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 NORM: tl.constexpr, BIAS: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr,
                 WHOLE_K: tl.constexpr, PDL: tl.constexpr = 0, X_GATHER: tl.constexpr = False,
                 R_GATHER: tl.constexpr = False, QUANT: tl.constexpr = 0, GROUP: tl.constexpr = 1,
                 PLANES: tl.constexpr = 1, ASM: tl.constexpr = False, WPT: tl.constexpr = 1,
                 A8: tl.constexpr = False) -> None:
    """X_GATHER / R_GATHER: X / R are tables whose rows IDX[0..M-1] are the input / residual rows
    (the embedding table, for the first layer: no separate gather kernel; see STEP_START).
    QUANT: W's storage (PLAIN; PER_CHANNEL, INT8, FP8: S the rows' scales, or the groups' with GROUP >
    1; INT4, INT8_ZERO: S and Z the groups' scales and zeros, GROUP inputs each); PLANES: inputs a word
    of W (INT4 8, INT8 and FP8 4; 1: tiles); magic: MAGIC (in a register); ASM: fp8's conversion in
    inline PTX (a GPU; Triton's interpreter, which runs no PTX, takes the bits' arithmetic); WPT: the
    words a thread reads at once (gemv_chunks.chunk_words); A8: x as int8 (gemv_chunks.int8_inputs)."""
    act_ty = X.dtype.element_ty
    pid = tl.program_id(0)
    rows = tl.arange(0, ROWS)
    rmask = rows < M
    cols = tl.arange(0, BLOCK_N)
    n = pid * BLOCK_N + cols
    n2 = n + N  # the up rows of a gate/up weight
    nmask = n < N
    xrows, rrows = _row_offsets(IDX, rows, rmask, X_GATHER, R_GATHER)
    acc, acc2 = _products(X, W, S, Z, NW, n, n2, nmask, xrows, rmask, K, eps, stride_xm, stride_wn, stride_sn, magic,
                          ROWS, BLOCK_N, BLOCK_K, NORM, GATED, QUANT, GROUP, PLANES, WHOLE_K, PDL, ASM, WPT, A8)
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


def slicing(k: int, rows: int, table: GemvTable, norm: bool = False, min_k: int = 1, n: int = 0) -> GemvSlicing:
    """The tiling of a projection over K inputs to `n` outputs (0: not said) for `rows` rows, by
    `table` (see GemvTable: at one row, the whole of K in one slice up to its limit with or without a
    fused norm, then without a norm in programs of whole_k_features outputs where the table sets it,
    else k_slice-wide slices; for 2-4 rows the slices shrink with the rows, so that the rows x features
    x slice products stay in registers). min_k: the narrowest slice (int4: a word of 8 inputs; K a
    multiple of it). A table's whole_k_max_outputs holds its whole-K rule without a norm to products of
    at most that many outputs (n said and within it)."""
    if rows > 1:
        block_k = max(table.k_slice // triton.next_power_of_2(rows), min_k)
        while k % block_k:
            block_k //= 2
        return GemvSlicing(table.features_per_program, max(block_k, 1), table.num_warps)
    narrow = not table.whole_k_max_outputs or 0 < n <= table.whole_k_max_outputs
    without_norm, whole_features = (table.whole_k_without_norm, table.whole_k_features) if narrow else \
        (min(table.whole_k_without_norm, table.k_slice), 0)
    whole_limit = table.whole_k_with_norm if norm else without_norm
    if k <= whole_limit or (k <= table.whole_k_with_norm and k % table.k_slice):
        features = whole_features if whole_features and not norm else table.features_per_program
        return GemvSlicing(features, triton.next_power_of_2(k), table.num_warps)
    block_k = max(table.k_slice, min_k)
    while k % block_k:
        block_k //= 2
    return GemvSlicing(table.features_per_program, max(block_k, 1), table.num_warps)


def gemv(x: torch.Tensor, weight: torch.Tensor | QuantWeight, table: GemvTable, *, bias: torch.Tensor | None = None,
         norm_weight: torch.Tensor | None = None, eps: float = 1e-6, gated: bool = False,
         residual: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
         x_rows: torch.Tensor | None = None, residual_rows: torch.Tensor | None = None,
         pdl: bool = False, out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [M, K] with M <= 16; weight: [N, K] (or [2N, K] gate then up when gated), a tensor in
    x's dtype or a QuantWeight (then `table` is its kind's: KernelConfig.gemv_table).
    Returns [M, N]: x (RMS-normed first when norm_weight is given) times weight.T, plus bias,
    then silu(gate) * up when gated, then + residual. x_rows / residual_rows (int64 [M], the same
    tensor when both are given): x / residual are tables and these rows of them are the M rows.
    pdl: launched with programmatic dependent launch (never for a launch reading rows of a table:
    that is the step's first kernel, see STEP_START). out: [M, N] to write the result into."""
    index = x_rows if x_rows is not None else residual_rows
    assert x_rows is None or residual_rows is None or x_rows is residual_rows
    m = index.shape[0] if index is not None else x.shape[0]
    k = x.shape[1]
    kw = kernel_weight(weight)
    assert k == kw.in_features, (x.shape, kw.out_rows, kw.in_features)
    assert x.stride(1) == 1 and m <= MAX_ROWS
    n = kw.out_rows // 2 if gated else kw.out_rows
    cfg = slicing(k, m, table, norm=norm_weight is not None, min_k=kw.planes, n=n)
    kw.check_slice(cfg.block_k)
    whole_k = cfg.block_k >= k
    assert whole_k or k % cfg.block_k == 0, f"K={k} must be a multiple of {cfg.block_k}"
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype or x.dtype, device=x.device)
    assert out.shape == (m, n) and out.stride(1) == 1, (out.shape, m, n)
    pdl = pdl and x_rows is None
    wpt = chunk_words(kw.quant, kw.planes, kw.group, k, cfg.block_k) if m == 1 else 1
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, kw.data, kw.scale, kw.zero, bias if bias is not None else x, residual if residual is not None else x,
        norm_weight if norm_weight is not None else x, out, index if index is not None else x,
        m, n, k, x.stride(0), kw.stride_wn, kw.stride_sn, residual.stride(0) if residual is not None else 0,
        out.stride(0), eps, MAGIC,
        ROWS=triton.next_power_of_2(m), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        NORM=norm_weight is not None, BIAS=bias is not None, GATED=gated, RESIDUAL=residual is not None,
        WHOLE_K=whole_k, PDL=pdl_mode(pdl), X_GATHER=x_rows is not None, R_GATHER=residual_rows is not None,
        QUANT=kw.quant, GROUP=kw.group, PLANES=kw.planes, ASM=kw.data.is_cuda, WPT=wpt,
        A8=int8_inputs(kw.quant, wpt, table), num_warps=chunk_warps(cfg.block_k, wpt, kw.planes, cfg.num_warps),
        num_stages=2, **pdl_launch(pdl),
    )
    return out


@triton.jit
def _qkv_rope_kernel(X: tl.tensor, W: tl.tensor, S: tl.tensor, Z: tl.tensor, B: tl.tensor, NW: tl.tensor,
                     POS: tl.tensor, COS: tl.tensor, SIN: tl.tensor, SLOTS: tl.tensor, QOUT: tl.tensor, KC: tl.tensor,
                     VC: tl.tensor, KVS: tl.tensor, IDX: tl.tensor, M: tl.tensor, K: tl.tensor, stride_xm: tl.tensor,
                     stride_wn: tl.tensor, stride_sn: tl.tensor, stride_cs: tl.tensor, stride_qt: tl.tensor,
                     stride_qh: tl.tensor, stride_kc: tl.tensor, stride_kh: tl.tensor, eps: tl.tensor,
                     magic: tl.tensor, H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, BIAS: tl.constexpr,
                     WHOLE_K: tl.constexpr, PDL: tl.constexpr = 0, X_GATHER: tl.constexpr = False,
                     QUANT: tl.constexpr = 0, GROUP: tl.constexpr = 1, PLANES: tl.constexpr = 1,
                     ASM: tl.constexpr = False, WPT: tl.constexpr = 1, A8: tl.constexpr = False) -> None:
    """The q/k/v projection with rope and the KV-cache write as its epilogue: each program owns
    BLOCK_H dims of the first half of one head and the matching dims of the second half, the
    pairs the rotation mixes. QUANT, GROUP, PLANES, magic: W's storage, as in _gemv_kernel."""
    act_ty = X.dtype.element_ty
    pid = tl.program_id(0)
    per_head: tl.constexpr = (D // 2) // BLOCK_H
    head = pid // per_head
    d = (pid % per_head) * BLOCK_H + tl.arange(0, BLOCK_H)
    n = head * D + d
    n2 = n + D // 2
    rows = tl.arange(0, ROWS)
    rmask = rows < M
    nmask = d < D // 2
    # the step's positions, slots (and ids) are set before it starts (see _decode_kernel): read
    # before the wait
    xrows, _ = _row_offsets(IDX, rows, rmask, X_GATHER, False)
    slot = tl.load(SLOTS + rows, mask=rmask, other=0)
    pos = tl.load(POS + rows, mask=rmask, other=0)
    c = tl.load(COS + pos[:, None] * stride_cs + d[None, :]).to(act_ty).to(tl.float32)
    s = tl.load(SIN + pos[:, None] * stride_cs + d[None, :]).to(act_ty).to(tl.float32)
    acc, acc2 = _products(X, W, S, Z, NW, n, n2, nmask, xrows, rmask, K, eps, stride_xm, stride_wn, stride_sn, magic,
                          ROWS, BLOCK_H, BLOCK_K, NORM, True, QUANT, GROUP, PLANES, WHOLE_K, PDL, ASM, WPT, A8)
    if BIAS:
        acc += tl.load(B + n).to(tl.float32)[None, :]
        acc2 += tl.load(B + n2).to(tl.float32)[None, :]
    x1 = acc.to(act_ty).to(tl.float32)
    x2 = acc2.to(act_ty).to(tl.float32)
    if head < H + KV:
        y1 = x1 * c - x2 * s
        y2 = x2 * c + x1 * s
    else:
        y1 = x1
        y2 = x2
    if head < H:  # (q and the cache may differ in dtype: a pointer of each)
        q_dst = QOUT + rows[:, None] * stride_qt + head * stride_qh
        tl.store(q_dst + d[None, :], y1.to(act_ty), mask=rmask[:, None])
        tl.store(q_dst + D // 2 + d[None, :], y2.to(act_ty), mask=rmask[:, None])
    elif head < H + KV:
        k_dst = KC + slot[:, None] * stride_kc + (head - H) * stride_kh
        tl.store(k_dst + d[None, :], cache_value(y1.to(act_ty), KC, KVS, 0), mask=rmask[:, None])
        tl.store(k_dst + D // 2 + d[None, :], cache_value(y2.to(act_ty), KC, KVS, 0), mask=rmask[:, None])
    else:
        v_dst = VC + slot[:, None] * stride_kc + (head - H - KV) * stride_kh
        tl.store(v_dst + d[None, :], cache_value(y1.to(act_ty), VC, KVS, 1), mask=rmask[:, None])
        tl.store(v_dst + D // 2 + d[None, :], cache_value(y2.to(act_ty), VC, KVS, 1), mask=rmask[:, None])


# STEP_START: the kernels of a decode step read before their PDL wait what the step's inputs hold
# (ids, positions, slots, lengths, tables, the older KV cache), written by the step before (its
# argmax/advance kernel) or by host copies. So the step's first kernel, the first layer's (which
# reads its rows from the embedding table), is launched without PDL: it starts only once the
# step before has completed, and every later kernel launches after it. (In a CUDA graph the first
# node waits for the work before it anyway.)


def qkv_block_k(k: int, rows: int, table: GemvTable, min_k: int = 1) -> int:
    """K slice of the q/k/v kernel. A program holds four weight rows (the rotation's pairs): at one
    row from K = table.qkv_two_slices_from on, two slices keep twice the programs resident, so that
    all of them load their first slice while the kernel before runs (a 1B step 15 us shorter on an
    H100 than with one slice; the norm's 1/rms then comes after the product)."""
    block_k = slicing(k, rows, table, min_k=min_k).block_k
    return min(block_k, k // 2) if rows == 1 and k >= table.qkv_two_slices_from else block_k


def qkv_rope_store(x: torch.Tensor, weight: torch.Tensor | QuantWeight, bias: torch.Tensor | None,
                   norm_weight: torch.Tensor | None, eps: float, positions: torch.Tensor,
                   cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int, table: GemvTable,
                   x_rows: torch.Tensor | None = None, pdl: bool = False,
                   kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """RMSNorm (optional) -> q/k/v projection -> rope on q and k -> k and v into their cache
    slots, in one kernel for a few decode rows. Returns q: [M, H, D]. weight: a tensor or a
    QuantWeight (then `table` is its kind's). x_rows (int64 [M]): x is a table (the embedding) and
    these are the rows (then launched without PDL: see STEP_START). kv_scale: an fp8 cache's k and v
    scales ([2] float32)."""
    m = x_rows.shape[0] if x_rows is not None else x.shape[0]
    k = x.shape[1]
    kw = kernel_weight(weight)
    assert m <= MAX_ROWS and x.stride(1) == 1 and kw.in_features == k
    assert kw.out_rows == (num_heads + 2 * num_kv_heads) * head_dim, (kw.out_rows, num_heads, num_kv_heads, head_dim)
    rows = triton.next_power_of_2(m)
    # two rows a program (dims i and i + D/2) for bf16 weights, as measured; quantized weights have
    # fewer bytes a row: the table's features a program, each with its pair
    block_h = 1
    if kw.quant != PLAIN:
        while block_h * 2 <= table.features_per_program and (head_dim // 2) % (block_h * 2) == 0:
            block_h *= 2
    block_k = qkv_block_k(k, m, table, kw.planes)
    whole_k = block_k >= k
    while not whole_k and k % block_k:
        block_k //= 2
    kw.check_slice(block_k)
    wpt = chunk_words(kw.quant, kw.planes, kw.group, k, block_k) if m == 1 else 1
    q = torch.empty(m, num_heads, head_dim, dtype=x.dtype, device=x.device)
    grid = ((num_heads + 2 * num_kv_heads) * (head_dim // 2) // block_h,)
    pdl = pdl and x_rows is None
    _qkv_rope_kernel[grid](
        x, kw.data, kw.scale, kw.zero, bias if bias is not None else x, norm_weight if norm_weight is not None else x,
        positions, cos, sin, slots, q, k_cache, v_cache, scales_arg(kv_scale, k_cache),
        x_rows if x_rows is not None else x, m, k,
        x.stride(0), kw.stride_wn, kw.stride_sn, cos.stride(0), q.stride(0), q.stride(1), k_cache.stride(0),
        k_cache.stride(1), eps, MAGIC,
        H=num_heads, KV=num_kv_heads, D=head_dim, ROWS=rows, BLOCK_H=block_h, BLOCK_K=block_k,
        NORM=norm_weight is not None, BIAS=bias is not None, WHOLE_K=whole_k, PDL=pdl_mode(pdl),
        X_GATHER=x_rows is not None, QUANT=kw.quant, GROUP=kw.group, PLANES=kw.planes, ASM=kw.data.is_cuda,
        WPT=wpt, A8=int8_inputs(kw.quant, wpt, table), num_warps=chunk_warps(block_k, wpt, kw.planes, 4), num_stages=2,
        **pdl_launch(pdl),
    )
    return q
