"""The kernels with quantized weights (ferrum.kernels.gemv with a QuantWeight, ferrum.kernels.quant_matmul)
against the same operation on the dequantized weight in float64: every prologue and epilogue of the
fused decode GEMV for int8, fp8 and int4 under several slicings, the q/k/v projection with rope and
the cache write, and the prefill / large-batch products by method.

Interpreted by Triton on machines without CUDA (fp16 there, tiny shapes); the Llama-3.1-8B shapes
and quant_matmul's torch._int_mm / torch._scaled_mm paths run on a GPU only.

Bounds: the decode GEMV computes in float32 from the stored values exactly (W8A16 / W4A16), so it
differs from the dequantized reference only by the output's rounding to the activations' dtype
(~2e-3 relative in fp16/bf16, intermediate gate/up roundings included): 1e-2 below. With int8 inputs
(int4 at one row, GemvTable.int8_inputs) x is rounded to int8 a chunk of 32 first: ~6e-3, bound 2e-2
(test_int4_gemv_with_int8_inputs checks the rounding itself). quant_matmul's bounds are stated by method
in quant_matmul.py and checked in test_quant_matmul_by_method.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ferrum.kernels.config import GemmRules, GemvTable, KernelConfig
from ferrum.kernels.quant_weight import QuantWeight
from ferrum.weights.quantization.arith import dequantize, quantize
from ferrum.weights.quantization.scheme import QuantScheme
from ferrum.weights.quantization.tensor import QuantizedTensor
from tests.triton_interpreter import ON_GPU, use_interpreter

use_interpreter()
from ferrum.kernels import gemv as tg  # noqa: E402  (after the interpreter is chosen)
from ferrum.kernels import quant_matmul as qm  # noqa: E402
from ferrum.kernels import rope  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float16
KINDS = ("int8", "fp8", "int4")
GROUP = 32  # the interpreted tests' int4 group: K = 128 holds four
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs CUDA")


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm())


def rms_normed(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.double()
    return w.double() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def q4_k(w: torch.Tensor) -> tuple[QuantWeight, torch.Tensor]:
    """A weight [N, K] stored as GGUF's Q4_K is served (QuantScheme.sub_scales): random codes, 6-bit sub-scales
    and minimums and super-block factors (float16 values) about the size of w's (a short last super-block where 256
    does not divide K), as the kernels take it, and the weight it stands for (float64, on the CPU)."""
    gen = torch.Generator().manual_seed(w.shape[1])
    n, k = w.shape
    scheme = QuantScheme("int4", 32, sub_scales=True)
    amax = float(w.float().abs().max())
    parts = {"qweight": torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8),
             "sub_scales": torch.randint(0, 64, (n, scheme.groups(k), 2), generator=gen, dtype=torch.uint8),
             "super_scales": (torch.rand(n, scheme.supers(k), 2, generator=gen) * amax / 256).half().float()}
    qt = QuantizedTensor(scheme, (n, k), w.dtype, parts)
    assert not qt.layout_problems()
    d = {name: part.to(DEVICE) for name, part in parts.items()}
    kernel = QuantWeight("int4", d["qweight"], d["sub_scales"].view(torch.int16)[..., 0],
                         d["super_scales"].view(torch.int64)[..., 0], 32, sub_scales=True)
    return kernel, dequantize(qt, torch.float64)


def quantized(w: torch.Tensor, kind: str, group: int = GROUP) -> tuple[QuantWeight, torch.Tensor]:
    """w [N, K] in `kind` ("int8-g" / "fp8-g": a scale per group; "int8-gz": and a zero per group, as
    GGUF's Q5_K has: random, about the size of the weights; "int4-k": GGUF's Q4_K, q4_k), as the kernels
    take it, and the weight it stands for (float64, on the CPU)."""
    if kind == "int4-k":
        return q4_k(w)
    zeros = kind == "int8-gz"
    kind = kind.removesuffix("z")
    method, per_group = kind.removesuffix("-g"), kind.endswith("-g")
    qt = quantize(w, QuantScheme(method, group, per_group=per_group))  # type: ignore[arg-type]
    if zeros:
        zero = torch.randn(qt.parts["scale"].shape, generator=torch.Generator().manual_seed(9)) / 8
        qt = QuantizedTensor(QuantScheme("int8", group, per_group=True, offsets=True), qt.shape, qt.dtype,
                             {**qt.parts, "zero": zero})
    parts = {name: part.to(DEVICE) for name, part in qt.parts.items()}
    kernel = QuantWeight(method, parts["qweight"], parts["scale"], parts.get("zero"),  # type: ignore[arg-type]
                         group if method == "int4" or per_group else 0)
    return kernel, dequantize(qt, torch.float64)


TABLES = [  # K = 128, int4 groups of 32
    GemvTable(),  # all of K in one slice: the norm before the product; int4: four groups a slice
    GemvTable(features_per_program=4, whole_k_with_norm=64, whole_k_without_norm=64, k_slice=64),  # two a slice
    GemvTable(features_per_program=8, whole_k_with_norm=16, whole_k_without_norm=16, k_slice=16),  # half a group
]
CASES = [(kind, table) for kind in KINDS for table in TABLES if kind == "int4" or table.k_slice != 16]
CASES += [(kind, table) for kind in ("int8-g", "fp8-g", "int8-gz", "int4-k") for table in TABLES]  # groups of 32


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize(("kind", "table"), CASES, ids=lambda c: c if isinstance(c, str) else f"slice{c.k_slice}")
def test_quantized_gemv_with_norm_gate_bias_and_residual(kind: str, table: GemvTable, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows * 10 + table.k_slice)
    n, k = 20, 128  # 20: the last feature block is partial
    x = torch.randn(rows, k, generator=gen).to(DTYPE)
    w = (torch.randn(2 * n, k, generator=gen) / 8).to(DTYPE)
    bias = torch.randn(2 * n, generator=gen).to(DTYPE)
    norm_w = (1 + 0.2 * torch.randn(k, generator=gen)).to(DTYPE)
    residual = torch.randn(rows, n, generator=gen).to(DTYPE)
    d = lambda t: t.to(DEVICE)  # noqa: E731
    qw, ref_w = quantized(w, kind)
    up_rows, ref_down = quantized(w[:n], kind)

    plain = tg.gemv(d(x), up_rows, table)
    assert plain.shape == (rows, n) and plain.dtype == DTYPE
    assert rel_err(plain, x.double() @ ref_down.T) < 1e-2

    gated = tg.gemv(d(x), qw, table, bias=d(bias), norm_weight=d(norm_w), eps=1e-5, gated=True)
    gate_up = rms_normed(x, norm_w, 1e-5) @ ref_w.T + bias.double()
    gate, up = gate_up[:, :n], gate_up[:, n:]
    assert rel_err(gated, torch.nn.functional.silu(gate) * up) < 1e-2

    summed = tg.gemv(d(x), up_rows, table, residual=d(residual), out_dtype=torch.float32)
    assert summed.dtype == torch.float32
    assert rel_err(summed, x.double() @ ref_down.T + residual.double()) < 1e-2


def int8_chunks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] rounded as the GEMV's int8 inputs are (gemv_chunks._int8_chunks): to int8 with one step a
    32-input chunk, its largest magnitude / 127; returned dequantized (float64), with each input's step
    where it lies within 1e-4 of a step from a tie (16-bit inputs meet ties often: x = max / 2 is one;
    the GPU's division for 127 / max, good to 2 units in the last place, may round such an input
    either way) and 0 elsewhere."""
    chunks = x.float().reshape(x.shape[0], -1, 32)
    amax = chunks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    scaled = chunks * inv
    step = amax.double() / 127
    near_tie = ((scaled - scaled.floor() - 0.5).abs() < 1e-4).double()
    return (scaled.round().double() * step).reshape(x.shape), (near_tie * step).reshape(x.shape)


