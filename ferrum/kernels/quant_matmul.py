"""Products of many rows with a quantized weight (prefill, large decode batches), on CUDA:
`quant_matmul(x [M, K], w: QuantWeight, bias)` -> [M, N] in x's dtype, equal to
x @ dequantize(w).T + bias up to each path's error. The path, by M and method (the thresholds
are measured on one H100 at the Llama-3.1-8B shapes, scripts/quant_gemv_bench.py):

    M = 1          any     the fused decode GEMV (ferrum.kernels.gemv) with the kind's table: reading
                           the packed weight once is the whole cost; W8A16 / W4A16 in float32 from
                           the stored values exactly. (At 4 rows the GEMV ran 0.4-0.8x bf16 cuBLAS
                           and the earlier W4A16 GEMM, 16-row tiles, 1.2-1.7x on the 8B gate/up; at
                           16 rows the GEMV 5-20x slower than cuBLAS.)
    M > 1          int4    M < TILES_FROM (48), or K not whole tiles of 128: the planes kernel, a
                           Triton W4A16 GEMM computing out^T tiles [BLOCK_N, BLOCK_M] =
                           W_tile @ x_tile^T: the weight on the left, so that it is dot's register
                           operand (Hopper's wgmma takes A from registers: the dequantized weight
                           never goes through shared memory; BLOCK_N fills the MMA's rows and the
                           few rows of x its narrow N side) and no tl.trans. A K tile's [BLOCK_N,
                           BLOCK_K / 8] words are read as 8 "planes" (input 8j + i of word j: a
                           mask and an OR into a float's mantissa, (q - 8) * scale + zero rounded
                           to x's dtype, all in the words' own registers; where x, scales and zeros
                           are bf16, by inline PTX two weights an instruction: a mask-and-OR into
                           bf16 128's mantissa, two bf16x2 fmas (- 136; * scale + zero), about 2
                           instructions a weight against 5 in float32), each dotted with x's
                           matching columns (a sum over K takes any order of K applied to both
                           sides): 8 tl.dots a tile, no interleave or reshape. x's columns are read
                           strided, or from a copy of x permuted once a call so that a plane's
                           columns are contiguous (permute_x). Split-K where N alone gives few
                           programs: float32 partials [SPLIT, M, N], summed (+ bias) by each
                           tile's last program to finish (_store_tile; the weight tiles below: by
                           a second kernel). Tiles by M, N and K: w4a16_config. On an H200 with the bf16
                           pairs, a layer's four projections ran 1.22x bf16 cuBLAS at 4 rows and
                           1.18x at 16.
                           TILES_FROM <= M < DEQUANTIZE_FROM (129): the weight-tiles kernel, out
                           tiles [BLOCK_M, BLOCK_N] = x_tile @ W_tile^T with one MMA a K tile: the
                           planes (bf16 pairs where a K tile has one scale a row, else float32)
                           joined back into input order in registers, the tile then the MMA's
                           shared-memory operand, x read as it lies, the next K tiles' loads in
                           flight under it. Each plane's own MMA, waited for in turn, bounded the
                           planes kernel here (0.82x bf16 at 64 rows); the tiles ran a Llama-3.1-8B
                           layer's four projections at 0.91x bf16 at 64 rows (1.17x the planes) and
                           0.69x at 128 (1.28x dequantize + cuBLAS), H200.
                           M >= DEQUANTIZE_FROM: the weight dequantized to x's dtype by one Triton
                           kernel into a transient [N, K] buffer, then cuBLAS: the dequantization
                           (~0.1 ms for the 8B gate/up) is paid once for all M rows, each tile of
                           the kernels above once per BLOCK_M rows (at 160-256 rows the best tiles,
                           128 or 256 rows, ran a layer 1.02-1.11x slower). The dequantization runs
                           at the rate of a stream of mostly writes (~3 TB/s on an H200, every
                           tiling alike). The buffer is the largest weight in bf16, 235 MB for the
                           8B gate/up, held by the caching allocator.
                           M >= GemmRules.int4_w8a8_rows too (KernelConfig.int4_w8a8_rows: served so
                           by default on compute capability 9.0, in fp8; GemmRules() alone: never),
                           K and N multiples of 16, x in 16 bits (served in float32, precision is
                           asked for: W4A16): W8A8 on the tensor cores, whose
                           int8 and fp8 rates are twice bf16's. requantize_int4 writes the weight in
                           the format (int8, or fp8 e4m3 by GemmRules.int4_w8a8_format) with a scale
                           an output channel (each row's bound from its groups' scales and zeros, so
                           nothing clamps) into a transient [N, K] buffer, half the bf16 one's bytes;
                           then int8: x per row and one Triton int8 GEMM with the scales and bias in
                           its epilogue (w8a8_int8_gemm); fp8: fp8's W8A8 below. Errors: x's rounding
                           as W8A8's, plus the weight's: int8 half a step of 1/127 of its row's
                           largest magnitude (~7e-3 relative for Gaussian rows), fp8 2^-4 relative.
                           On an H100, the 8B gate/up and down products at 192 rows: 263-278 us
                           against 348 dequantized (bf16 160); at 2048, 783-831 against 1,094 (bf16 918)
                   int8    M > 16, K and N multiples of 8: W8A8, x quantized per row to int8 as it
                           comes (scale = max|x_row| / 127, one Triton kernel), torch._int_mm (int8
                           tensor cores, int32 sums), then * x_scale * w_scale (+ bias) in one kernel;
                           otherwise the Triton W8A16 GEMM: [BLOCK_N, BLOCK_K] tiles of q converted
                           to x's dtype, tl.dot, the per-channel scale on the sums
                   fp8     M > 16, K and N multiples of 16: W8A8 in float8 e4m3, x per row to fp8
                           (scale = max|x_row| / 448, or a checkpoint's static input scale: every row
                           by it, clamped), then torch._scaled_mm with row-wise scales
                           (scale_a [M, 1], scale_b [1, N] float32, compute capability 9.0);
                           otherwise (and on 8.9 GPUs) the Triton GEMM (W8A16)
                   int8 / fp8 with group scales (block-scaled checkpoints): M < GROUPED_DEQUANTIZE_FROM the
                           Triton W8A16 GEMM, each tile's weights times their group's scale before the
                           dot; from there the weight dequantized once by a Triton kernel, then cuBLAS
                           (the W8A16 GEMM ran an 8B offline workload, prefill-heavy, at 0.11x bf16)
                   int8 with a zero per group too (GGUF's Q5_1 / Q5_K, asymmetric 8-bit GPTQ): as with
                           group scales, the zero added to each weight with its scale (the GEMV: each
                           word's x sum times its zero)

Expected error against x @ dequantize(w).T in float32, relative (Frobenius), for activations
without outliers (tests/kernels/test_quant_kernels.py checks these bounds):
    GEMV (M = 1)     ~2e-3: the output's rounding to bf16 only                       bound 1e-2
      int4 with int8 inputs (KernelConfig.gemv_int4.int8_inputs, the default)
                     ~6e-3: x's rounding to 1/127 of each 32 inputs' largest magnitude bound 2e-2
    W4A16, W8A16     ~3e-3: the dequantized weight rounded to bf16 before the dot    bound 1e-2
    W8A8 int8        ~1e-2: x's rounding to 1/127 of its row's largest magnitude     bound 2e-2
      int4 requantized ~1.2e-2: that, and the weight's rounding to 1/127 of its row's  bound 2e-2
    W8A8 fp8         ~3e-2: x's rounding to e4m3's 3 mantissa bits                   bound 5e-2
(per-row activation scales grow the W8A8 error with a row's outliers: max|x| / rms(x).)
Whether the device runs the method at all (fp8: compute capability 8.9) is checked at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferrum.kernels.config import DEFAULT_GEMM, GemmRules, GemvTable, KernelConfig
from ferrum.kernels.counts import COUNTS, done_counts
from ferrum.kernels.gemv import INT4, INT4_K, KernelWeight, gemv, kernel_weight
from ferrum.kernels.planes import factor_stride, group_factors
from ferrum.kernels.quant_weight import QuantWeight

GEMV_ROWS = 1  # up to this many rows: the fused GEMV
TILES_FROM = 48  # int4 from this many rows (K whole tiles of 128): the weight-tiles W4A16 kernel
DEQUANTIZE_FROM = 129  # int4 from this many rows: dequantize + cuBLAS
GROUPED_DEQUANTIZE_FROM = 32  # int8 / fp8 with group scales: from this many rows, dequantize + cuBLAS
WIDE_N = 16384  # outputs from which a projection is "wide" (the 8B's gate/up: 28672)


@dataclass(frozen=True)
class GemmConfig:
    """A Triton GEMM's tiling. W4A16 only: block_k a power of two >= 128 (16 words a plane),
    split_k programs along K each summing a share of the K tiles into float32 partials that the
    tile's last program (planes) or a second kernel (weight tiles) adds up, permute_x: x copied once
    a call so that each plane's columns are contiguous (where K is whole tiles; else x is read
    strided), bf16x2: where x and int4's scales and zeros are bf16 on CUDA, the weights dequantized
    two an instruction in bf16 (else, and with False, in float32). weight_tiles: W4A16 by the other
    kernel (_w4a16_tiles_kernel: each K tile's weights dequantized in input order into the MMA's
    shared-memory operand, out tiles [BLOCK_M, BLOCK_N], x read as it lies; K a multiple of
    block_k), not by planes (permute_x is then unused)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 1
    permute_x: bool = False
    bf16x2: bool = True
    weight_tiles: bool = False


