"""Products of many rows with a quantized weight (prefill, large decode batches), on CUDA:
`quant_matmul(x [M, K], w: QuantWeight, bias)` -> [M, N] in x's dtype, equal to
x @ dequantize(w).T + bias up to each path's error. The path, by M and method (the thresholds
are measured on one H100 at the Llama-3.1-8B shapes, scripts/quant_gemv_bench.py):

    M = 1          any     the fused decode GEMV (ferrum.kernels.gemv) with the kind's table: reading
                           the packed weight once is the whole cost; W8A16 / W4A16 in float32 from
                           the stored values exactly. (At 4 rows the GEMV ran 0.4-0.8x bf16 cuBLAS
                           and the GEMM below, 16-row tiles, 1.2-1.7x on the 8B gate/up; at 16 rows
                           the GEMV 5-20x slower than cuBLAS.)
    M > 1          int4    M < 128: a Triton W4A16 GEMM, each [BLOCK_N, BLOCK_K] tile of packed words
                           unpacked in registers, (q - 8) * scale + zero rounded to x's dtype, then
                           tl.dot on the tensor cores (BLOCK_K within one group: one scale and zero
                           a row a tile), fixed tiles by M bucket (_gemm_config).
                           M >= 128: the weight dequantized to x's dtype by one Triton kernel into a
                           transient [N, K] buffer, then cuBLAS: the dequantization (~0.1 ms for the
                           8B gate/up) is paid once for all M rows, and cuBLAS's GEMM is about twice
                           the Triton GEMM's speed there (the buffer is the largest weight in bf16,
                           235 MB for the 8B gate/up, held by the caching allocator)
                   int8    M > 16, K and N multiples of 8: W8A8, x quantized per row to int8 as it
                           comes (scale = max|x_row| / 127, one Triton kernel), torch._int_mm (int8
                           tensor cores, int32 sums), then * x_scale * w_scale (+ bias) in one kernel;
                           otherwise the Triton GEMM (W8A16)
                   fp8     M > 16, K and N multiples of 16: W8A8 in float8 e4m3, x per row to fp8
                           (scale = max|x_row| / 448), then torch._scaled_mm with row-wise scales
                           (scale_a [M, 1], scale_b [1, N] float32, compute capability 9.0);
                           otherwise (and on 8.9 GPUs) the Triton GEMM (W8A16)

Expected error against x @ dequantize(w).T in float32, relative (Frobenius), for activations
without outliers (tests/kernels/test_quant_kernels.py checks these bounds):
    GEMV (M = 1)     ~2e-3: the output's rounding to bf16 only                       bound 1e-2
    W4A16, W8A16     ~3e-3: the dequantized weight rounded to bf16 before the dot    bound 1e-2
    W8A8 int8        ~1e-2: x's rounding to 1/127 of its row's largest magnitude     bound 2e-2
    W8A8 fp8         ~3e-2: x's rounding to e4m3's 3 mantissa bits                   bound 5e-2
(per-row activation scales grow the W8A8 error with a row's outliers: max|x| / rms(x).)
Whether the device runs the method at all (fp8: compute capability 8.9) is checked at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ferrum.kernels.config import GemvTable, KernelConfig
from ferrum.kernels.gemv import INT4, PER_CHANNEL, gemv, kernel_weight
from ferrum.kernels.quant_weight import QuantWeight

GEMV_ROWS = 1  # up to this many rows: the fused GEMV
DEQUANTIZE_FROM = 128  # int4 from this many rows: dequantize + cuBLAS


@dataclass(frozen=True)
class GemmConfig:
    """The Triton GEMM's tiling for one M bucket."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def _gemm_config(m: int) -> GemmConfig:
    """Tiles by M: small M (decode batches past the GEMV) spread N over more programs; large M
    (prefill) take the usual 128 x 128 tiles."""
    if m <= 32:
        return GemmConfig(16, 64, 128, 4, 4)
    if m <= 64:
        return GemmConfig(32, 64, 128, 4, 4)
    if m <= 256:
        return GemmConfig(64, 128, 64, 4, 4)
    return GemmConfig(128, 128, 64, 8, 3)