# the first: products without a norm in programs of 16 features (whole_k_features; 20 outputs: one partial)
A8_TABLES = [GemvTable(int8_inputs=True, whole_k_features=16), GemvTable.sliced(4, 64, int8_inputs=True)]


@pytest.mark.parametrize(("kind", "table"), [("int4", A8_TABLES[0]), ("int4-k", A8_TABLES[1])],
                         ids=["int4-whole", "int4-k-sliced"])
def test_int4_gemv_with_int8_inputs(kind: str, table: GemvTable) -> None:
    """One row, x rounded to int8 a chunk of 32 (int8_inputs): each output equals the dequantized weight's
    product with x so rounded, within one unit of the output's last place (the sums are exact in int32; the
    scaling in float32 adds ~1e-7), where the exact x's product differs by more for some outputs; and the
    exact product within the rounding of x (~5e-3 for Gaussian x: a step of max|x| / 127 a chunk). With the
    norm, gate and residual, and as the q/k/v projection with rope and the cache write: the same kernel's
    outputs with x in float32 (checked against the exact products above) within that rounding."""
    gen = torch.Generator().manual_seed(31)
    n, k = 20, 256
    x = torch.randn(1, k, generator=gen).to(DTYPE)
    w = (torch.randn(2 * n, k, generator=gen) / 8).to(DTYPE)
    norm_w = (1 + 0.2 * torch.randn(k, generator=gen)).to(DTYPE)
    residual = torch.randn(1, n, generator=gen).to(DTYPE)
    d = lambda t: t.to(DEVICE)  # noqa: E731
    qw, ref_w = quantized(w, kind)
    assert tg.int8_inputs(tg.kernel_weight(qw).quant, 4, table)
    floats = replace(table, int8_inputs=False)

    plain = tg.gemv(d(x), qw, table).double().cpu()
    x8, ties = int8_chunks(x)
    rounded, exact = x8 @ ref_w.T, x.double() @ ref_w.T
    ulp = torch.finfo(DTYPE).eps  # the output's rounding: at most half of this, relative
    slack = 1e-4 * exact.abs().mean() + ties @ ref_w.abs().T  # float32's rounding of the scaled sums; ties
    assert ((plain - rounded).abs() <= ulp * rounded.abs() + slack).all()
    assert ((rounded - exact).abs() > 2 * ulp * exact.abs() + slack).any()  # (the rounding of x shows)
    assert rel_err(plain, exact) < 2e-2
    for extra in ({"norm_weight": d(norm_w), "eps": 1e-5, "gated": True}, {"residual": d(residual[:, :n])}):
        weight = qw if extra.get("gated") else quantized(w[:n], kind)[0]
        assert rel_err(tg.gemv(d(x), weight, table, **extra), tg.gemv(d(x), weight, floats, **extra)) < 2e-2

    heads, kv_heads, dim = 1, 1, 8  # 24 rows of w
    qkv_w, _ = quantized(w[: (heads + 2 * kv_heads) * dim], kind)
    cos, sin = torch.ones(8, dim, device=DEVICE), torch.zeros(8, dim, device=DEVICE)  # no rotation
    zeros = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    outs = []
    for t in (table, floats):
        caches = [torch.zeros(4, kv_heads, dim, dtype=DTYPE, device=DEVICE) for _ in range(2)]
        q = tg.qkv_rope_store(d(x), qkv_w, None, d(norm_w), 1e-5, zeros, cos, sin, zeros, caches[0], caches[1],
                              heads, kv_heads, dim, t)
        outs.append(torch.cat((q.reshape(-1), caches[0][0].reshape(-1), caches[1][0].reshape(-1))))
    assert rel_err(outs[0], outs[1]) < 2e-2


