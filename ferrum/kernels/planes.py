"""Quantized weights read as "planes": input i of every int32 word of a weight as float32, for the
decode GEMVs (ferrum.kernels.gemv, ferrum.kernels.gemv_chunks)."""

from __future__ import annotations

import triton
import triton.language as tl

# the GEMV kernels' QUANT constant: how the weight is stored and read
PLAIN = 0  # the activations' dtype, [BLOCK_N, BLOCK_K] tiles
PER_CHANNEL = 1  # fp8 (or int8 with K not a multiple of 4): tiles converted to float32, a scale per row
INT4 = 2  # int32 words of 8 inputs, read as 8 planes; a scale and zero per group
INT8 = 3  # int32 words of 4 inputs, read as 4 planes; a scale per row
FP8 = 5  # int32 words of 4 e4m3 inputs, read as 4 planes; a scale per row
INT8_ZERO = 6  # as INT8 with a scale and a zero per group (w = q * scale + zero)
INT4_K = 7  # as INT4, each group's scale and zero from 6-bit sub-scales and a super-block's factors (group_factors)
SUPER_GROUPS = 8  # INT4_K: groups a super-block (llama.cpp's K-quants: 8 sub-blocks of 32 in 256 inputs)

@triton.jit
def plane(words: tl.tensor, magic: tl.tensor, i: tl.constexpr, PLANES: tl.constexpr) -> tl.tensor:
    """Input i of each word as a float32 2^e + u, u its stored bits (int4: q; int8: words ^
    0x80808080, q + 128): one shift brings inputs 2t and 2t + 1 to the top of the mantissa (int4: bits
    15-18 and 19-22; int8: 7-14 and 15-22), one logic op masks the input's bits and ORs them into the
    mantissa of 2^e (magic = 2^23's bits in a register, so that the mask and the OR are one op), e =
    23 - the slot's lowest bit (int4: 2^8 + q, 2^4 + q; int8: 2^16 + u, 2^8 + u). No conversion
    instruction (the SM runs those 4x slower) and no subtraction: each word's sums start from minus
    its x times these offsets."""
    BITS: tl.constexpr = 32 // PLANES
    shift: tl.constexpr = (15 - 8 * (i // 2)) if PLANES == 8 else (7 - 16 * (i // 2))
    slot: tl.constexpr = (15 if PLANES == 8 else 7) + BITS * (i % 2)
    mask: tl.constexpr = ((1 << BITS) - 1) << slot
    if shift > 0:
        t = words << shift
    else:
        t = words >> -shift
    return ((t & mask) | (magic - (slot << 23))).to(tl.float32, bitcast=True)  # 2^(23 - slot) + u


@triton.jit
def fp8_planes(words: tl.tensor, ASM: tl.constexpr) -> tuple[tl.tensor, tl.tensor, tl.tensor, tl.tensor]:
    """The 4 e4m3 inputs of each word as float32, exactly. ASM (a GPU): the hardware's conversion, two
    inputs an instruction to half precision (which holds every e4m3 value), then to float32: 1.5
    instructions an input; otherwise (Triton's interpreter) from the bits: (8 + m) 2^(e - 10), or m 2^-9
    where e = 0."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm="""{
            .reg .b16 lo, hi, a, b, c, d;
            .reg .b32 h01, h23;
            .reg .f32 f0, f1, f2, f3;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 h01, lo;
            cvt.rn.f16x2.e4m3x2 h23, hi;
            mov.b32 {a, b}, h01;
            mov.b32 {c, d}, h23;
            cvt.f32.f16 f0, a;
            cvt.f32.f16 f1, b;
            cvt.f32.f16 f2, c;
            cvt.f32.f16 f3, d;
            mov.b32 $0, f0;
            mov.b32 $1, f1;
            mov.b32 $2, f2;
            mov.b32 $3, f3;
            }""",
            constraints="=r,=r,=r,=r,r", args=[words], dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True, pack=1)
    f0 = _fp8_bits_to_float(words & 0xFF)
    f1 = _fp8_bits_to_float((words >> 8) & 0xFF)
    f2 = _fp8_bits_to_float((words >> 16) & 0xFF)
    f3 = _fp8_bits_to_float((words >> 24) & 0xFF)
    return f0, f1, f2, f3


@triton.jit
def _fp8_bits_to_float(b: tl.tensor) -> tl.tensor:
    """An e4m3 byte (in an int32) as float32."""
    e = (b >> 3) & 0xF
    m = (b & 7).to(tl.float32)
    v = tl.where(e == 0, m * 0.001953125, (m + 8.0) * ((e + 117) << 23).to(tl.float32, bitcast=True))
    return tl.where((b & 0x80) != 0, -v, v)


@triton.jit
def factor_stride(stride_sn: tl.tensor, QUANT: tl.constexpr) -> tl.tensor:
    """The row stride of Z given S's (stride_sn): INT4_K's super-block factors are one a SUPER_GROUPS
    groups (ceil(groups / 8) a row); every other kind's zeros lie as its scales."""
    if QUANT == 7:
        return (stride_sn + 7) // 8
    return stride_sn


@triton.jit
def load_factors(s_cols: tl.tensor, z_cols: tl.tensor, g: tl.tensor, mask: tl.tensor,
                 QUANT: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """The stored factors of groups g of the rows at s_cols / z_cols (S and Z + row * their row strides),
    as loaded (factors_of makes them the scale and zero): INT4 (and INT8_ZERO) their scale and zero;
    INT4_K (llama.cpp's Q4_K, w = d sc q - dmin m) S's int16 sc | m << 8 a group (6-bit sub-scale and
    minimum) and Z's int64 a super-block, float32 d in its low word and dmin in its high one."""
    if QUANT == 7:
        return tl.load(s_cols + g, mask=mask, other=0), tl.load(z_cols + g // 8, mask=mask, other=0)
    return tl.load(s_cols + g, mask=mask, other=0.0), tl.load(z_cols + g, mask=mask, other=0.0)


@triton.jit
def factors_of(s: tl.tensor, z: tl.tensor, QUANT: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """The (scale, zero) float32 of load_factors' values, w = (q - 8) * scale + zero. INT4_K: scale = d sc
    and zero = 8 scale - dmin m, exact products (11 by 6 bits) and one rounding of the difference, as
    float32 storage of the zero would round it; sc and m become floats as 2^23 + u by one logic op and a
    subtraction, d and dmin by taking a word of the int64 (no conversion instructions)."""
    if QUANT == 7:
        sm = s.to(tl.int32)
        d = z.to(tl.int32).to(tl.float32, bitcast=True)
        dmin = (z >> 32).to(tl.int32).to(tl.float32, bitcast=True)
        sc = ((sm & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0  # 2^23
        m = (((sm >> 8) & 0xFF) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0
        scale = d * sc
        return scale, 8.0 * scale - dmin * m
    return s.to(tl.float32), z.to(tl.float32)


@triton.jit
def group_factors(s_cols: tl.tensor, z_cols: tl.tensor, g: tl.tensor, mask: tl.tensor,
                  QUANT: tl.constexpr) -> tuple[tl.tensor, tl.tensor]:
    """The (scale, zero) float32 of groups g of the rows at s_cols / z_cols: load_factors, then factors_of."""
    s, z = load_factors(s_cols, z_cols, g, mask, QUANT)
    return factors_of(s, z, QUANT)