def w4a16_config(m: int, n: int, k: int) -> GemmConfig:
    """The W4A16 GEMM's tiles for M rows (2 <= M < DEQUANTIZE_FROM), N outputs and K inputs, the rules the
    sweeps picked (benchmarks/quantization.md).
    From TILES_FROM rows, where K is whole tiles of 128: the weight-tiles kernel (an H200 sweep of 2 x 3
    tilings x 3 stagings x 3 splits at 64, 128 and 256 rows on the Llama-3.1-8B projections, then the
    rule at 16-256 rows, .../quantization.md 2026-11-29): 64 x 64 tiles (4 warps) up to 64 rows, 4 stages
    where there are at most 256 programs (2 an SM), else 2 (4 programs an SM fit its shared memory: 448
    for the 8B's gate/up at 64 rows ran in one wave at 69 us, in two at 3 stages at 87); past 64 rows,
    128 rows a tile, 128 outputs (8 warps, 3 stages) for the wide projections (N >= WIDE_N), else 64 (4
    warps, 2 stages); K split until there are 256 programs (at most 4, each K slice at least 512
    inputs), the wide projections whole.
    Below TILES_FROM (or K ragged): the planes kernel. Up to 16 rows: 64 outputs a program, x permuted, K
    split until there are 256 programs (2 an SM; on an H200 with the bf16 pairs' dequantization, 512 had
    been the float32 dequantization's best on the H100). More rows: 128 outputs a program (8 warps) for
    the large projections (N >= 16384 or K >= 8192), else 64, x permuted, K split until there are 192
    programs. Splits at most 8, each K slice at least 512 inputs.
    """
    if m >= TILES_FROM and k % 128 == 0:
        wide = n >= WIDE_N
        if m <= 64:
            block_m, block_n, warps, stages = 64, 64, 4, 0
        else:
            block_m, block_n, warps, stages = (128, 128, 8, 3) if wide else (128, 64, 4, 2)
        tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
        split_k = 1
        while not (wide and m > 64) and split_k < 4 and tiles * split_k < 256 and k // (2 * split_k) >= 512:
            split_k *= 2
        stages = stages or (4 if tiles * split_k <= 256 else 2)
        return GemmConfig(block_m, block_n, 128, warps, stages, split_k, weight_tiles=True)
    if m > 64 and n >= WIDE_N:
        return GemmConfig(128, 128, 128, 8, 3, 1, True)
    block_m = min(max(16, triton.next_power_of_2(m)), 64)
    wide = m > 16 and (n >= 16384 or k >= 8192)
    block_n, warps = (128, 8) if wide else (64, 4)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    want = 256 if m <= 16 else 192
    split_k = 1
    while split_k < 8 and tiles * split_k < want and k // (2 * split_k) >= 512:
        split_k *= 2
    return GemmConfig(block_m, block_n, 128, warps, 4, split_k, True)


def _w8a16_config(m: int) -> GemmConfig:
    """The W8A16 GEMM's tiles by M: small M (decode batches) spread N over more programs; large M
    (prefill) take the usual 128 x 128 tiles."""
    if m <= 32:
        return GemmConfig(16, 64, 128, 4, 4)
    if m <= 64:
        return GemmConfig(32, 64, 128, 4, 4)
    if m <= 256:
        return GemmConfig(64, 128, 64, 4, 4)
    return GemmConfig(128, 128, 64, 8, 3)


def quant_matmul(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None, *,
                 table: GemvTable | None = None, rules: GemmRules = DEFAULT_GEMM) -> torch.Tensor:
    """x [..., K] (contiguous along K) @ dequantize(w).T + bias -> [..., N] in x's dtype, by the
    path the module docstring gives for M (the rows of x) and w.kind. table: the GEMV's for M <=
    GEMV_ROWS (default: KernelConfig's for w.kind). rules: the device's (GemmRules: whether
    torch._scaled_mm takes row-wise scales; from how many rows int4 takes the int8 tensor cores)."""
    k, n = w.in_features, w.out_features
    if x.shape[-1] != k:
        raise ValueError(f"quant_matmul: x has {x.shape[-1]} features, the {w.kind} weight takes {k}")
    flat = x.reshape(-1, k)
    if flat.stride(1) != 1:
        flat = flat.contiguous()
    m = flat.shape[0]
    if m == 0:
        y = x.new_empty(0, n)
    elif m <= GEMV_ROWS:
        y = gemv(flat, w, table or KernelConfig().gemv_table(w.kind), bias=bias)
    elif w.kind == "int4" and m >= DEQUANTIZE_FROM and 0 < rules.int4_w8a8_rows <= m and k % 16 == 0 \
            and n % 16 == 0 and flat.dtype != torch.float32:
        fp8 = rules.int4_w8a8_format == "fp8" and rules.fp8_rowwise  # else int8 (no row-wise _scaled_mm)
        y = _w8a8_fp8(flat, requantize_int4(w, torch.float8_e4m3fn), bias) if fp8 \
            else w8a8_int8_gemm(flat, requantize_int4(w), bias)
    elif w.kind == "int4" and m >= DEQUANTIZE_FROM:
        y = torch.nn.functional.linear(flat, dequantize_int4(w, flat.dtype), bias)
    elif w.kind in ("int8", "fp8") and w.group_size and m >= GROUPED_DEQUANTIZE_FROM:
        y = torch.nn.functional.linear(flat, dequantize_grouped(w, flat.dtype), bias)
    elif w.kind == "int8" and m > 16 and k % 8 == 0 and n % 8 == 0 and not w.group_size:
        y = _w8a8_int8(flat, w, bias)
    elif w.kind == "fp8" and m > 16 and k % 16 == 0 and n % 16 == 0 and rules.fp8_rowwise and not w.group_size:
        y = _w8a8_fp8(flat, w, bias)
    else:
        y = triton_gemm(flat, w, bias)
    return y.reshape(*x.shape[:-1], n)