def quant_matmul(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None, *,
                 table: GemvTable | None = None, fp8_rowwise: bool = True) -> torch.Tensor:
    """x [..., K] (contiguous along K) @ dequantize(w).T + bias -> [..., N] in x's dtype, by the
    path the module docstring gives for M (the rows of x) and w.kind. table: the GEMV's for M <=
    GEMV_ROWS (default: KernelConfig's for w.kind). fp8_rowwise: torch._scaled_mm takes row-wise
    scales on this device (compute capability 9.0; an 8.9 GPU takes the Triton W8A16 GEMM)."""
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
    elif w.kind == "int4" and m >= DEQUANTIZE_FROM:
        y = torch.nn.functional.linear(flat, dequantize_int4(w, flat.dtype), bias)
    elif w.kind == "int8" and m > 16 and k % 8 == 0 and n % 8 == 0:
        y = _w8a8_int8(flat, w, bias)
    elif w.kind == "fp8" and m > 16 and k % 16 == 0 and n % 16 == 0 and fp8_rowwise:
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
    xq, x_scale = quantize_rows(x, torch.float8_e4m3fn)
    y = torch._scaled_mm(xq, w.qweight.t(), scale_a=x_scale[:, None], scale_b=w.scale[None, :],
                         out_dtype=x.dtype)
    if bias is not None:
        y += bias
    return y


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (q [M, K] in `dtype`: int8 or float8_e4m3fn, scale float32 [M]), x ~ q * scale[:, None],
    each row scaled so that its largest magnitude is the format's largest (127, 448)."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=dtype, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    block = min(triton.next_power_of_2(k), 4096)
    _quantize_rows_kernel[(m,)](x, q, scale, k, x.stride(0), q.stride(0), FP8=dtype == torch.float8_e4m3fn,
                                BLOCK_K=block, num_warps=8 if block >= 2048 else 4)
    return q, scale