def test_int8_with_k_off_whole_words_is_read_as_tiles() -> None:
    """K not a multiple of 4: int8 is read as [BLOCK_N, BLOCK_K] tiles (PER_CHANNEL), not as words."""
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(2, 90, generator=gen).to(DTYPE)
    qw, ref_w = quantized((torch.randn(12, 90, generator=gen) / 8).to(DTYPE), "int8")
    assert tg.kernel_weight(qw).quant == tg.PER_CHANNEL
    assert rel_err(tg.gemv(x.to(DEVICE), qw, GemvTable()), x.double() @ ref_w.T) < 1e-2


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantized_gemv_reads_its_rows_from_a_table(kind: str) -> None:
    """The first layer's projection, normed, with its rows from the embedding table."""
    gen = torch.Generator().manual_seed(7)
    table = torch.randn(50, 64, generator=gen).to(DTYPE).to(DEVICE)
    qw, _ = quantized((torch.randn(16, 64, generator=gen) / 8).to(DTYPE), kind)
    rows = torch.tensor([7, 0, 49], dtype=torch.int64, device=DEVICE)
    norm = (torch.rand(64, generator=gen) + 0.5).to(DTYPE).to(DEVICE)
    t = GemvTable()
    gathered = tg.gemv(table, qw, t, norm_weight=norm, x_rows=rows)
    assert torch.equal(gathered, tg.gemv(table[rows], qw, t, norm_weight=norm))


@pytest.mark.parametrize("kind", ["int8", "int4", "int8-gz", "int4-k"])
@pytest.mark.parametrize("table", [GemvTable(), GemvTable(k_slice=32, qkv_two_slices_from=64)], ids=["whole", "sliced"])
def test_quantized_qkv_projection_with_rope_and_cache_write(kind: str, table: GemvTable) -> None:
    """Against the same kernel on the dequantized weight: same q, same cache contents."""
    gen = torch.Generator().manual_seed(21)
    rows, heads, kv_heads, dim, hidden = 2, 2, 1, 16, 64
    x = torch.randn(rows, hidden, generator=gen).to(DTYPE)
    w = (torch.randn((heads + 2 * kv_heads) * dim, hidden, generator=gen) / 8).to(DTYPE)
    bias = torch.randn((heads + 2 * kv_heads) * dim, generator=gen).to(DTYPE)
    norm_w = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(DTYPE)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.outer(torch.arange(64).float(), inv).repeat(1, 2)
    cos, sin = emb.cos().to(DEVICE), emb.sin().to(DEVICE)
    positions = torch.tensor([5, 40], device=DEVICE)
    slots = torch.tensor([3, 17], device=DEVICE)
    d = lambda t: t.to(DEVICE)  # noqa: E731
    qw, ref_w = quantized(w, kind)

    caches = [torch.zeros(20, kv_heads, dim, dtype=DTYPE, device=DEVICE) for _ in range(4)]
    q = tg.qkv_rope_store(d(x), qw, d(bias), d(norm_w), 1e-5, positions, cos, sin, slots, caches[0], caches[1],
                          heads, kv_heads, dim, table)
    qkv = (rms_normed(x, norm_w, 1e-5) @ ref_w.T + bias.double()).to(DTYPE).to(DEVICE)
    q_ref = rope.rope_and_store(qkv, positions, cos, sin, slots, caches[2], caches[3], heads, kv_heads, dim)
    assert rel_err(q, q_ref.float()) < 1e-2
    for ours, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert rel_err(ours[slots], ref[slots].float()) < 1e-2


