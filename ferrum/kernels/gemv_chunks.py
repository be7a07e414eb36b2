"""The int4 and int8 products of the fused decode projections (ferrum.kernels.gemv) at one row, read
in chunks: each thread reads WPT consecutive int32 words of a weight row in one 16-byte load (WPT =
4: 32 int4 inputs, or 16 int8 inputs), and its inputs of x in as many bytes again, converted to
float32 once for all the program's rows. A chunk never spans two groups (groups at least a chunk
long, chunks aligned to their length), so a thread's words share one scale and one zero: one load
of each per row and chunk, one multiply-add for the scale and one for the zero, and one offset
term for the chunk (int8 with a scale per output channel: the scale after the K loop, as the
planes apply it). The planes are those of ferrum.kernels.planes: input i of a word as the float32
2^e + u by a shift and one logic op, times input i of x; the offsets (int4: 2^8 + 8 for the even
inputs, 2^4 + 8 for the odd ones, leaving q - 8; int8: 2^16 + 128 and 2^8 + 128, leaving q) are
taken off once a chunk, from the sums of its even and odd x.

Measured against reading one word a thread (gemv's planes), on an H100 at the Llama-3.1-8B shapes
(the 32-layer chain with a bf16 head, scripts/quant_gemv_bench.py, old and new in one run):
- int4: 2.60 -> 2.19 ms, 60% -> 72% of the bytes' floor. In the SASS for sm_90, the K loop of a
  program of 4 features over 2048 inputs takes 3.9 instructions an input instead of 6.2. Most of the
  difference was the per-word scale and zero loads, their addresses and conversions, and x's
  conversions.
- int8: 2.96 -> 2.86 ms, 89% -> 93-94%.
- fp8 in chunks ran slower (3.12 against 3.00 ms), so it keeps the planes.

The group factors of int4 and grouped int8 are loaded a K slice ahead (ptxas issued them late in the slice
that uses them; on an H200 the int4 chain 2.067 -> 2.002 ms, benchmarks/quantization.md); Q4_K's
(INT4_K) at the start of the product that uses them.

One row of x only: with a rows dimension the compiler moved the chunks' products through shared
memory between layouts (6.2 instructions an input again), so batches of 2-4 rows keep the planes.

int4 with int8 inputs (A8; GemvTable.int8_inputs, the default for int4): a thread's 32 inputs are one
chunk of x rounded to int8 with one step (the chunk's largest magnitude / 127: llama.cpp's Q8_1 block,
and the CPU's integer GEMVs' rounding), packed four to a word in the order of an int4 word's even and odd
nibbles; each weight word's 8 products are then two dp4a on its nibbles masked into bytes, exact in int32,
scaled once a chunk (x's step times the group's scale, and the zero times the chunk's sum of x as
rounded). In the SASS for sm_90 the down_proj K loop takes 2.70 instructions an input instead of 3.80
(gate/up 2.50 against 4.02: its x is rounded once for both weights). Measured on an H100 (Llama-3.1-8B,
scripts/quant_gemv_bench.py --kinds int4-a16,int4): gate/up 30.0 -> 24.9 us, q/k/v 9.4 -> 7.3 us, o and
down unchanged (4.8 -> 5.2, 14.3 -> 14.5: not bound by instructions); the 32-layer chain 2.170 -> 1.934 ms.
GGUF's Q4_K: its factors loaded a slice ahead too (see PREFETCH), the chain 2.249 -> 2.081 ms.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ferrum.kernels.config import GemvTable
from ferrum.kernels.pdl import pdl_wait
from ferrum.kernels.planes import INT4, INT4_K, INT8, INT8_ZERO, factor_stride, factors_of, load_factors, plane

CHUNK_WORDS = 4  # words a thread reads at once: 16 bytes


def chunk_words(quant: int, planes: int, group: int, k: int, block_k: int) -> int:
    """Words a thread reads at once for a weight stored as `quant` (ferrum.kernels.gemv's QUANT) in
    words of `planes` inputs, with K inputs in groups of `group` (1: a scale per output channel),
    read in K slices of `block_k`; 1 (gemv's one-word planes) for storage read as tiles, groups
    shorter than a chunk or K not whole chunks."""
    inputs = planes * CHUNK_WORDS
    if quant not in (INT4, INT4_K, INT8, INT8_ZERO):  # fp8's chain ran slower in chunks: 3.12 against 3.00 ms (H100)
        return 1
    if (group != 1 and group < inputs) or block_k < inputs or k % inputs:
        return 1
    return CHUNK_WORDS


def int8_inputs(quant: int, words: int, table: GemvTable) -> bool:
    """Whether a product reading `words` words a thread of a weight stored as `quant` takes x as int8
    (the table's int8_inputs, for int4 read in chunks: chunk_words > 1)."""
    return table.int8_inputs and words > 1 and quant in (INT4, INT4_K)


def chunk_warps(block_k: int, words: int, planes: int, num_warps: int) -> int:
    """Warps for a program whose K slice is `block_k` inputs read `words` words of `planes` inputs a
    thread: no more threads than chunks (a thread past them would repeat another's work)."""
    if words == 1:
        return num_warps
    return max(1, min(num_warps, block_k // (planes * words) // 32))


@triton.jit
def _split4(x: tl.tensor) -> tuple[tl.tensor, tl.tensor, tl.tensor, tl.tensor]:
    """x [..., 4] as its 4 entries [...] (in-thread: no data moves)."""
    a, b = tl.split(tl.reshape(x, x.shape[:-1] + [2, 2]))  # entries 0 2, 1 3
    x0, x2 = tl.split(a)
    x1, x3 = tl.split(b)
    return x0, x1, x2, x3


X8_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2^23: v + it holds round(v) in its low bits (|v| < 2^22), two's complement


@triton.jit
def _low_bytes(b0: tl.tensor, b1: tl.tensor, b2: tl.tensor, b3: tl.tensor, ASM: tl.constexpr) -> tl.tensor:
    """The low bytes of four int32s packed into one (b0 lowest): three byte permutes (ASM) or the bits'
    arithmetic (Triton's interpreter)."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 lo, hi;
            prmt.b32 lo, $1, $2, 0x0040;
            prmt.b32 hi, $3, $4, 0x0040;
            prmt.b32 $0, lo, hi, 0x5410;
            }""",
            constraints="=r,r,r,r,r", args=[b0, b1, b2, b3], dtype=tl.int32, is_pure=True, pack=1)
    return (b0 & 0xFF) | ((b1 & 0xFF) << 8) | ((b2 & 0xFF) << 16) | (b3 << 24)


@triton.jit
def _int8_chunks(x_even: tl.tensor, x_odd: tl.tensor,
                 ASM: tl.constexpr) -> tuple[tl.tensor, tl.tensor, tl.tensor, tl.tensor]:
    """A chunk's float32 inputs (even, odd [KT, WPT, 4], as _load_inputs gives them) as int8 with one step
    a chunk (its largest magnitude / 127, rounded to nearest): (xe, xo [KT, WPT] int32, each the 4 int8
    of the word's even / odd inputs in the order of an int4 word's even / odd nibbles; step [KT]
    float32; the sum of the chunk's int8 values [KT] int32). The rounding is one multiply-add: x / step
    + 1.5 * 2^23 holds round(x / step) in its low byte."""
    amax = tl.max(tl.max(tl.maximum(tl.abs(x_even), tl.abs(x_odd)), axis=2), axis=1)
    inv = tl.where(amax > 0.0, 127.0 / amax, 0.0)[:, None, None]
    e0, e1, e2, e3 = _split4((x_even * inv + X8_MAGIC).to(tl.int32, bitcast=True))  # 0x4B400000 + round(x / step)
    o0, o1, o2, o3 = _split4((x_odd * inv + X8_MAGIC).to(tl.int32, bitcast=True))
    xe = _low_bytes(e0, e1, e2, e3, ASM)
    xo = _low_bytes(o0, o1, o2, o3, ASM)
    total = tl.sum(_dot4(0x01010101, xe, ASM) + _dot4(0x01010101, xo, ASM), axis=1)
    return xe, xo, amax / 127.0, total


@triton.jit
def _dot4(a: tl.tensor, b: tl.tensor, ASM: tl.constexpr) -> tl.tensor:
    """The sum of the products of the four bytes of a (each 0..127) and b (signed): dp4a (ASM), or the
    bytes' arithmetic."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="dp4a.s32.s32 $0, $1, $2, 0;", constraints="=r,r,r", args=[a, b], dtype=tl.int32, is_pure=True,
            pack=1)
    total = (a & 0xFF) * ((b << 24) >> 24)
    total += ((a >> 8) & 0xFF) * ((b << 16) >> 24)
    total += ((a >> 16) & 0xFF) * ((b << 8) >> 24)
    return total + ((a >> 24) & 0xFF) * (b >> 24)


@triton.jit
def _int4_dot(w: tl.tensor, xe: tl.tensor, xo: tl.tensor, ASM: tl.constexpr) -> tl.tensor:
    """Each int4 word's sum of q times the int8 x of its 8 inputs (int32): the even nibbles by one mask,
    the odd ones by a shift and a mask, then two dp4a (ASM: a GPU; Triton's interpreter, which runs no
    PTX, takes the bytes' arithmetic)."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b32 lo, hi, t;
            and.b32 lo, $1, 0x0F0F0F0F;
            shr.u32 hi, $1, 4;
            and.b32 hi, hi, 0x0F0F0F0F;
            dp4a.s32.s32 t, lo, $2, 0;
            dp4a.s32.s32 $0, hi, $3, t;
            }""",
            constraints="=r,r,r,r", args=[w, xe, xo], dtype=tl.int32, is_pure=True, pack=1)
    return _dot4(w & 0x0F0F0F0F, xe, False) + _dot4((w >> 4) & 0x0F0F0F0F, xo, False)


@triton.jit
def _load_inputs(row: tl.tensor, k0: tl.tensor, K: tl.tensor, KT: tl.constexpr, WPT: tl.constexpr,
                 PLANES: tl.constexpr, WHOLE_K: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """Inputs k0..k0 + PLANES KT WPT of the row at `row` as float32 (even, odd) [KT, WPT, PLANES / 2]:
    input PLANES (WPT t + j) + 2 i at [t, j, i] and the next one beside it. bf16 read as int32 pairs,
    each half a float32 by one shift or one mask (the generic conversion takes two instructions for
    the upper half)."""
    PAIRS: tl.constexpr = PLANES // 2
    t = tl.arange(0, KT)
    pair = (PAIRS * WPT * t[:, None, None] + PAIRS * tl.arange(0, WPT)[None, :, None]
            + tl.arange(0, PAIRS)[None, None, :])
    if WHOLE_K:  # whole chunks (K is a multiple of the chunk): one mask a chunk keeps its loads whole
        mask = (t < K // (PLANES * WPT))[:, None, None]
    else:
        mask = (t >= 0)[:, None, None]
    if row.dtype.element_ty == tl.bfloat16:
        pairs = tl.load(row.to(tl.pointer_type(tl.int32), bitcast=True) + k0 // 2 + pair, mask=mask, other=0)
        return (pairs << 16).to(tl.float32, bitcast=True), (pairs & -65536).to(tl.float32, bitcast=True)
    k = k0 + 2 * pair[:, :, :, None] + tl.arange(0, 2)[None, None, None, :]
    x = tl.load(row + k, mask=mask[:, :, :, None], other=0.0).to(tl.float32)
    return tl.split(x)


@triton.jit
def _load_chunks(w_cols: tl.tensor, nmask: tl.tensor, k0: tl.tensor, K: tl.tensor, BLOCK_K: tl.constexpr,
                 WPT: tl.constexpr, PLANES: tl.constexpr, WHOLE_K: tl.constexpr) -> tl.tensor:
    """The words [KT, WPT, BLOCK_N] of inputs k0..k0+BLOCK_K of the rows whose starts are w_cols
    [1, 1, BLOCK_N]: WPT consecutive words a thread."""
    KT: tl.constexpr = BLOCK_K // (PLANES * WPT)
    t = tl.arange(0, KT)
    kw = k0 // PLANES + WPT * t[:, None, None] + tl.arange(0, WPT)[None, :, None]
    if WHOLE_K:  # whole chunks (K is a multiple of the chunk): one mask a chunk keeps its load one
        wmask = nmask[None, None, :] & (t < K // (PLANES * WPT))[:, None, None]
    else:
        wmask = nmask[None, None, :]
    return tl.load(w_cols + kw, mask=wmask, other=0)


@triton.jit
def _chunk_factors(s_cols: tl.tensor, z_cols: tl.tensor, nmask: tl.tensor, k0: tl.tensor, K: tl.tensor,
                   KT: tl.constexpr, GROUP: tl.constexpr, WPT: tl.constexpr, PLANES: tl.constexpr,
                   QUANT: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """The stored group factors [KT, BLOCK_N] of the K slice at k0's chunks, as loaded (planes.load_factors;
    GROUP > 1; the scale twice where there are no zeros; chunks past K read none)."""
    g = (k0 + PLANES * WPT * tl.arange(0, KT)) // GROUP  # each chunk's group
    gmask = nmask[None, :] & (g < (K + GROUP - 1) // GROUP)[:, None]  # the last group may be ragged
    if QUANT == 2 or QUANT == 6 or QUANT == 7:  # INT4, INT8_ZERO, INT4_K: a zero per group too
        s, z = load_factors(s_cols, z_cols, g[:, None], gmask, QUANT)
    else:
        s = tl.load(s_cols + g[:, None], mask=gmask, other=0.0)
        z = s
    return s, z


@triton.jit
def _chunk_product(acc: tl.tensor, x_even: tl.tensor, x_odd: tl.tensor, w: tl.tensor, s: tl.tensor, z: tl.tensor,
                   s_cols: tl.tensor, z_cols: tl.tensor, nmask: tl.tensor, k0: tl.tensor, K: tl.tensor,
                   magic: tl.tensor, GROUP: tl.constexpr, WPT: tl.constexpr, PLANES: tl.constexpr,
                   QUANT: tl.constexpr, AHEAD: tl.constexpr, step: tl.tensor, total: tl.tensor,
                   A8: tl.constexpr = False, ASM: tl.constexpr = False) -> tl.tensor:
    """acc [KT, BLOCK_N] + each chunk's product: x (float32, the even and odd inputs of each word, [KT,
    WPT, PLANES / 2]) times the words w [KT, WPT, BLOCK_N], by planes; with groups, times the chunk's
    group scale (plus its zero times the chunk's sum of x: int4, int8 with zeros), from s and z [KT, BLOCK_N]
    as _chunk_factors loaded them a slice ahead (AHEAD), else loaded here first. A8 (int4): x_even and
    x_odd are x as int8 (_int8_chunks: the packed words [KT, WPT], with each chunk's step and sum), and
    each word's products are two dp4a."""
    KT: tl.constexpr = w.shape[0]
    scale, zero = acc, acc  # (unread without groups)
    if GROUP > 1:  # made scales and zeros first: ptxas then issues the loads here, ahead of the products
        if not AHEAD:
            s, z = _chunk_factors(s_cols, z_cols, nmask, k0, K, KT, GROUP, WPT, PLANES, QUANT)
        scale, zero = factors_of(s, z, QUANT)
    if A8:  # int4 words times x as int8, dp4a a word
        dots = tl.sum(_int4_dot(w, x_even[:, :, None], x_odd[:, :, None], ASM), axis=1)  # sum of q x8 [KT, BLOCK_N]
        chunk = (dots - 8 * total[:, None]).to(tl.float32) * step[:, None]  # sum of x (q - 8)
        sums = total.to(tl.float32) * step  # the chunk's sum of x (as rounded), for the zeros
    elif PLANES == 8:  # int4
        x0, x2, x4, x6 = _split4(x_even)
        x1, x3, x5, x7 = _split4(x_odd)
        part = x0[:, :, None] * plane(w, magic, 0, 8)
        part += x1[:, :, None] * plane(w, magic, 1, 8)
        part += x2[:, :, None] * plane(w, magic, 2, 8)
        part += x3[:, :, None] * plane(w, magic, 3, 8)
        part += x4[:, :, None] * plane(w, magic, 4, 8)
        part += x5[:, :, None] * plane(w, magic, 5, 8)
        part += x6[:, :, None] * plane(w, magic, 6, 8)
        part += x7[:, :, None] * plane(w, magic, 7, 8)
        sum_even = tl.sum(x0 + x2 + x4 + x6, axis=1)
        sum_odd = tl.sum(x1 + x3 + x5 + x7, axis=1)
        chunk = tl.sum(part, axis=1) - (264.0 * sum_even + 24.0 * sum_odd)[:, None]  # sum of x (q - 8)
        sums = sum_even + sum_odd
    else:  # int8: four inputs a word
        x0, x2 = tl.split(x_even)
        x1, x3 = tl.split(x_odd)
        sum_even = tl.sum(x0 + x2, axis=1)
        sum_odd = tl.sum(x1 + x3, axis=1)
        u = w ^ -2139062144  # 0x80808080: each byte's q + 128
        part = x0[:, :, None] * plane(u, magic, 0, 4)
        part += x1[:, :, None] * plane(u, magic, 1, 4)
        part += x2[:, :, None] * plane(u, magic, 2, 4)
        part += x3[:, :, None] * plane(u, magic, 3, 4)
        chunk = tl.sum(part, axis=1) - (65664.0 * sum_even + 384.0 * sum_odd)[:, None]  # sum of x q
        sums = sum_even + sum_odd
    if GROUP == 1:  # a scale per output channel, after the K loop
        return acc + chunk
    if QUANT == 2 or QUANT == 6 or QUANT == 7:  # INT4, INT8_ZERO, INT4_K: a zero per group too
        return acc + chunk * scale + sums[:, None] * zero
    return acc + chunk * scale


@triton.jit
def _chunk_slice(acc: tl.tensor, acc2: tl.tensor, ss: tl.tensor, x_row: tl.tensor, NW: tl.tensor, w_cols: tl.tensor,
                 w_cols2: tl.tensor, s_cols: tl.tensor, s_cols2: tl.tensor, z_cols: tl.tensor, z_cols2: tl.tensor,
                 nmask: tl.tensor, k0: tl.tensor, K: tl.tensor, eps: tl.tensor, magic: tl.tensor,
                 BLOCK_K: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr, GROUP: tl.constexpr,
                 WPT: tl.constexpr, PLANES: tl.constexpr, QUANT: tl.constexpr, WHOLE_K: tl.constexpr,
                 s: tl.tensor, z: tl.tensor, s2: tl.tensor, z2: tl.tensor, AHEAD: tl.constexpr,
                 w: tl.tensor | None = None, w2: tl.tensor | None = None, A8: tl.constexpr = False,
                 ASM: tl.constexpr = False) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """One K slice of the row at x_row: x as [KT, WPT, PLANES / 2] pairs (a chunk's inputs a thread),
    the norm as gemv's _planes_slice applies it; acc, acc2 [KT, BLOCK_N], ss [KT]. w, w2: the slice's
    words where loaded already; s, z, s2, z2: its group factors where loaded a slice ahead (AHEAD;
    otherwise _chunk_product loads them)."""
    KT: tl.constexpr = BLOCK_K // (PLANES * WPT)
    x_even, x_odd = _load_inputs(x_row, k0, K, KT, WPT, PLANES, WHOLE_K)
    if NORM:
        act: tl.constexpr = x_row.dtype.element_ty
        nw_even, nw_odd = _load_inputs(NW, k0, K, KT, WPT, PLANES, WHOLE_K)
        if WHOLE_K:  # the whole row at hand: HF's order of operations exactly
            squares = tl.sum(tl.sum(x_even * x_even + x_odd * x_odd, axis=2), axis=1)
            rstd = 1.0 / tl.sqrt(tl.sum(squares, axis=0) / K + eps)
            x_even = (nw_even * (x_even * rstd).to(act).to(tl.float32)).to(act).to(tl.float32)
            x_odd = (nw_odd * (x_odd * rstd).to(act).to(tl.float32)).to(act).to(tl.float32)
        else:  # the norm's weight goes in now (the product of two bf16 is exact in float32), the 1/rms
            # factor after the product
            ss += tl.sum(tl.sum(x_even * x_even + x_odd * x_odd, axis=2), axis=1)
            x_even = nw_even * x_even
            x_odd = nw_odd * x_odd
    step, total = ss, ss  # (unread without A8)
    if A8:  # x as int8, once for both products
        x_even, x_odd, step, total = _int8_chunks(x_even, x_odd, ASM)
    if w is None:
        w = _load_chunks(w_cols, nmask, k0, K, BLOCK_K, WPT, PLANES, WHOLE_K)
    acc = _chunk_product(acc, x_even, x_odd, w, s, z, s_cols, z_cols, nmask, k0, K, magic, GROUP, WPT, PLANES, QUANT,
                         AHEAD, step, total, A8, ASM)
    if GATED:
        if w2 is None:
            w2 = _load_chunks(w_cols2, nmask, k0, K, BLOCK_K, WPT, PLANES, WHOLE_K)
        acc2 = _chunk_product(acc2, x_even, x_odd, w2, s2, z2, s_cols2, z_cols2, nmask, k0, K, magic, GROUP, WPT,
                              PLANES, QUANT, AHEAD, step, total, A8, ASM)
    return acc, acc2, ss


@triton.jit
def chunk_products(X: tl.tensor, W: tl.tensor, S: tl.tensor, Z: tl.tensor, NW: tl.tensor, n: tl.tensor,
                   n2: tl.tensor, nmask: tl.tensor, xrows: tl.tensor, K: tl.tensor, eps: tl.tensor,
                   stride_xm: tl.tensor, stride_wn: tl.tensor, stride_sn: tl.tensor, magic: tl.tensor,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, GATED: tl.constexpr,
                   GROUP: tl.constexpr, WPT: tl.constexpr, PLANES: tl.constexpr, QUANT: tl.constexpr,
                   WHOLE_K: tl.constexpr, PDL: tl.constexpr, A8: tl.constexpr = False,
                   ASM: tl.constexpr = False) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """gemv's _planes_products for one row (xrows [1]: the row of X) and weights read in chunks of WPT
    words of PLANES inputs: (acc, acc2 [1, BLOCK_N], the row's sum of squares [1] where the norm's 1/rms
    comes after the product)."""
    KT: tl.constexpr = BLOCK_K // (PLANES * WPT)
    x_row = X + tl.sum(xrows, axis=0) * stride_xm
    w_cols = W + n[None, None, :].to(tl.int64) * stride_wn
    w_cols2 = W + n2[None, None, :].to(tl.int64) * stride_wn
    s_cols, s_cols2 = S + (n * stride_sn)[None, :], S + (n2 * stride_sn)[None, :]
    stride_zn = factor_stride(stride_sn, QUANT)
    z_cols, z_cols2 = Z + (n * stride_zn)[None, :], Z + (n2 * stride_zn)[None, :]
    acc = tl.zeros([KT, BLOCK_N], tl.float32)
    acc2 = tl.zeros([KT, BLOCK_N], tl.float32)
    ss = tl.zeros([KT], tl.float32)
    # group factors loaded a slice ahead (loop-carried, as stored; made scales and zeros where used): loaded
    # in the slice that uses them, ptxas issued int4's bf16 scales and zeros late in it and their latency
    # stalled every slice (int4 chain on the H200: 2.067 -> 2.002 ms). INT4_K's (Q4_K) ran slower so
    # (2.081 -> 2.158 ms, its scales and zeros made before the slice and carried): they are loaded at the
    # start of the product that uses them, which ptxas keeps; but not with int8 inputs (A8), where ptxas issued
    # them after x's rounding, half way down the K loop: they are loaded a slice ahead there too.
    PREFETCH: tl.constexpr = GROUP > 1 and (QUANT != 7 or A8)
    s, z, s2, z2 = acc, acc, acc, acc  # (unread without groups)
    if PREFETCH:
        s, z = _chunk_factors(s_cols, z_cols, nmask, 0, K, KT, GROUP, WPT, PLANES, QUANT)
        if GATED:
            s2, z2 = _chunk_factors(s_cols2, z_cols2, nmask, 0, K, KT, GROUP, WPT, PLANES, QUANT)
    k_begin = 0
    if PDL > 0:  # the first slice's weights are on their way while the kernel before finishes
        w = _load_chunks(w_cols, nmask, 0, K, BLOCK_K, WPT, PLANES, True)
        w2 = w
        if GATED:
            w2 = _load_chunks(w_cols2, nmask, 0, K, BLOCK_K, WPT, PLANES, True)
        pdl_wait(PDL)
        ns, nz, ns2, nz2 = s, z, s2, z2
        if PREFETCH and not WHOLE_K:  # the next slice's
            ns, nz = _chunk_factors(s_cols, z_cols, nmask, BLOCK_K, K, KT, GROUP, WPT, PLANES, QUANT)
            if GATED:
                ns2, nz2 = _chunk_factors(s_cols2, z_cols2, nmask, BLOCK_K, K, KT, GROUP, WPT, PLANES, QUANT)
        acc, acc2, ss = _chunk_slice(acc, acc2, ss, x_row, NW, w_cols, w_cols2, s_cols, s_cols2, z_cols, z_cols2,
                                     nmask, 0, K, eps, magic, BLOCK_K, NORM, GATED, GROUP, WPT, PLANES, QUANT,
                                     WHOLE_K, s, z, s2, z2, PREFETCH, w, w2, A8, ASM)
        s, z, s2, z2 = ns, nz, ns2, nz2
        k_begin += BLOCK_K
    elif WHOLE_K:
        acc, acc2, ss = _chunk_slice(acc, acc2, ss, x_row, NW, w_cols, w_cols2, s_cols, s_cols2, z_cols, z_cols2,
                                     nmask, 0, K, eps, magic, BLOCK_K, NORM, GATED, GROUP, WPT, PLANES, QUANT,
                                     True, s, z, s2, z2, PREFETCH, None, None, A8, ASM)
    if not WHOLE_K:
        for k0 in range(k_begin, K, BLOCK_K):
            ns, nz, ns2, nz2 = s, z, s2, z2
            if PREFETCH:  # the next slice's (past K: none read)
                ns, nz = _chunk_factors(s_cols, z_cols, nmask, k0 + BLOCK_K, K, KT, GROUP, WPT, PLANES, QUANT)
                if GATED:
                    ns2, nz2 = _chunk_factors(s_cols2, z_cols2, nmask, k0 + BLOCK_K, K, KT, GROUP, WPT, PLANES,
                                              QUANT)
            acc, acc2, ss = _chunk_slice(acc, acc2, ss, x_row, NW, w_cols, w_cols2, s_cols, s_cols2, z_cols, z_cols2,
                                         nmask, k0, K, eps, magic, BLOCK_K, NORM, GATED, GROUP, WPT, PLANES, QUANT,
                                         False, s, z, s2, z2, PREFETCH, None, None, A8, ASM)
            s, z, s2, z2 = ns, nz, ns2, nz2
    return tl.sum(acc, axis=0)[None, :], tl.sum(acc2, axis=0)[None, :], tl.sum(ss, axis=0)[None]
