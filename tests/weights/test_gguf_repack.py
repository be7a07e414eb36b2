"""GGUF's 4-bit block types repacked into the seam's int4, Q8_0 / Q5_0 / Q6_K into int8 with group scales,
Q5_1 / Q5_K into int8 with group scales and zeros (ferrum.weights.quantization.published.gguf): the
repacked weight, dequantized, equals gguf-py's own dequantization of the blocks (ggml's reference in
Python), exactly for the symmetric types, and to float32 rounding of the zero for the others; llama's
attn_q rows put back in HF order; a layer holding Q5_K or Q4_K (its own 6-bit sub-scales) multiplies as the
dequantized weight does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

from ferrum.weights.gguf_names import hf_row_order  # noqa: E402
from ferrum.weights.quantization.arith import dequantize  # noqa: E402
from ferrum.weights.quantization.published.gguf import BLOCKS, GgufFormat  # noqa: E402

N, K = 48, 512
CONFIG = {"num_attention_heads": 4, "num_key_value_heads": 2}


def _blocks(kind: str, rng: np.random.Generator) -> np.ndarray:
    """Rows [N, bytes] of `kind`: gguf-py's quantizer where it has one, else random codes with sane scales."""
    if kind in ("Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1"):
        return quants.quantize(rng.standard_normal((N, K)).astype(np.float32), gguf.GGMLQuantizationType[kind])
    per, size = BLOCKS[kind]
    raw = rng.integers(0, 256, (N * K // per, size), dtype=np.uint8)
    for start in (0, 2) if kind in ("Q4_K", "Q5_K") else (size - 2,):  # Q4_K's / Q5_K's d, dmin; Q6_K's d
        raw[:, start:start + 2] = (rng.random(len(raw)) * 0.01 + 0.001).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(N, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_0", "Q6_K", "Q5_1", "Q5_K"])
@pytest.mark.parametrize("module", ["model.layers.0.mlp.up_proj", "model.layers.0.self_attn.q_proj"])
def test_repack_equals_ggml_dequantization(kind: str, module: str) -> None:
    rng = np.random.default_rng(3)
    rows = _blocks(kind, rng)
    fmt = GgufFormat({"architecture": "llama", "tensor_types": {f"{module}.weight": kind}}, CONFIG)
    scheme = fmt.scheme(module, K)
    int8 = kind in ("Q8_0", "Q5_0", "Q6_K", "Q5_1", "Q5_K")
    assert scheme is not None and scheme.group_size == (16 if kind == "Q6_K" else 32) and scheme.grouped
    assert scheme.method == ("int8" if int8 else "int4") and (int8 or scheme.symmetric == (kind == "Q4_0"))
    assert scheme.offsets == (kind in ("Q5_1", "Q5_K"))
    assert scheme.sub_scales == (kind == "Q4_K")  # served in its own factors: 4.6 bits a weight
    assert fmt.check(module, N, K, {"blocks": ((N, rows.shape[1]), torch.uint8)}) == []
    repacked = fmt.repack(module, N, K, {"blocks": torch.from_numpy(rows)}, torch.bfloat16).weight
    ref = torch.from_numpy(quants.dequantize(rows, gguf.GGMLQuantizationType[kind]))
    order = hf_row_order(fmt.stored_name(f"{module}.weight"), N, architecture="llama", num_heads=4, num_kv_heads=2)
    assert (order is not None) == module.endswith("q_proj")
    if order is not None:
        ref = ref[order]
    got = dequantize(repacked, torch.float32)
    if kind in ("Q4_K", "Q5_1", "Q5_K"):  # zero = offset + 8 (16) * scale rounded to float32 where they lie far apart
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6 * ref.abs().max().item())
    else:
        assert torch.equal(got, ref)


def test_blocks_of_the_wrong_size_are_named() -> None:
    module = "model.layers.0.mlp.up_proj"
    fmt = GgufFormat({"architecture": "llama", "tensor_types": {f"{module}.weight": "Q4_K"}}, CONFIG)
    problems = fmt.check(module, N, K, {"blocks": ((N, 100), torch.uint8)})
    assert problems == ["tensor 'blk.0.ffn_up.weight' has shape (48, 100), expected (48, 288)"]
    assert fmt.check(module, N, 500, {}) == [f"{module}: 500 inputs do not fill Q4_K blocks of 256"]


def test_a_file_with_types_ferrum_does_not_run_is_refused_by_name() -> None:
    """Q3_K / IQ4_XS tensors stop start-up naming the file, a tensor, the types and what would run it
    (not served dequantized at 4-8x the memory)."""
    from ferrum.weights.quantization.published.detect import checkpoint_format
    from ferrum.weights.quantization.scheme import QuantizationConfigError

    types = {"model.layers.0.mlp.down_proj.weight": "Q3_K", "model.layers.1.mlp.up_proj.weight": "IQ4_XS",
             "model.layers.1.mlp.down_proj.weight": "Q3_K", "model.layers.0.mlp.up_proj.weight": "Q4_K",
             "model.norm.weight": "F32"}
    with pytest.raises(QuantizationConfigError) as err:
        checkpoint_format({"quant_method": "gguf", "architecture": "llama", "tensor_types": types}, CONFIG,
                          "/models/smol-Q3_K_M.gguf")
    message = str(err.value)
    assert message.startswith("/models/smol-Q3_K_M.gguf: GGUF tensor 'blk.0.ffn_down.weight' "
                              "(model.layers.0.mlp.down_proj.weight) is Q3_K, and 2 more tensors of IQ4_XS, Q3_K")
    assert "Ferrum runs GGUF tensors of F32, F16, BF16, Q4_0, Q4_1, Q4_K" in message and "llama-quantize" in message
    GgufFormat({"architecture": "llama", "tensor_types": {k: v for k, v in types.items() if v in ("Q4_K", "F32")}},
               CONFIG)  # the listed types load


@pytest.mark.parametrize("kind", ["Q5_K", "Q4_K"])
@pytest.mark.parametrize("kernels", ["cpu_kernels", "dequantize", "kernels"])
def test_a_layer_with_zeros_per_group_multiplies_as_its_dequantized_weight(kernels: str, kind: str) -> None:
    """Q5_K (int8 with zeros) and Q4_K (int4 with its own sub-scales) in a QuantizedLinear: the product with
    each group's zero (the CPU kernels, repacked; the GPU's GEMV, W4A16 / W8A16 GEMM and dequantize kernel,
    interpreted without a GPU) or the weight dequantized with its zeros, against x @ gguf-py's
    dequantization."""
    from pathlib import Path

    from ferrum.kernels.cpu.build import compiler, load_cpu_kernels
    from ferrum.models.layers.quantized_linear import CpuKernelsMethod, QuantizedLinear

    if kernels == "kernels":
        from tests.triton_interpreter import use_interpreter

        use_interpreter()  # compiled on a GPU, interpreted elsewhere
    if kernels == "cpu_kernels":
        if compiler() is None:
            pytest.skip("the CPU kernels need a C++ compiler")
        load_cpu_kernels(Path("~/.cache/ferrum/kernels").expanduser())
    module = "model.layers.0.mlp.up_proj"
    rows = _blocks(kind, np.random.default_rng(5))
    fmt = GgufFormat({"architecture": "llama", "tensor_types": {f"{module}.weight": kind}}, CONFIG)
    weight = fmt.repack(module, N, K, {"blocks": torch.from_numpy(rows)}, torch.float32).weight
    device = "cuda" if kernels == "kernels" and torch.cuda.is_available() else "cpu"
    # (Triton's interpreter takes bf16 dot operands as their bits: float16 there)
    dtype = (torch.bfloat16 if device == "cuda" else torch.float16) if kernels == "kernels" else torch.float32
    layer = QuantizedLinear(K, N, False, weight.scheme, kernels, dtype).to(device)  # type: ignore[arg-type]
    for name, part in layer.storage().parts.items():
        part.copy_(weight.parts[name])
    layer.prepare()
    assert isinstance(layer.method, CpuKernelsMethod) == (kernels == "cpu_kernels")
    assert weight.scheme.sub_scales == (kind == "Q4_K")
    ref_w = torch.from_numpy(quants.dequantize(rows, gguf.GGMLQuantizationType[kind]))
    if kernels != "kernels":  # (in 16 bits the dequantized weight is rounded)
        torch.testing.assert_close(layer.dequantized(), ref_w, rtol=0, atol=1e-6 * ref_w.abs().max().item())
    # the CPU kernels quantize x to int8 in blocks of 32 (two parts): ~1e-4 of the output's scale; the GPU's
    # W8A16 GEMM and dequantize + cuBLAS round the dequantized weight and the output to 16 bits: ~3e-3
    bound = {"cpu_kernels": 1e-3, "dequantize": 1e-5, "kernels": 1e-2}[kernels]
    for t in (1, 5, 40, 130):  # a decode row, a batch, a prefill (dense paths from 32 rows; int4's from 128)
        x = torch.randn(t, K, generator=torch.Generator().manual_seed(t)).to(dtype)
        ref = x.float() @ ref_w.T
        got = layer(x.to(device)).float().cpu()
        assert ((got - ref).norm() / ref.norm()).item() < bound, t


def test_zeros_per_group_are_for_int8_with_group_scales_only() -> None:
    from ferrum.weights.quantization.scheme import QuantizationConfigError, QuantScheme

    with pytest.raises(QuantizationConfigError, match="int8 with a scale per group only"):
        QuantScheme("int8", 32, offsets=True)  # a scale per row
    with pytest.raises(QuantizationConfigError, match="int8 with a scale per group only"):
        QuantScheme("fp8", 32, per_group=True, offsets=True)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("others", [("Q6_K",), ("Q5_K",), ("Q4_0",)], ids=["with-q6k", "with-q5k", "with-q4_0"])
def test_a_fused_layer_of_mixed_types_takes_a_common_int8_scheme_exactly(kind: str, others: tuple[str, ...]) -> None:
    """llama.cpp's mixes (Q4_K_M: attn_v in Q6_K beside Q4_K q and k) fuse into int8 with a float32 scale per
    group of the smaller group and a zero where a part has one: each part's widened weight dequantizes to
    exactly what its own repack does."""
    from ferrum.weights.quantization.published.base import widen

    module = "model.layers.0.mlp.up_proj"
    types = [kind, *others]
    schemes = [GgufFormat({"architecture": "llama", "tensor_types": {f"{module}.weight": t}}, CONFIG).scheme(module, K)
               for t in types]
    fmt = GgufFormat({"architecture": "llama", "tensor_types": {f"{module}.weight": kind}}, CONFIG)
    common = fmt.common_scheme(schemes)
    assert common is not None and common.method == "int8" and common.per_group
    assert common.group_size == (16 if "Q6_K" in types else 32)
    assert common.offsets == any(t in ("Q4_1", "Q4_K", "Q5_K") for t in types)
    rows = torch.from_numpy(_blocks(kind, np.random.default_rng(5)))
    own = fmt.repack(module, N, K, {"blocks": rows}, torch.float32).weight
    wide = widen(own, common)
    assert wide.scheme == common and not wide.layout_problems()
    assert torch.equal(dequantize(wide, torch.float64), dequantize(own, torch.float64))


def test_widen_refuses_what_it_cannot_hold_exactly() -> None:
    from ferrum.weights.quantization.published.base import RepackError, widen
    from ferrum.weights.quantization.scheme import QuantScheme

    module = "model.layers.0.mlp.up_proj"
    fmt = GgufFormat({"architecture": "llama", "tensor_types": {f"{module}.weight": "Q4_K"}}, CONFIG)
    own = fmt.repack(module, N, K, {"blocks": torch.from_numpy(_blocks("Q4_K", np.random.default_rng(6)))},
                     torch.float32).weight
    with pytest.raises(RepackError, match="cannot be held exactly"):
        widen(own, QuantScheme("int8", 16, per_group=True))  # its zeros have nowhere to go
    with pytest.raises(RepackError, match="cannot be held exactly"):
        widen(own, QuantScheme("int8", 64, per_group=True, offsets=True))  # a group wider than its own
    assert fmt.common_scheme([fmt.scheme(module, K), None]) is None  # a float part: the layer goes dense


def test_a_rank_whose_share_splits_a_q4_k_super_block_takes_float32_factors() -> None:
    """Tensor parallelism: a row-parallel Q4_K layer whose rank's share of the inputs is not whole super-blocks
    of 256 (Qwen2.5-7B's o_proj, 3584 inputs, at TP 4: 896) is served in int4 groups of 32 with float32 scales
    and zeros, the same weight exactly; a share of whole super-blocks keeps Q4_K's own factors."""
    from ferrum.models.layers.linear import LinearFactory
    from ferrum.models.layers.parallel import TensorParallel
    from ferrum.models.layers.quantized_linear import QuantizedLinear
    from ferrum.weights.quantization.published.base import PublishedLayers, widen

    module = "model.layers.0.mlp.down_proj"
    fmt = GgufFormat({"architecture": "llama", "tensor_types": {f"{module}.weight": "Q4_K"}}, CONFIG)
    factory = LinearFactory(published=PublishedLayers(fmt, lambda path: [path]))
    split = factory.row_parallel(module, 384, N, False, TensorParallel(rank=0, size=2))  # 1.5 super-blocks a rank
    whole = factory.row_parallel(module, 512, N, False, TensorParallel(rank=1, size=2))
    own = fmt.scheme(module, K)
    assert own is not None and own.sub_scales
    assert isinstance(whole, QuantizedLinear) and isinstance(split, QuantizedLinear)
    assert whole.scheme == own
    assert split.scheme == own.expanded() and not own.expanded().sub_scales
    weight = fmt.repack(module, N, K, {"blocks": torch.from_numpy(_blocks("Q4_K", np.random.default_rng(7)))},
                        torch.float32).weight
    wide = widen(weight, own.expanded())
    assert not wide.layout_problems() and torch.equal(wide.parts["qweight"], weight.parts["qweight"])
    assert torch.equal(dequantize(wide, torch.float64), dequantize(weight, torch.float64))