def test_bad_quantized_weights_are_refused_by_name() -> None:
    w = torch.randn(8, 64).to(DTYPE)
    qw, _ = quantized(w, "int4")
    with pytest.raises(ValueError, match="int4 weight: scale and zero"):
        tg.kernel_weight(QuantWeight("int4", qw.qweight, qw.scale[:, :1], qw.zero, GROUP))
    with pytest.raises(ValueError, match="int4 weight: expected uint8"):
        tg.kernel_weight(QuantWeight("int4", qw.qweight, qw.scale, None, GROUP))
    with pytest.raises(ValueError, match="int8 weight: expected qweight torch.int8"):
        tg.kernel_weight(QuantWeight("int8", qw.qweight, qw.scale))
    with pytest.raises(ValueError, match="not whole words of 8"):
        tg.kernel_weight(qw).check_slice(4)


def test_each_kind_has_its_table() -> None:
    config = KernelConfig()
    assert config.gemv_table(None) is config.gemv
    assert config.gemv_table("int4") is config.gemv_int4 and config.gemv_table("fp8") is config.gemv_fp8
    tuned = KernelConfig.from_mapping({"gemv_int4": {"features_per_program": 16}})
    assert tuned.gemv_int4.features_per_program == 16 and tuned.gemv_int4.k_slice == config.gemv_int4.k_slice
    with pytest.raises(ValueError, match="unknown engine.kernels.gemv_int8 key"):
        KernelConfig.from_mapping({"gemv_int8": {"slices": 2}})
    assert config.gemv_int4.int8_inputs and tuned.gemv_int4.int8_inputs and not config.gemv.int8_inputs
    assert not KernelConfig.from_mapping({"gemv_int4": {"int8_inputs": False}}).gemv_int4.int8_inputs
    with pytest.raises(ValueError, match="int8_inputs must be true or false"):
        KernelConfig.from_mapping({"gemv_int4": {"int8_inputs": "yes"}})
    # whole_k_features: one-row products without a norm that read all of K (o_proj), not the others
    wide = config.gemv_int4
    assert wide.whole_k_features == 16 and not wide.whole_k_max_outputs  # int4: any product
    assert (config.gemv.whole_k_features, config.gemv.whole_k_max_outputs) == (8, 2048)  # bf16: narrow ones
    assert tg.slicing(4096, 1, wide, min_k=8) == tg.GemvSlicing(16, 4096, wide.num_warps)
    assert tg.slicing(4096, 1, wide, norm=True, min_k=8).block_n == wide.features_per_program  # q/k/v, gate/up
    assert tg.slicing(14336, 1, wide, min_k=8).block_n == wide.features_per_program  # down: sliced
    assert tg.slicing(4096, 2, wide, min_k=8).block_n == wide.features_per_program  # two rows
    with pytest.raises(ValueError, match="whole_k_features must be 0 or a power of two"):
        KernelConfig.from_mapping({"gemv_int4": {"whole_k_features": 12}})


@pytest.mark.parametrize("kind", ["int8-g", "fp8-g", "int8-gz"])
def test_grouped_dequantized_by_the_kernel_as_by_the_loader(kind: str) -> None:
    gen = torch.Generator().manual_seed(6)
    qw, ref_w = quantized((torch.randn(40, 160, generator=gen) / 8).to(DTYPE), kind)  # a ragged last group
    assert rel_err(qm.dequantize_grouped(qw, DTYPE), ref_w) < 4e-3  # the rounding to DTYPE only


@pytest.mark.parametrize("kind", ["int4", "int4-k"])
def test_int4_dequantized_by_the_kernel_as_by_the_loader(kind: str) -> None:
    gen = torch.Generator().manual_seed(2)
    qw, ref_w = quantized((torch.randn(40, 384, generator=gen) / 8).to(DTYPE), kind)  # int4-k: 1.5 super-blocks
    assert rel_err(qm.dequantize_int4(qw, DTYPE), ref_w) < 4e-3  # the rounding to DTYPE only (bf16: 2^-9)


@pytest.mark.parametrize(("kind", "k", "group"), [("int4", 384, 128), ("int4", 576, 128), ("int4-k", 384, 32)])
def test_int4_requantized_to_int8_per_channel(kind: str, k: int, group: int) -> None:
    """requantize_int4 (int4 as W8A8 on the tensor cores, KernelConfig.int4_w8a8_rows): each row's step is its
    bound from the groups' scales and zeros over 127, which for round-to-nearest groups (each group's codes
    reach 0 and 15) is the row's largest magnitude over 127; every code the weight over the step rounded, a
    ragged last group (576) included."""
    gen = torch.Generator().manual_seed(k)
    w = (torch.randn(40, k, generator=gen) / 8).to(DTYPE)
    qw, ref_w = quantized(w, kind, group) if kind == "int4" else quantized(w, kind)
    r = qm.requantize_int4(qw)
    assert r.kind == "int8" and r.qweight.dtype == torch.int8 and tuple(r.qweight.shape) == (40, k)
    step = r.scale.double().cpu()
    largest = ref_w.abs().amax(dim=1) / 127
    assert bool((step >= largest * (1 - 1e-6)).all())  # a bound: no code clamps
    if kind == "int4":
        assert torch.allclose(step, largest, rtol=1e-5)
    codes = r.qweight.double().cpu()
    v = ref_w / step[:, None]
    near_tie = ((v.abs() - v.abs().floor()) - 0.5).abs() < 1e-4  # float32's v may round either way (ties: even)
    want = v.sign() * (v.abs() + 0.5).floor()
    assert bool(((codes - want).abs() <= near_tie.double()).all())
    assert rel_err(codes * step[:, None], ref_w) < 1e-2  # half a step of 1/127 of a row's largest