@triton.jit
def _quantize_rows_kernel(X: tl.tensor, Q: tl.tensor, SCALE: tl.tensor, K: tl.tensor, stride_xm: tl.tensor,
                          stride_qm: tl.tensor, FP8: tl.constexpr, BLOCK_K: tl.constexpr) -> None:
    """One row a program: its largest magnitude, then the row over the scale, rounded (int8: to
    nearest, ties away from zero; fp8: the conversion's round to nearest even)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_xm
    kk = tl.arange(0, BLOCK_K)
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        amax = tl.maximum(amax, tl.abs(tl.load(x_row + k0 + kk, mask=k0 + kk < K, other=0.0).to(tl.float32)))
    qmax = 448.0 if FP8 else 127.0
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


def dequantize_int4(w: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """The int4 weight as [N, K] in `dtype` ((q - 8) * scale + zero, rounded once), by one kernel."""
    kw = kernel_weight(w)
    n, k = kw.out_rows, kw.in_features
    out = torch.empty(n, k, dtype=dtype, device=w.qweight.device)
    block_n, block_k = 32, min(kw.group, 256)
    _dequantize_int4_kernel[(triton.cdiv(n, block_n), triton.cdiv(k, block_k))](
        kw.data, kw.scale, kw.zero, out, n, k, kw.stride_wn, kw.stride_sn, out.stride(0), GROUP=kw.group,
        BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, num_warps=4)
    return out


@triton.jit
def _dequantize_int4_kernel(W: tl.tensor, S: tl.tensor, Z: tl.tensor, OUT: tl.tensor, N: tl.tensor, K: tl.tensor,
                            stride_wn: tl.tensor, stride_sn: tl.tensor, stride_on: tl.tensor, GROUP: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr) -> None:
    """One [BLOCK_N, BLOCK_K] block of the dequantized weight (BLOCK_K divides GROUP: within one
    group; unless EVEN_K the last block, in a ragged last group, is masked at K)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    nmask = rn < N
    kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
    kk = k0 + tl.arange(0, BLOCK_K)
    wmask = nmask[:, None] if EVEN_K else nmask[:, None] & (kw < K // 8)[None, :]
    omask = nmask[:, None] if EVEN_K else nmask[:, None] & (kk < K)[None, :]
    words = tl.load(W + rn[:, None].to(tl.int64) * stride_wn + kw[None, :], mask=wmask, other=0)
    s = tl.load(S + rn * stride_sn + k0 // GROUP, mask=nmask, other=0.0).to(tl.float32)
    z = tl.load(Z + rn * stride_sn + k0 // GROUP, mask=nmask, other=0.0).to(tl.float32)
    w = _unpack_int4(words) * s[:, None] + z[:, None]
    tl.store(OUT + rn[:, None].to(tl.int64) * stride_on + kk[None, :], w.to(OUT.dtype.element_ty), mask=omask)


def triton_gemm(x: torch.Tensor, w: QuantWeight, bias: torch.Tensor | None = None,
                config: GemmConfig | None = None) -> torch.Tensor:
    """x [M, K] @ dequantize(w).T (+ bias) -> [M, N] in x's dtype: the weight's tiles dequantized
    in registers to x's dtype, then tl.dot (W4A16; W8A16 for int8 and fp8, whose per-channel
    scale multiplies the float32 sums once)."""
    kw = kernel_weight(w)  # checks the layout
    m, k = x.shape
    n = kw.out_rows
    assert k == kw.in_features and x.stride(1) == 1, (x.shape, k)
    cfg = config or _gemm_config(m)
    if kw.quant == INT4:
        data, stride_wn, quant = kw.data, kw.stride_wn, INT4
        block_k = min(cfg.block_k, kw.group)  # a tile within one group
    else:  # int8 / fp8 read as [BLOCK_N, BLOCK_K] tiles of q
        data, stride_wn, quant, block_k = w.qweight, w.qweight.stride(0), PER_CHANNEL, cfg.block_k
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _gemm_kernel[grid](
        x, data, kw.scale, kw.zero, bias if bias is not None else x, out, m, n, k,
        x.stride(0), stride_wn, kw.stride_sn, out.stride(0),
        QUANT=quant, GROUP=kw.group, BIAS=bias is not None, EVEN_K=k % block_k == 0,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=block_k, GROUP_M=8,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out


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
def _gemm_kernel(X: tl.tensor, W: tl.tensor, S: tl.tensor, Z: tl.tensor, B: tl.tensor, OUT: tl.tensor,
                 M: tl.tensor, N: tl.tensor, K: tl.tensor, stride_xm: tl.tensor, stride_wn: tl.tensor,
                 stride_sn: tl.tensor, stride_om: tl.tensor, QUANT: tl.constexpr, GROUP: tl.constexpr,
                 BIAS: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr) -> None:
    """One [BLOCK_M, BLOCK_N] tile of the output; programs in GROUP_M-row bands (the weight's
    tiles reused from L2 across a band). QUANT, GROUP: as _gemv_kernel's (int4: BLOCK_K divides
    GROUP, so a tile is within one group, k0 // GROUP; EVEN_K: K is whole tiles, else the last
    tile, in a ragged last group, reads its words masked at K)."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    band = GROUP_M * num_n
    first_m = (pid // band) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % band) % size_m
    pid_n = (pid % band) // size_m
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
        if QUANT == 2:  # BLOCK_K divides the group: one scale and zero a row; masked along K only unless EVEN_K
            kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)
            wmask = nmask[:, None] if EVEN_K else nmask[:, None] & (kw < K // 8)[None, :]
            words = tl.load(w_rows + kw[None, :], mask=wmask, other=0)
            s = tl.load(S + rn * stride_sn + k0 // GROUP, mask=nmask, other=0.0).to(tl.float32)
            z = tl.load(Z + rn * stride_sn + k0 // GROUP, mask=nmask, other=0.0).to(tl.float32)
            w = (_unpack_int4(words) * s[:, None] + z[:, None]).to(x.dtype)
        else:
            w = tl.load(w_rows + k[None, :], mask=nmask[:, None] & (k < K)[None, :], other=0.0).to(x.dtype)
        acc = tl.dot(x, tl.trans(w), acc)
    if QUANT == 1:
        acc = acc * tl.load(S + rn, mask=nmask, other=0.0)[None, :]
    if BIAS:
        acc += tl.load(B + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(OUT + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(OUT.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])