def _w8a8_int8(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    xq, x_scale = quantize_rows(x, torch.int8)
    acc = torch._int_mm(xq, w.qweight.t())  # [M, N] int32; qweight [N, K] row-major is K x N column-major
    out = torch.empty(acc.shape, dtype=x.dtype, device=x.device)
    bm, bn = 32, 128
    _scale_kernel[(triton.cdiv(acc.shape[0], bm), triton.cdiv(acc.shape[1], bn))](
        acc, x_scale, w.scale, bias if bias is not None else out, out, acc.shape[0], acc.shape[1],
        acc.stride(0), out.stride(0), BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, num_warps=4)
    return out


def _w8a8_fp8(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None) -> torch.Tensor:
    xq, x_scale = quantize_rows(x, torch.float8_e4m3fn, w.input_scale)
    y = torch._scaled_mm(xq, w.qweight.t(), scale_a=x_scale[:, None], scale_b=w.scale[None, :],
                         out_dtype=x.dtype)
    if bias is not None:
        y += bias
    return y


def quantize_rows(x: torch.Tensor, dtype: torch.dtype,
                  static: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] in `dtype`: int8 or float8_e4m3fn, scale float32 [M]), x ~ q * scale[:, None],
    each row scaled so that its largest magnitude is the format's largest (127, 448); or, given a static
    scale (float32 [1], a checkpoint's), every row by it, values past the format's largest clamped to it."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=dtype, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    block = min(triton.next_power_of_2(k), 4096)
    _quantize_rows_kernel[(m,)](x, q, scale, static if static is not None else scale, k, x.stride(0), q.stride(0),
                                FP8=dtype == torch.float8_e4m3fn, STATIC=static is not None, BLOCK_K=block,
                                num_warps=8 if block >= 2048 else 4)
    return q, scale


@triton.jit
def _quantize_rows_kernel(X: tl.tensor, Q: tl.tensor, SCALE: tl.tensor, STATIC_SCALE: tl.tensor, K: tl.tensor,
                          stride_xm: tl.tensor, stride_qm: tl.tensor, FP8: tl.constexpr, STATIC: tl.constexpr,
                          BLOCK_K: tl.constexpr) -> None:
    """One row a program: its largest magnitude (or STATIC: the one given scale), then the row over the
    scale, clamped to the format's range and rounded (int8: to nearest, ties away from zero; fp8: the
    conversion's round to nearest even)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_xm
    kk = tl.arange(0, BLOCK_K)
    qmax = 448.0 if FP8 else 127.0
    if STATIC:
        scale = tl.load(STATIC_SCALE)
    else:
        amax = tl.zeros([BLOCK_K], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            amax = tl.maximum(amax, tl.abs(tl.load(x_row + k0 + kk, mask=k0 + kk < K, other=0.0).to(tl.float32)))
        scale = tl.maximum(tl.max(amax, axis=0), 1e-12) / qmax
    tl.store(SCALE + row, scale)
    for k0 in range(0, K, BLOCK_K):
        v = tl.load(x_row + k0 + kk, mask=k0 + kk < K, other=0.0).to(tl.float32) / scale
        v = tl.minimum(tl.maximum(v, -qmax), qmax)
        if FP8:
            q = v.to(Q.dtype.element_ty)
        else:
            q = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v)).to(tl.int8)
        tl.store(Q + row * stride_qm + k0 + kk, q, mask=k0 + kk < K)


@triton.jit
def _scale_kernel(ACC: tl.tensor, XS: tl.tensor, WS: tl.tensor, B: tl.tensor, OUT: tl.tensor, M: tl.tensor,
                  N: tl.tensor, stride_am: tl.tensor, stride_om: tl.tensor, BIAS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr) -> None:
    """out = acc * x_scale[:, None] * w_scale[None, :] (+ bias), in out's dtype."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rm < M)[:, None] & (rn < N)[None, :]
    acc = tl.load(ACC + rm[:, None].to(tl.int64) * stride_am + rn[None, :], mask=mask, other=0).to(tl.float32)
    y = acc * tl.load(XS + rm, mask=rm < M, other=0.0)[:, None] * tl.load(WS + rn, mask=rn < N, other=0.0)[None, :]
    if BIAS:
        y += tl.load(B + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + rm[:, None].to(tl.int64) * stride_om + rn[None, :], y.to(OUT.dtype.element_ty), mask=mask)


def dequantize_grouped(w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """An int8 / fp8 weight with group scales as [N, K] in `dtype` (q * its group's scale, rounded once)."""
    kw = kernel_weight(w)
    n, k = kw.out_rows, kw.in_features
    out = torch.empty(n, k, dtype=dtype, device=w.qweight.device)
    block_n, block_k = 32, min(kw.group, 128)
    _dequantize_grouped_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        w.qweight, kw.scale, kw.zero, out, n, k, w.qweight.stride(0), kw.stride_sn, out.stride(0), GROUP=kw.group,
        ZERO=w.zero is not None, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=4)
    return out


@triton.jit
def _dequantize_grouped_kernel(W: tl.tensor, S: tl.tensor, Z: tl.tensor, OUT: tl.tensor, N: tl.tensor,
                               K: tl.tensor, stride_wn: tl.tensor, stride_sn: tl.tensor, stride_on: tl.tensor,
                               GROUP: tl.constexpr, ZERO: tl.constexpr, BLOCK_N: tl.constexpr,
                               BLOCK_K: tl.constexpr) -> None:
    """One [BLOCK_N, BLOCK_K] block (within one group: BLOCK_K divides GROUP) of q * scale (+ zero)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    kk = k0 + tl.arange(0, BLOCK_K)
    mask = (rn < N)[:, None] & (kk < K)[None, :]
    q = tl.load(W + rn[:, None].to(tl.int64) * stride_wn + kk[None, :], mask=mask, other=0.0).to(tl.float32)
    s = tl.load(S + rn * stride_sn + k0 // GROUP, mask=rn < N, other=0.0)
    w = q * s[:, None]
    if ZERO:
        w += tl.load(Z + rn * stride_sn + k0 // GROUP, mask=rn < N, other=0.0)[:, None]
    tl.store(OUT + rn[:, None].to(tl.int64) * stride_on + kk[None, :], w.to(OUT.dtype.element_ty), mask=mask)


def dequantize_int4(w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """The int4 weight as [N, K] in `dtype` ((q - 8) * scale + zero, rounded once), by one kernel."""
    kw = kernel_weight(w)
    n, k = kw.out_rows, kw.in_features
    out = torch.empty(n, k, dtype=dtype, device=w.qweight.device)
    block_n, block_k = 32, min(kw.group, 256)
    _dequantize_int4_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        kw.data, kw.scale, kw.zero, out, n, k, kw.stride_wn, kw.stride_sn, out.stride(0), GROUP=kw.group,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, QUANT=kw.quant, num_warps=4)
    return out


@triton.jit
def _dequantize_int4_kernel(W: tl.tensor, S: tl.tensor, Z: tl.tensor, OUT: tl.tensor, N: tl.tensor, K: tl.tensor,
                            stride_wn: tl.tensor, stride_sn: tl.tensor, stride_on: tl.tensor, GROUP: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                            QUANT: tl.constexpr) -> None:
    """One [BLOCK_N, BLOCK_K] block of the dequantized weight (BLOCK_K divides GROUP: within one
    group; unless EVEN_K the last block, in a ragged last group, is masked at K). (Its planes in bf16
    pairs, as the W4A16 GEMM's, ran at the same speed on an H200: 49-99 us for the 8B's down and gate/up,
    bound by its bf16 writes at 70% of their bandwidth; not kept.)"""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    nmask = rn < N
    kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    kk = k0 + tl.arange(0, BLOCK_K)
    wmask = nmask[:, None] if EVEN_K else nmask[:, None] & (kw < K // 8)[None, :]
    omask = nmask[:, None] if EVEN_K else nmask[:, None] & (kk < K)[None, :]
    words = tl.load(W + rn[:, None].to(tl.int64) * stride_wn + kw[None, :], mask=wmask, other=0)
    s, z = group_factors(S + rn * stride_sn, Z + rn * factor_stride(stride_sn, QUANT), k0 // GROUP, nmask, QUANT)
    w = _unpack_int4(words) * s[:, None] + z[:, None]
    tl.store(OUT + rn[:, None].to(tl.int64) * stride_on + kk[None, :], w.to(OUT.dtype.element_ty), mask=omask)


def requantize_int4(w: QuantWeight, dtype: torch.dtype = torch.int8) -> QuantWeight:
    """The int4 weight in `dtype` (int8 or float8_e4m3fn) with one scale an output channel (a QuantWeight
    of that kind: qweight [N, K], scale float32 [N]): each row's (q - 8) * scale + zero over its channel's
    step, rounded to nearest (ties to even; fp8 by the conversion). The step is
    the row's bound over its groups, max(|zero - 8 scale|, |zero + 7 scale|) over the format's largest
    (127, 448), from the factors alone (each group's extremes, q = 0 and 15, are its rounded minimum and
    maximum), so nothing clamps. int8's rounding adds at most half a step of 1/127 of the row's largest
    magnitude to each weight; fp8's a relative 2^-4 of each weight. Two kernels: the rows' steps
    (the factors only), then one [32, min(group, 256)] block of codes a program, no loop (as the
    dequantize kernel: a stream of reads and half its writes). K is a multiple of 8 (whole words)."""
    if dtype not in (torch.int8, torch.float8_e4m3fn):
        raise ValueError(f"requantize_int4: int8 or float8_e4m3fn, got {dtype}")
    kw = kernel_weight(w)
    n, k = kw.out_rows, kw.in_features
    device = w.qweight.device
    fp8 = dtype == torch.float8_e4m3fn
    step = torch.empty(n, dtype=torch.float32, device=device)
    groups = triton.cdiv(k, kw.group)
    _int4_row_steps_kernel[(triton.cdiv(n, 64),)](
        kw.scale, kw.zero, step, n, groups, kw.stride_sn, QMAX=448.0 if fp8 else 127.0, BLOCK_N=64,
        BLOCK_G=min(triton.next_power_of_2(groups), 64), QUANT=kw.quant, num_warps=4)
    out = torch.empty(n, k, dtype=dtype, device=device)
    pairs = out.view(torch.int32)  # [N, K / 4]: each word's 8 codes stored as two 32-bit words
    block_n, block_k = 32, min(kw.group, 256)
    _requantize_int4_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        kw.data, kw.scale, kw.zero, step, pairs, n, k, kw.stride_wn, kw.stride_sn, pairs.stride(0), GROUP=kw.group,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, QUANT=kw.quant, FP8=fp8, num_warps=4)
    return QuantWeight("fp8" if fp8 else "int8", out, step)


@triton.jit
def _int4_row_steps_kernel(S: tl.tensor, Z: tl.tensor, STEP: tl.tensor, N: tl.tensor, GROUPS: tl.tensor,
                           stride_sn: tl.tensor, QMAX: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr,
                           QUANT: tl.constexpr) -> None:
    """BLOCK_N rows' steps: each row's bound over all its groups' factors, over QMAX."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    s_rows = S + rn * stride_sn
    z_rows = Z + rn * factor_stride(stride_sn, QUANT)
    bound = tl.zeros([BLOCK_N], tl.float32)
    for g0 in range(0, GROUPS, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        s, z = group_factors(s_rows[:, None], z_rows[:, None], g[None, :], nmask[:, None] & (g < GROUPS)[None, :],
                             QUANT)
        bound = tl.maximum(bound, tl.max(tl.maximum(tl.abs(z - 8.0 * s), tl.abs(z + 7.0 * s)), axis=1))
    tl.store(STEP + rn, tl.maximum(bound, 1e-30) / QMAX, mask=nmask)


@triton.jit
def _requantize_int4_kernel(W: tl.tensor, S: tl.tensor, Z: tl.tensor, STEP: tl.tensor, OUT: tl.tensor,
                            N: tl.tensor, K: tl.tensor, stride_wn: tl.tensor, stride_sn: tl.tensor,
                            stride_on: tl.tensor, GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            EVEN_K: tl.constexpr, QUANT: tl.constexpr, FP8: tl.constexpr) -> None:
    """One [BLOCK_N, BLOCK_K] block (within one group: BLOCK_K divides GROUP; unless EVEN_K the last,
    in a ragged last group, masked at K) of the weight over its rows' steps, rounded to OUT's format. Each
    word's 8 inputs are its 8 nibbles, rounded one plane at a time and packed back into two 32-bit words in
    input order (byte i of the pair is input 8j + i), stored as one 8-byte pair a word: no interleave of
    the planes and no byte stores."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    nmask = rn < N
    kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    wmask = nmask[:, None] if EVEN_K else nmask[:, None] & (kw < K // 8)[None, :]
    words = tl.load(W + rn[:, None].to(tl.int64) * stride_wn + kw[None, :], mask=wmask, other=0)
    s, z = group_factors(S + rn * stride_sn, Z + rn * factor_stride(stride_sn, QUANT), k0 // GROUP, nmask, QUANT)
    inv = 1.0 / tl.load(STEP + rn, mask=nmask, other=1.0)
    a, b = (s * inv)[:, None], (z * inv)[:, None]
    lo = tl.zeros(words.shape, tl.uint32)
    hi = tl.zeros(words.shape, tl.uint32)
    for p in tl.static_range(8):
        v = (((words >> (4 * p)) & 0xF).to(tl.float32) - 8.0) * a + b
        if FP8:
            byte = tl.minimum(tl.maximum(v, -448.0), 448.0).to(tl.float8e4nv).to(tl.uint8, bitcast=True).to(tl.uint32)
        else:  # 1.5 * 2^23 + v rounds v to an integer in the float's low bits: its low byte is the int8
            byte = (v + 12582912.0).to(tl.uint32, bitcast=True) & 0xFF
        if p < 4:
            lo |= byte << (8 * p)
        else:
            hi |= byte << (8 * (p - 4))
    pairs = tl.reshape(tl.join(lo, hi), (BLOCK_N, BLOCK_K // 4))  # column 2j: inputs 8j..8j+3, 2j+1: the rest
    cols = 2 * (k0 // 8) + tl.arange(0, BLOCK_K // 4)
    omask = nmask[:, None] if EVEN_K else nmask[:, None] & (cols < K // 4)[None, :]
    tl.store(OUT + rn[:, None].to(tl.int64) * stride_on + cols[None, :], pairs, mask=omask)


def w8a8_int8_gemm(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
                   config: GemmConfig | None = None) -> torch.Tensor:
    """x [M, K] @ (w.qweight * w.scale[:, None]).T (+ bias) in x's dtype, w int8 with a scale a row: x
    rounded to int8 per row (quantize_rows), one Triton int8 GEMM (int32 sums) with both scales and the
    bias in its epilogue (one kernel where _w8a8_int8 takes torch._int_mm and a scale kernel)."""
    m, k = x.shape
    n = w.out_features
    cfg = config or w8a8_int8_config(m, n)
    xq, x_scale = quantize_rows(x, torch.int8)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _w8a8_int8_kernel[(triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)](
        xq, w.qweight, x_scale, w.scale, bias if bias is not None else out, out, m, n, k, xq.stride(0),
        w.qweight.stride(0), out.stride(0), BIAS=bias is not None, EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=8, num_warps=cfg.num_warps,
        num_stages=cfg.num_stages)
    return out


def w8a8_int8_config(m: int, n: int) -> GemmConfig:
    """The int8 GEMM's tiles: 64 x 128 up to 256 rows (more programs for the few rows), else 128 x 128."""
    return GemmConfig(64, 128, 128, 4, 4) if m <= 256 else GemmConfig(128, 128, 128, 8, 3)


@triton.jit
def _w8a8_int8_kernel(X: tl.tensor, W: tl.tensor, XS: tl.tensor, WS: tl.tensor, B: tl.tensor, OUT: tl.tensor,
                      M: tl.tensor, N: tl.tensor, K: tl.tensor, stride_xm: tl.tensor, stride_wn: tl.tensor,
                      stride_om: tl.tensor, BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr) -> None:
    """One out tile [BLOCK_M, BLOCK_N]: int8 x tiles against the weight's [BLOCK_K, BLOCK_N] (read
    transposed from its rows), int32 sums, * x's row scale * the weight's channel scale (+ bias)."""
    pid_m, pid_n = _banded_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask, nmask = rm < M, rn < N
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
    for k0 in range(0, K, BLOCK_K):
        kmask = (k0 + rk) < K
        a = tl.load(X + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :],
                    mask=mmask[:, None] if EVEN_K else mmask[:, None] & kmask[None, :], other=0)
        b = tl.load(W + rn[None, :].to(tl.int64) * stride_wn + (k0 + rk)[:, None],
                    mask=nmask[None, :] if EVEN_K else nmask[None, :] & kmask[:, None], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    y = acc.to(tl.float32) * tl.load(XS + rm, mask=mmask, other=0.0)[:, None] \
        * tl.load(WS + rn, mask=nmask, other=0.0)[None, :]
    if BIAS:
        y += tl.load(B + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + rm[:, None].to(tl.int64) * stride_om + rn[None, :], y.to(OUT.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def triton_gemm(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
                config: GemmConfig | None = None) -> torch.Tensor:
    """x [M, K] @ dequantize(w).T (+ bias) -> [M, N] in x's dtype on the tensor cores: int4 by the
    W4A16 kernel (tiles by w4a16_config unless `config`), int8 and fp8 by the W8A16 kernel (their
    per-channel scale multiplies the float32 sums once; split_k 1)."""
    kw = kernel_weight(w)  # checks the layout
    m, k = x.shape
    n = kw.out_rows
    assert k == kw.in_features and x.stride(1) == 1, (x.shape, k)
    if kw.quant in (INT4, INT4_K):
        return _w4a16(x, kw, bias, config or w4a16_config(m, n, k))
    cfg = config or _w8a16_config(m)
    if cfg.split_k != 1:
        raise ValueError(f"triton_gemm: the {w.kind} (W8A16) GEMM takes split_k 1, got {cfg}")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    zeros = w.kind == "int8" and w.zero is not None
    # the zeros' float32 tile beside the scales' in every pipelined stage: 4 stages of 64 x 128 ran out of
    # shared memory on an H100
    stages = min(cfg.num_stages, 2) if zeros else cfg.num_stages
    _w8a16_kernel[grid](
        x, w.qweight, kw.scale, kw.zero, bias if bias is not None else x, out, m, n, k,
        x.stride(0), w.qweight.stride(0), kw.stride_sn, out.stride(0), BIAS=bias is not None,
        ZERO=zeros,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=8, GROUP=kw.group,
        num_warps=cfg.num_warps, num_stages=stages,
    )
    return out


def _w4a16(x: torch.Tensor, kw: KernelWeight, bias: torch.Tensor | None, cfg: GemmConfig) -> torch.Tensor:
    m, k = x.shape
    n, block_k = kw.out_rows, cfg.block_k
    if block_k < 128 or block_k & (block_k - 1):
        raise ValueError(f"W4A16 GEMM: block_k must be a power of two >= 128 (16 words a plane: tl.dot's "
                         f"smallest K), got {cfg}")
    if cfg.weight_tiles and k % block_k:
        raise ValueError(f"W4A16 GEMM: the weight tiles take K a multiple of block_k, got K = {k} and {cfg}")
    words = block_k // 8
    even_k = k % block_k == 0
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = out if cfg.split_k == 1 else torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), cfg.split_k)
    # the planes' splits summed by each tile's last program (H200, an 8B layer: 1.01x / 1.04x the second kernel
    # at 4 / 16 rows); the weight tiles' by the second kernel (their last programs ran 0.98-0.96x at 48-128 rows)
    last_sums = cfg.split_k > 1 and not cfg.weight_tiles and grid[0] <= COUNTS
    counts = done_counts(x.device) if last_sums else part
    bf16x2 = cfg.bf16x2 and x.is_cuda and kw.quant == INT4 and x.dtype == kw.scale.dtype == kw.zero.dtype \
        == torch.bfloat16 and not (cfg.weight_tiles and kw.group < block_k)
    if cfg.weight_tiles:
        _w4a16_tiles_kernel[grid](
            x, kw.data, kw.scale, kw.zero, bias if bias is not None else x, out, part, m, n, k,
            x.stride(0), kw.stride_wn, kw.stride_sn, out.stride(0),
            GROUP=kw.group, BIAS=bias is not None and cfg.split_k == 1, SPLIT_K=cfg.split_k,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=8, QUANT=kw.quant, BF16X2=bf16x2,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    else:
        x_strides = (1, 8)  # (plane, word): x[m, k0 + 8j + i] for plane i, word j of the tile at k0
        if cfg.permute_x and even_k:  # each plane's columns contiguous: x[m, k0 + i * words + j]
            x = x.reshape(m, k // block_k, words, 8).transpose(2, 3).reshape(m, k)
            x_strides = (words, 1)
        _w4a16_kernel[grid](
            x, kw.data, kw.scale, kw.zero, bias if bias is not None else x, out, part, counts, m, n, k,
            x.stride(0), *x_strides, kw.stride_wn, kw.stride_sn, out.stride(0),
            GROUP=kw.group, BIAS=bias is not None and (cfg.split_k == 1 or last_sums), EVEN_K=even_k,
            SPLIT_K=cfg.split_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=8,
            QUANT=kw.quant, BF16X2=bf16x2, LAST_SUMS=last_sums, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if cfg.split_k > 1 and not last_sums:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            part, bias if bias is not None else out, out, m * n, n, SPLIT_K=cfg.split_k, BIAS=bias is not None,
            BLOCK=block, num_warps=4)
    return out


@triton.jit
def _int4_plane(words: tl.tensor, PLANE: tl.constexpr) -> tl.tensor:
    """Plane p = PLANE of int32 words [R, W] (input 8j + p: bits 4p..4p+3 of word j) as float32 q - 8,
    [R, W]: the nibble OR-ed into the mantissa of 2^e (e = 23 - its bit offset in its half word) is
    the float 2^e + q exactly; no data moves between threads."""
    if PLANE < 4:
        h = words
    else:
        h = words >> 16  # arithmetic: the mask drops the sign's copies
    if PLANE % 4 == 0:
        f = ((h & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # 2^23 + 8
    elif PLANE % 4 == 1:
        f = ((h & 0xF0) | 0x49000000).to(tl.float32, bitcast=True) - 524296.0  # 2^19 + 8
    elif PLANE % 4 == 2:
        f = ((h & 0xF00) | 0x47000000).to(tl.float32, bitcast=True) - 32776.0  # 2^15 + 8
    else:
        f = ((h & 0xF000) | 0x45000000).to(tl.float32, bitcast=True) - 2056.0  # 2^11 + 8
    return f


@triton.jit
def _int4_planes_bf16x2(words: tl.tensor, s: tl.tensor, z: tl.tensor) -> tuple[tl.tensor, ...]:
    """The 8 planes of int32 words [R, W] (plane p: input 8j + p, bits 4p..4p+3 of word j) as bf16
    (q - 8) * s + z, s and z bf16 broadcast to [R, W]: two weights an instruction (CUDA only). Planes p
    and p + 4 sit in the two half words of (word >> 4p) & 0x000F000F; OR-ed into bf16 128.0's mantissa
    each is 128 + q exactly, 136 off is q - 8 exactly (an fma by 1 and -136: sm_80's bf16x2 has no
    subtraction, sm_90's does, and bf16 activations imply cc >= 8.0), and one fma.rn.bf16x2 rounds
    (q - 8) * s + z once: the value the float32 path rounds to bf16 (up to its one extra rounding of
    the sum)."""
    s = tl.broadcast_to(s.to(tl.bfloat16), words.shape)  # group_factors' float32 of bf16 values: exact
    z = tl.broadcast_to(z.to(tl.bfloat16), words.shape)
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 w1, w2, w3, t0, t1, t2, t3, ss, zz, one, off;
        mov.b32 ss, {$9, $9};
        mov.b32 zz, {$10, $10};
        mov.b32 one, 0x3F803F80;
        mov.b32 off, 0xC308C308;
        shr.u32 w1, $8, 4;
        shr.u32 w2, $8, 8;
        shr.u32 w3, $8, 12;
        lop3.b32 t0, $8, 0x000F000F, 0x43004300, 0xea;
        lop3.b32 t1, w1, 0x000F000F, 0x43004300, 0xea;
        lop3.b32 t2, w2, 0x000F000F, 0x43004300, 0xea;
        lop3.b32 t3, w3, 0x000F000F, 0x43004300, 0xea;
        fma.rn.bf16x2 t0, t0, one, off;
        fma.rn.bf16x2 t1, t1, one, off;
        fma.rn.bf16x2 t2, t2, one, off;
        fma.rn.bf16x2 t3, t3, one, off;
        fma.rn.bf16x2 t0, t0, ss, zz;
        fma.rn.bf16x2 t1, t1, ss, zz;
        fma.rn.bf16x2 t2, t2, ss, zz;
        fma.rn.bf16x2 t3, t3, ss, zz;
        mov.b32 {$0, $4}, t0;
        mov.b32 {$1, $5}, t1;
        mov.b32 {$2, $6}, t2;
        mov.b32 {$3, $7}, t3;
        }""",
        constraints="=h,=h,=h,=h,=h,=h,=h,=h,r,h,h", args=[words, s, z], dtype=(tl.bfloat16,) * 8,
        is_pure=True, pack=1)


@triton.jit
def _unpack_int4(words: tl.tensor) -> tl.tensor:
    """int32 words [R, W] (input 8j + i in bits 4i..4i+3 of word j) -> float32 [R, 8W] of q - 8, in
    input order: each nibble OR-ed into the mantissa of 2^e (e = 23 - its bit offset in the half
    word) is the float 2^e + q exactly."""
    h = tl.interleave(words, words >> 16)  # inputs 4t..4t+3 in bits 0..15 of half t
    f0 = ((h & 0xF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # 2^23 + 8
    f1 = ((h & 0xF0) | 0x49000000).to(tl.float32, bitcast=True) - 524296.0  # 2^19 + 8
    f2 = ((h & 0xF00) | 0x47000000).to(tl.float32, bitcast=True) - 32776.0  # 2^15 + 8
    f3 = ((h & 0xF000) | 0x45000000).to(tl.float32, bitcast=True) - 2056.0  # 2^11 + 8
    return tl.interleave(tl.interleave(f0, f2), tl.interleave(f1, f3))


@triton.jit
def _int4_tile_bf16x2(words: tl.tensor, s: tl.tensor, z: tl.tensor) -> tl.tensor:
    """int32 words [R, W] -> bf16 [R, 8W] in input order (input 8j + i at column 8j + i), the bf16x2
    planes (_int4_planes_bf16x2) joined: a join and a reshape put the second tensor's element beside the
    first's (the join's index becomes the column's lowest bit, later joins shift it up), so planes p and
    p + 4 are joined first (bit 2 of the plane), then pairs 2 apart (bit 1), then neighbours (bit 0).
    Each thread keeps its own elements: no data moves between threads."""
    p = _int4_planes_bf16x2(words, s, z)
    R: tl.constexpr = words.shape[0]
    W: tl.constexpr = words.shape[1]
    a0 = tl.reshape(tl.join(p[0], p[4]), (R, 2 * W))
    a1 = tl.reshape(tl.join(p[1], p[5]), (R, 2 * W))
    a2 = tl.reshape(tl.join(p[2], p[6]), (R, 2 * W))
    a3 = tl.reshape(tl.join(p[3], p[7]), (R, 2 * W))
    b0 = tl.reshape(tl.join(a0, a2), (R, 4 * W))
    b1 = tl.reshape(tl.join(a1, a3), (R, 4 * W))
    return tl.reshape(tl.join(b0, b1), (R, 8 * W))


@triton.jit
def _w4a16_tiles_kernel(X: tl.tensor, W: tl.tensor, S: tl.tensor, Z: tl.tensor, B: tl.tensor, OUT: tl.tensor,
                        P: tl.tensor, M: tl.tensor, N: tl.tensor, K: tl.tensor,
                        stride_xm: tl.tensor, stride_wn: tl.tensor, stride_sn: tl.tensor, stride_om: tl.tensor,
                        GROUP: tl.constexpr, BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr, QUANT: tl.constexpr,
                        BF16X2: tl.constexpr) -> None:
    """One [BLOCK_M, BLOCK_N] tile of out over split program_id(1)'s share of the K tiles (K a multiple
    of BLOCK_K): per K tile x's [BLOCK_M, BLOCK_K] as it lies, and the [BLOCK_N, BLOCK_K / 8] words
    dequantized in input order ((q - 8) * scale + zero rounded to x's dtype: BF16X2 by the bf16 pairs,
    else in float32) into the dot's right operand, which Hopper's wgmma reads from shared memory (the
    planes kernel's weights stay in registers but each plane is its own MMA; here one MMA a K tile, and
    the loads of the next stages run under it). OUT and P as _w4a16_kernel's; its splits are summed by
    _sum_splits_kernel (a tile's last program summing them ran 0.96-0.99x at 48-128 rows). Scales: one
    a row when BLOCK_K divides GROUP, else one a word (then in float32 only: with the bf16 pairs and a
    scale a word, Triton 3.6's TritonGPUOptimizeDotOperands pass fails to compile the kernel; _w4a16
    never asks for it)."""
    pid_m, pid_n = _banded_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    KW: tl.constexpr = BLOCK_K // 8
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    kk = tl.arange(0, BLOCK_K)
    jj = tl.arange(0, KW)
    mmask = rm < M
    nmask = rn < N
    x_rows = X + rm[:, None].to(tl.int64) * stride_xm
    w_rows = W + rn[:, None].to(tl.int64) * stride_wn
    s_rows, z_rows = S + rn * stride_sn, Z + rn * factor_stride(stride_sn, QUANT)
    tiles = K // BLOCK_K
    share = tl.cdiv(tiles, SPLIT_K)
    first = tl.program_id(1) * share
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for t in range(first, tl.minimum(first + share, tiles)):
        k0 = t * BLOCK_K
        x = tl.load(x_rows + (k0 + kk)[None, :], mask=mmask[:, None], other=0.0)
        words = tl.load(w_rows + (k0 // 8 + jj)[None, :], mask=nmask[:, None], other=0)
        if BLOCK_K <= GROUP:  # the tile within one group
            s, z = group_factors(s_rows, z_rows, k0 // GROUP, nmask, QUANT)
            s, z = s[:, None], z[:, None]
        else:  # a scale a word
            s, z = group_factors(s_rows[:, None], z_rows[:, None], ((k0 // 8 + jj) * 8 // GROUP)[None, :],
                                 nmask[:, None], QUANT)
        if BF16X2:
            w = _int4_tile_bf16x2(words, s, z)
        else:
            if BLOCK_K > GROUP:  # each word's factors over its 8 inputs
                s = tl.reshape(tl.broadcast_to(s[:, :, None], (BLOCK_N, KW, 8)), (BLOCK_N, BLOCK_K))
                z = tl.reshape(tl.broadcast_to(z[:, :, None], (BLOCK_N, KW, 8)), (BLOCK_N, BLOCK_K))
            w = (_unpack_int4(words) * s + z).to(X.dtype.element_ty)
        acc = tl.dot(x, tl.trans(w), acc)
    _store_tile(acc, OUT, P, B, P, rm[:, None], rn[None, :], mmask[:, None] & nmask[None, :], M, N, stride_om,
                SPLIT_K, BIAS, False)


@triton.jit
def _banded_tile(M: tl.tensor, N: tl.tensor, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 GROUP_M: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """This program's (M tile, N tile): programs in bands of GROUP_M M tiles that walk N together, so
    that a weight tile read once serves the band from L2."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    band = GROUP_M * tl.cdiv(N, BLOCK_N)
    first_m = (pid // band) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % band) % size_m, (pid % band) // size_m


@triton.jit
def _w4a16_kernel(X: tl.tensor, W: tl.tensor, S: tl.tensor, Z: tl.tensor, B: tl.tensor, OUT: tl.tensor,
                  P: tl.tensor, COUNTS: tl.tensor, M: tl.tensor, N: tl.tensor, K: tl.tensor, stride_xm: tl.tensor,
                  stride_x_plane: tl.tensor, stride_x_word: tl.tensor, stride_wn: tl.tensor, stride_sn: tl.tensor,
                  stride_om: tl.tensor, GROUP: tl.constexpr, BIAS: tl.constexpr, EVEN_K: tl.constexpr,
                  SPLIT_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  GROUP_M: tl.constexpr, QUANT: tl.constexpr, BF16X2: tl.constexpr = False,
                  LAST_SUMS: tl.constexpr = False) -> None:
    """One [BLOCK_N, BLOCK_M] tile of out^T over split program_id(1)'s share of the K tiles: per K
    tile the [BLOCK_N, BLOCK_K / 8] words, each of its 8 planes dequantized ((q - 8) * scale + zero,
    rounded to x's dtype) and dotted with x's matching columns, loaded transposed [BLOCK_K / 8,
    BLOCK_M] at k0 + i * stride_x_plane + j * stride_x_word. OUT: out [M, N] in x's dtype (+ bias); with
    SPLIT_K > 1 each program's float32 partial goes to P [SPLIT_K, M, N] and, with LAST_SUMS, the tile's
    last program sums them into OUT (_store_tile; else _sum_splits_kernel does). Scales: one a row when BLOCK_K divides
    GROUP, else one a word. Unless EVEN_K the last tile (a ragged last group) is masked at K. BF16X2:
    x, scales and zeros bf16 on CUDA; the planes dequantized two weights an instruction in bf16."""
    pid_m, pid_n = _banded_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    KW: tl.constexpr = BLOCK_K // 8
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    jj = tl.arange(0, KW)
    mmask = rm < M
    nmask = rn < N
    x_cols = X + rm[None, :].to(tl.int64) * stride_xm
    w_rows = W + rn[:, None].to(tl.int64) * stride_wn
    s_rows, z_rows = S + rn * stride_sn, Z + rn * factor_stride(stride_sn, QUANT)
    tiles = tl.cdiv(K, BLOCK_K)
    share = tl.cdiv(tiles, SPLIT_K)
    first = tl.program_id(1) * share
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for t in range(first, tl.minimum(first + share, tiles)):
        k0 = t * BLOCK_K
        kw = k0 // 8 + jj
        wmask = nmask[:, None] if EVEN_K else nmask[:, None] & (kw < K // 8)[None, :]
        xmask = mmask[None, :] if EVEN_K else mmask[None, :] & (kw < K // 8)[:, None]
        words = tl.load(w_rows + kw[None, :], mask=wmask, other=0)
        if BLOCK_K <= GROUP:  # the tile within one group
            s, z = group_factors(s_rows, z_rows, k0 // GROUP, nmask, QUANT)
            s, z = s[:, None], z[:, None]
        else:
            s, z = group_factors(s_rows[:, None], z_rows[:, None], (kw * 8 // GROUP)[None, :], wmask, QUANT)
        if BF16X2:
            planes = _int4_planes_bf16x2(words, s, z)
            for i in tl.static_range(8):
                xt = tl.load(x_cols + (k0 + i * stride_x_plane + jj * stride_x_word)[:, None], mask=xmask, other=0.0)
                acc = tl.dot(planes[i], xt, acc)
        else:
            for i in tl.static_range(8):
                w = (_int4_plane(words, i) * s + z).to(X.dtype.element_ty)
                xt = tl.load(x_cols + (k0 + i * stride_x_plane + jj * stride_x_word)[:, None], mask=xmask, other=0.0)
                acc = tl.dot(w, xt, acc)
    _store_tile(acc, OUT, P, B, COUNTS, rm[None, :], rn[:, None], nmask[:, None] & mmask[None, :], M, N, stride_om,
                SPLIT_K, BIAS, LAST_SUMS)


@triton.jit
def _store_tile(acc: tl.tensor, OUT: tl.tensor, P: tl.tensor, B: tl.tensor, COUNTS: tl.tensor, rows: tl.tensor,
                cols: tl.tensor, mask: tl.tensor, M: tl.tensor, N: tl.tensor, stride_om: tl.tensor,
                SPLIT_K: tl.constexpr, BIAS: tl.constexpr, LAST_SUMS: tl.constexpr) -> None:
    """A program's float32 sums acc for out[rows, cols] (rows, cols and mask broadcast to acc's shape) over
    its share of K. SPLIT_K == 1: (+ bias) rounded into OUT [M, N] (row stride stride_om). Else into P
    [SPLIT_K, M, N] at split program_id(1); with LAST_SUMS each program then counts itself done on its
    tile's COUNTS[program_id(0)], and the last of the tile's SPLIT_K sums their partials in split order
    (as _sum_splits_kernel would, whichever finishes last) (+ bias) into OUT and sets the count back to
    0 for the next launch: no second kernel."""
    if SPLIT_K == 1:
        if BIAS:
            acc += tl.load(B + cols + rows * 0, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + rows.to(tl.int64) * stride_om + cols, acc.to(OUT.dtype.element_ty), mask=mask)
    else:
        part = rows.to(tl.int64) * N + cols
        tl.store(P + tl.program_id(1) * M * N + part, acc, mask=mask)
        if LAST_SUMS:
            tl.debug_barrier()  # every thread's partial stored before the count that announces it
            done = tl.atomic_add(COUNTS + tl.program_id(0), 1, sem="acq_rel", scope="gpu")
            if done == SPLIT_K - 1:
                total = tl.zeros(acc.shape, tl.float32)
                for split in tl.static_range(SPLIT_K):  # (.cg: from L2, where the other programs' partials are)
                    total += tl.load(P + split * M * N + part, mask=mask, other=0.0, cache_modifier=".cg")
                if BIAS:
                    total += tl.load(B + cols + rows * 0, mask=mask, other=0.0).to(tl.float32)
                tl.store(OUT + rows.to(tl.int64) * stride_om + cols, total.to(OUT.dtype.element_ty), mask=mask)
                tl.atomic_xchg(COUNTS + tl.program_id(0), 0, sem="relaxed", scope="gpu")


@triton.jit
def _sum_splits_kernel(P: tl.tensor, B: tl.tensor, OUT: tl.tensor, MN: tl.tensor, N: tl.tensor,
                       SPLIT_K: tl.constexpr, BIAS: tl.constexpr, BLOCK: tl.constexpr) -> None:
    """out [M, N] (contiguous) = the float32 partials [SPLIT_K, M, N] summed (+ bias), in out's dtype."""
    idx = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = idx < MN
    acc = tl.load(P + idx, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(P + s * MN + idx, mask=mask, other=0.0)
    if BIAS:
        acc += tl.load(B + idx % N, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + idx, acc.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _w8a16_kernel(X: tl.tensor, W: tl.tensor, S: tl.tensor, Z: tl.tensor, B: tl.tensor, OUT: tl.tensor,
                  M: tl.tensor, N: tl.tensor, K: tl.tensor, stride_xm: tl.tensor, stride_wn: tl.tensor,
                  stride_sn: tl.tensor, stride_om: tl.tensor, BIAS: tl.constexpr, ZERO: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                  GROUP: tl.constexpr) -> None:
    """One [BLOCK_M, BLOCK_N] tile of the output from int8 / fp8 [N, K] tiles converted to x's dtype,
    the per-channel scale on the float32 sums (GROUP > 1: each input's group scale on the weight
    before the product, as dequantizing would, and with ZERO its group's zero added); programs in
    GROUP_M-row bands (the weight's tiles reused from L2 across a band)."""
    pid_m, pid_n = _banded_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rm < M
    nmask = rn < N
    x_rows = X + rm[:, None].to(tl.int64) * stride_xm
    w_rows = W + rn[:, None].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_rows + k[None, :], mask=mmask[:, None] & (k < K)[None, :], other=0.0)
        wmask = nmask[:, None] & (k < K)[None, :]
        if GROUP > 1:
            s = tl.load(S + rn[:, None] * stride_sn + (k // GROUP)[None, :], mask=wmask, other=0.0)
            wf = tl.load(w_rows + k[None, :], mask=wmask, other=0.0).to(tl.float32) * s
            if ZERO:
                wf += tl.load(Z + rn[:, None] * stride_sn + (k // GROUP)[None, :], mask=wmask, other=0.0)
            w = wf.to(x.dtype)
        else:
            w = tl.load(w_rows + k[None, :], mask=wmask, other=0.0).to(x.dtype)
        acc = tl.dot(x, tl.trans(w), acc)
    if GROUP == 1:
        acc = acc * tl.load(S + rn, mask=nmask, other=0.0)[None, :]
    if BIAS:
        acc += tl.load(B + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(OUT.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])