GEMMS = [  # W8A16: K = 96, a partial tile; W4A16: K = 256, two tiles of four groups of 32 (a scale a word)
    ("int8", qm.GemmConfig(16, 16, 64, 4, 2)), ("fp8", qm.GemmConfig(16, 16, 64, 4, 2)),
    ("int8-g", qm.GemmConfig(16, 16, 64, 4, 2)), ("fp8-g", qm.GemmConfig(16, 16, 64, 4, 2)),  # groups of 32
    ("int8-gz", qm.GemmConfig(16, 16, 64, 4, 2)),  # and zeros
    ("int4", qm.GemmConfig(16, 16, 128, 4, 2)),
    ("int4", qm.GemmConfig(16, 16, 128, 4, 2, split_k=3, permute_x=True)),  # the third split has no tile
    ("int4-k", qm.GemmConfig(16, 16, 128, 4, 2)),  # Q4_K's factors: one super-block of 256
    ("int4", qm.GemmConfig(16, 16, 128, 4, 2, weight_tiles=True)),  # the weight tiles: a scale a word
    ("int4", qm.GemmConfig(16, 16, 128, 4, 2, split_k=3, weight_tiles=True)),
    ("int4-k", qm.GemmConfig(16, 16, 128, 4, 2, weight_tiles=True)),
]


@pytest.mark.parametrize(("kind", "config"), GEMMS, ids=lambda c: c if isinstance(c, str)
                         else f"split{c.split_k}{'-tiles' if c.weight_tiles else ''}")
def test_triton_gemm_matches_the_dequantized_weight(kind: str, config: qm.GemmConfig) -> None:
    """The W4A16 / W8A16 GEMM (interpreted: tiny tiles), a partial tile in M and N, bias."""
    gen = torch.Generator().manual_seed(3)
    m, n, k = 20, 24, 96 if not kind.startswith("int4") else 256
    x = torch.randn(m, k, generator=gen).to(DTYPE)
    bias = torch.randn(n, generator=gen).to(DTYPE)
    qw, ref_w = quantized((torch.randn(n, k, generator=gen) / 8).to(DTYPE), kind)
    y = qm.triton_gemm(x.to(DEVICE), qw, bias.to(DEVICE), config)
    assert y.shape == (m, n) and y.dtype == DTYPE
    assert rel_err(y, x.double() @ ref_w.T + bias.double()) < 1e-2


@pytest.mark.parametrize("split_k", [1, 2])
def test_w4a16_weight_tiles_with_a_scale_a_row(split_k: int) -> None:
    """The weight tiles where a K tile lies within one group (groups of 128): one scale a row a tile."""
    gen = torch.Generator().manual_seed(9)
    m, n, k = 20, 24, 256
    x = torch.randn(m, k, generator=gen).to(DTYPE)
    bias = torch.randn(n, generator=gen).to(DTYPE)
    qw, ref_w = quantized((torch.randn(n, k, generator=gen) / 8).to(DTYPE), "int4", 128)
    y = qm.triton_gemm(x.to(DEVICE), qw, bias.to(DEVICE), qm.GemmConfig(16, 16, 128, 4, 2, split_k, weight_tiles=True))
    assert rel_err(y, x.double() @ ref_w.T + bias.double()) < 1e-2


@pytest.mark.parametrize("k", [576, 192])  # groups of 128: the last holds 64 (SmolLM2's hidden 576)
def test_int4_with_a_ragged_last_group(k: int) -> None:
    """K not a multiple of the group: the GEMV (all of K in one slice, masked past K; slices of 64
    across group boundaries; 3 rows), the W4A16 GEMM (128-wide tiles, the last one masked at K; whole
    and split in two) and the dequantize kernel, each against the dequantized weight (input k in
    group k // 128)."""
    gen = torch.Generator().manual_seed(k)
    n = 12
    qw, ref_w = quantized((torch.randn(n, k, generator=gen) / 8).to(DTYPE), "int4", 128)
    assert qw.scale.shape == (n, -(-k // 128))
    for rows, table in ((1, GemvTable()), (1, GemvTable.sliced(4, 64)), (3, GemvTable(k_slice=128))):
        x = torch.randn(rows, k, generator=gen).to(DTYPE)
        assert rel_err(tg.gemv(x.to(DEVICE), qw, table), x.double() @ ref_w.T) < 1e-2
    x = torch.randn(5, k, generator=gen).to(DTYPE)
    for split_k in (1, 2):  # permute_x falls back to x read strided: K is not whole tiles
        y = qm.triton_gemm(x.to(DEVICE), qw, None, qm.GemmConfig(16, 16, 128, 4, 2, split_k, permute_x=True))
        assert rel_err(y, x.double() @ ref_w.T) < 1e-2
    assert rel_err(qm.dequantize_int4(qw, DTYPE), ref_w) < 4e-3


# Triton 3.6's interpreter rounds float32 -> fp8 wrongly near a power of two (31.6 -> 16): fp8 on the GPU only
@pytest.mark.parametrize("dtype", [torch.int8, pytest.param(torch.float8_e4m3fn, marks=gpu_only)], ids=["int8", "fp8"])
def test_rows_quantized_per_token(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(4)
    x = (torch.randn(3, 40, generator=gen) * torch.tensor([[1.0], [30.0], [0.01]])).to(DTYPE)
    q, scale = qm.quantize_rows(x.to(DEVICE), dtype)
    qmax = 127.0 if dtype == torch.int8 else 448.0
    amax = x.float().abs().amax(dim=1)
    assert torch.allclose(scale.cpu(), amax / qmax, rtol=1e-6)
    assert torch.equal(q.float().abs().amax(dim=1).cpu(), torch.full((3,), qmax))
    back = q.float().cpu() * scale.cpu()[:, None]
    step = (amax / qmax)[:, None] if dtype == torch.int8 else x.float().abs() / 8  # e4m3: 3 mantissa bits
    assert bool(((back - x.float()).abs() <= step * 0.5 + 1e-6).all())


@pytest.mark.parametrize("dtype", [torch.int8, pytest.param(torch.float8_e4m3fn, marks=gpu_only)], ids=["int8", "fp8"])
def test_rows_quantized_by_a_static_scale(dtype: torch.dtype) -> None:
    """A checkpoint's static input scale: every row divided by it, values past the format's range clamped
    (the second row's), rounded as per token."""
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(3, 40, generator=gen) * torch.tensor([[1.0], [30.0], [0.01]])).to(DTYPE)
    qmax = 127.0 if dtype == torch.int8 else 448.0
    static = torch.tensor([4.0 / qmax])  # the first row's values fit, the second's largest do not
    q, scale = qm.quantize_rows(x.to(DEVICE), dtype, static.to(DEVICE))
    assert torch.equal(scale.cpu(), static.expand(3))
    v = (x.float() / static).clamp(-qmax, qmax)
    want = v.sign() * (v.abs() + 0.5).floor() if dtype == torch.int8 else v.to(dtype).float()
    assert torch.equal(q.float().cpu(), want)
    assert float(q.float().abs()[1].max()) == qmax


@gpu_only
@pytest.mark.parametrize("m", [1, 8, 17, 100, 300])
@pytest.mark.parametrize(("kind", "bound"), [("int4", 1e-2), ("int8", 2e-2), ("fp8", 5e-2), ("int8-g", 1e-2),
                                             ("fp8-g", 5e-2), ("int8-gz", 1e-2), ("int4-k", 1e-2)])
def test_quant_matmul_by_method(kind: str, bound: float, m: int) -> None:
    """Each method's paths (quant_matmul.py's table): the GEMV at 1 row, the Triton GEMM at 8, W8A8 or
    the W4A16 GEMM at 17, W8A8 or dequantize + cuBLAS at 300; the bounds are the module's."""
    gen = torch.Generator().manual_seed(m)
    n, k = 1024, 2048
    x = torch.randn(m, k, generator=gen).to(DTYPE)
    bias = torch.randn(n, generator=gen).to(DTYPE)
    qw, ref_w = quantized((torch.randn(n, k, generator=gen) / 8).to(DTYPE), kind, 128)
    y = qm.quant_matmul(x.to(DEVICE), qw, bias.to(DEVICE))
    assert y.shape == (m, n) and y.dtype == DTYPE
    assert rel_err(y, x.double() @ ref_w.T + bias.double()) < bound
    if kind in ("int8", "fp8"):  # K off _int_mm's / _scaled_mm's multiples of 8 / 16: the Triton GEMM (W8A16)
        qo, ref_o = quantized(ref_w[:, : k - 4].to(DTYPE), kind)
        xo = x[:, : k - 4]
        assert rel_err(qm.quant_matmul(xo.to(DEVICE), qo), xo.double() @ ref_o.T) < 1e-2


def test_int8_gemm_with_scales_in_its_epilogue() -> None:
    """w8a8_int8_gemm (int4's W8A8 in int8, on a weight of a scale a row; interpreted: tiny tiles): x rounded
    per row, a partial tile in M, N and K, bias; within the rounding of x."""
    gen = torch.Generator().manual_seed(12)
    m, n, k = 20, 24, 80
    qw, ref_w = quantized((torch.randn(n, k, generator=gen) / 8).to(DTYPE), "int8")
    x = torch.randn(m, k, generator=gen).to(DTYPE)
    bias = torch.randn(n, generator=gen).to(DTYPE)
    ref = x.double() @ ref_w.T + bias.double()
    out = qm.w8a8_int8_gemm(x.to(DEVICE), qw, bias.to(DEVICE), qm.GemmConfig(16, 16, 32, 4, 2))
    assert out.dtype == DTYPE and tuple(out.shape) == (m, n)
    assert rel_err(out, ref) < 1.5e-2  # x per row to int8, the output rounded to DTYPE
    assert rel_err(qm.w8a8_int8_gemm(x.to(DEVICE), qw, None, qm.GemmConfig(16, 16, 32, 4, 2)),
                   x.double() @ ref_w.T) < 1.5e-2


def test_int4_w8a8_rule_chooses_its_path() -> None:
    """quant_matmul under GemmRules.int4_w8a8_rows (int8; interpreted): from DEQUANTIZE_FROM rows 16-bit x takes
    the requantized weight's W8A8 GEMM, exactly; float32 x (precision asked for), the rule off, and fewer rows
    the W4A16 paths."""
    gen = torch.Generator().manual_seed(13)
    n, k = 32, 128
    qw, ref_w = quantized((torch.randn(n, k, generator=gen) / 8).to(DTYPE), "int4")
    rules = GemmRules(int4_w8a8_rows=1, int4_w8a8_format="int8")
    x = torch.randn(qm.DEQUANTIZE_FROM, k, generator=gen).to(DTYPE).to(DEVICE)
    on = qm.quant_matmul(x, qw, rules=rules)
    assert torch.equal(on, qm.w8a8_int8_gemm(x, qm.requantize_int4(qw)))
    assert rel_err(on, x.double().cpu() @ ref_w.T) < 2e-2
    off = qm.quant_matmul(x, qw)
    assert not torch.equal(on, off) and rel_err(off, x.double().cpu() @ ref_w.T) < 1e-2
    x32 = x.float()
    assert torch.equal(qm.quant_matmul(x32, qw, rules=rules), qm.quant_matmul(x32, qw))


@gpu_only
@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("kind", ["int4", "int4-k"])
def test_int4_products_as_w8a8(kind: str, fmt: str) -> None:
    """GemmRules.int4_w8a8_rows: from that many rows (and DEQUANTIZE_FROM) int4 runs as W8A8 in the format, its
    bound the module's; below it, and with the rule off, the usual paths. fp8: every requantized weight within
    half an e4m3 step of the weight over its row's step."""
    gen = torch.Generator().manual_seed(11)
    n, k = 1024, 2048
    qw, ref_w = quantized((torch.randn(n, k, generator=gen) / 8).to(DTYPE), kind, 128) if kind == "int4" else \
        quantized((torch.randn(n, k, generator=gen) / 8).to(DTYPE), kind)
    bias = torch.randn(n, generator=gen).to(DTYPE)
    if fmt == "fp8":
        r = qm.requantize_int4(qw, torch.float8_e4m3fn)
        step = r.scale.double().cpu()
        v = ref_w / step[:, None]
        assert bool((v.abs() <= 448 * (1 + 1e-6)).all())
        got = r.qweight.cpu().double()
        assert bool(((got - v).abs() <= v.abs() / 16 + 2.0 ** -10).all())  # half of e4m3's 2^-3, subnormals
    rules = GemmRules(int4_w8a8_rows=200, int4_w8a8_format=fmt)  # type: ignore[arg-type]
    for m in (150, 300):
        x = torch.randn(m, k, generator=gen).to(DTYPE)
        ref = x.double() @ ref_w.T + bias.double()
        on = qm.quant_matmul(x.to(DEVICE), qw, bias.to(DEVICE), rules=rules)
        off = qm.quant_matmul(x.to(DEVICE), qw, bias.to(DEVICE))
        bound = {"int8": 2e-2, "fp8": 5e-2}[fmt] if m >= 200 else 1e-2  # fp8 e4m3 x and weight: ~3.7% (emulated)
        assert rel_err(on, ref) < bound and rel_err(off, ref) < 1e-2
        assert torch.equal(on, off) == (m < 200)


@gpu_only
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("block_n", [32, 64])
@pytest.mark.parametrize("bf16x2", [True, False])
def test_w4a16_planes_dequantize_as_the_dequantize_kernel(group: int, block_n: int, bf16x2: bool) -> None:
    """The int4 planes (bf16x2: by inline PTX, else in float32) against (q - 8) * scale + zero rounded
    once to bf16 (at most one bf16 step apart where the float32 path's sum rounds first): the dequantize
    kernel's every weight, and the W4A16 GEMMs' (planes; weight tiles, their planes joined in input
    order) with one-hot rows of x (each output one weight), for every plane and scale group, a split K
    included; and an ordinary x within the module's bound."""
    gen = torch.Generator().manual_seed(group)
    n, k = 256, 1024
    qw, ref_w = quantized((torch.randn(n, k, generator=gen) / 8).to(DTYPE), "int4", group)
    deq = ref_w.to(DTYPE).float()
    got = qm.dequantize_int4(qw, DTYPE).float().cpu()
    assert torch.allclose(got, deq, rtol=2 ** -7, atol=0) and float((got != deq).float().mean()) < 1e-3
    cols = torch.randperm(k, generator=gen)
    for cfg in (qm.GemmConfig(16, block_n, 128, 4, 3, 1, False, bf16x2),
                qm.GemmConfig(64, block_n, 256, 4, 3, 2, True, bf16x2),
                qm.GemmConfig(64, block_n, 128, 4, 3, 2, bf16x2=bf16x2, weight_tiles=True)):
        for first in range(0, k, cfg.block_m):
            x = torch.zeros(cfg.block_m, k, dtype=DTYPE)
            x[torch.arange(cfg.block_m), cols[first:first + cfg.block_m]] = 1
            y = qm.triton_gemm(x.to(DEVICE), qw, None, cfg).float().cpu()
            want = deq[:, cols[first:first + cfg.block_m]].T
            assert torch.allclose(y, want, rtol=2 ** -7, atol=0), (cfg, first, float((y - want).abs().max()))
            assert float((y != want).float().mean()) < 1e-3
        x = torch.randn(20, k, generator=gen).to(DTYPE)
        assert rel_err(qm.triton_gemm(x.to(DEVICE), qw, None, cfg), x.double() @ ref_w.T) < 1e-2


LLAMA_8B = [  # (weight rows, K, gated, norm, residual): q/k/v, o, gate/up, down
    (6144, 4096, False, True, False), (4096, 4096, False, False, True), (2 * 14336, 4096, True, True, False),
    (4096, 14336, False, False, True),
]


@gpu_only
@pytest.mark.parametrize("kind", [*KINDS, "int4-k", "int4-a8", "int4-k-a8"])
def test_quantized_gemv_at_llama_8b_shapes(kind: str) -> None:
    """The default tables at the 8B shapes, batch 1 and 4, with PDL (a slicing that does not
    compile or mis-slices K fails here); -a8: int4 with the table's int8_inputs on."""
    config = KernelConfig()
    gen = torch.Generator().manual_seed(8)
    a8 = kind.endswith("-a8")
    kind = kind.removesuffix("-a8")
    for rows_w, k, gated, norm, residual in LLAMA_8B:
        qw, ref_w = quantized((torch.randn(rows_w, k, generator=gen) / 64).to(DTYPE), kind, 128)
        norm_w = (1 + 0.2 * torch.randn(k, generator=gen)).to(DTYPE)
        n = rows_w // 2 if gated else rows_w
        table = replace(config.gemv_table(qw.kind), int8_inputs=a8)
        for m in (1, 4):
            x = torch.randn(m, k, generator=gen).to(DTYPE)
            res = torch.randn(m, n, generator=gen).to(DTYPE)
            y = tg.gemv(x.to(DEVICE), qw, table, norm_weight=norm_w.to(DEVICE) if norm else None,
                        gated=gated, residual=res.to(DEVICE) if residual else None, pdl=True)
            ref = (rms_normed(x, norm_w, 1e-6) if norm else x.double()) @ ref_w.T
            if gated:
                ref = torch.nn.functional.silu(ref[:, :n]) * ref[:, n:]
            if residual:
                ref = ref + res.double()
            assert rel_err(y, ref) < (2e-2 if a8 and m == 1 else 1e-2), (kind, rows_w, k, m)


def test_w4a16_kernel_by_rows_and_shape() -> None:
    """The planes below TILES_FROM rows; from there the weight tiles where K is whole tiles of 128 (128
    x 128 and K whole for the wide gate/up past 64 rows, K split for a narrow projection) up to
    DEQUANTIZE_FROM (quant_matmul's dequantize + cuBLAS from there), the planes where K is ragged."""
    assert not qm.w4a16_config(qm.TILES_FROM - 1, 4096, 4096).weight_tiles
    wide = qm.w4a16_config(100, qm.WIDE_N, 4096)
    narrow = qm.w4a16_config(100, 4096, 14336)
    assert wide.weight_tiles and (wide.block_m, wide.block_n, wide.split_k) == (128, 128, 1)
    assert narrow.weight_tiles and narrow.block_m == 128 and narrow.split_k > 1
    assert qm.w4a16_config(64, 4096, 4096).block_m == 64
    assert not qm.w4a16_config(100, 4096, 576).weight_tiles  # K ragged (SmolLM2's 576)
    assert qm.w4a16_config(qm.DEQUANTIZE_FROM - 1, qm.WIDE_N, 4096).weight_tiles


def test_int8_with_zeros_in_groups_of_16() -> None:
    """The layout a GGUF layer fusing Q4_K and Q6_K parts takes (int8, a scale and a zero per 16 inputs):
    the GEMV (whole K, and slices of 16 and 64), the W8A16 GEMM and the dequantize kernel."""
    gen = torch.Generator().manual_seed(16)
    n, k = 20, 128
    qw, ref_w = quantized((torch.randn(n, k, generator=gen) / 8).to(DTYPE), "int8-gz", 16)
    assert qw.scale.shape == qw.zero.shape == (n, k // 16)  # type: ignore[union-attr]
    for rows, table in ((1, GemvTable()), (3, GemvTable(features_per_program=8, whole_k_with_norm=16,
                                                        whole_k_without_norm=16, k_slice=16)),
                        (1, GemvTable.sliced(4, 64))):
        x = torch.randn(rows, k, generator=gen).to(DTYPE)
        assert rel_err(tg.gemv(x.to(DEVICE), qw, table), x.double() @ ref_w.T) < 1e-2
    x = torch.randn(17, k, generator=gen).to(DTYPE)
    y = qm.triton_gemm(x.to(DEVICE), qw, None, qm.GemmConfig(16, 16, 64, 4, 2))
    assert rel_err(y, x.double() @ ref_w.T) < 1e-2
    assert rel_err(qm.dequantize_grouped(qw, DTYPE), ref_w) < 4e-3
