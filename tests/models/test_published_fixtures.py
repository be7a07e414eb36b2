"""Checkpoints written by the real tools (tests/data/quantized, scripts/make_quantized_fixtures.py: GPTQModel,
llm-compressor / compressed-tensors, transformers' FP8, AutoAWQ's layout) served by Ferrum in float32 on
the CPU: each quantized layer's weight equals the tool's own dequantization (layer 0's, kept in the
fixture's reference.safetensors), and the model's logits equal transformers' on those dequantized
weights (`logits_dequantized`), to float32 rounding: the repack is exact."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import pytest
import torch
from safetensors.torch import load_file

from ferrum.engine.block_manager import BlockManager
from ferrum.engine.sampling_params import SamplingParams
from ferrum.engine.scheduler import ScheduledSequence
from ferrum.engine.sequence import Sequence
from ferrum.models.config import load_model_config
from ferrum.models.layers import layer_ops
from ferrum.models.layers.quantized_linear import QuantizedLinear
from ferrum.models.llama import LlamaForCausalLM
from ferrum.models.loader import load_model
from ferrum.weights.loader import WeightLoader
from ferrum.weights.locations.model_files import local_weights
from tests.engines import host_device, make_runner

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "quantized"
NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "reference.safetensors").is_file() and p.name != "base")
# fixture -> how its layers are served (schemes' descriptions; per channel: one group of K, rounded up
# to a power of two: 64 inputs, 128 for down_proj)
SERVED: dict[str, set[str] | str] = {
    "awq-w4-g32-gemm": "int4 (group 32, asymmetric, float32 scales)",
    "ct-fp8-dynamic": "fp8",
    "ct-fp8-static-kv": "fp8 (static input scale)",
    "ct-w4a16-channel": {"int4 (group 64, symmetric, bfloat16 scales)", "int4 (group 128, symmetric, bfloat16 scales)"},
    "ct-w4a16-g32": "int4 (group 32, symmetric, bfloat16 scales)",
    "ct-w4a16-g32-asym-ignore": "int4 (group 32, asymmetric, float32 scales)",
    "ct-w8a8-int8": "int8",
    "fp8-block32": "fp8 (group 32)",
    "fp8-tensor-static": "fp8 (static input scale)",
    "gptq-w4-channel": {"int4 (group 64, symmetric, float16 scales)", "int4 (group 128, symmetric, float16 scales)"},
    "gptq-w4-g32-asym-descact": "int4 (group 32, asymmetric, float32 scales)",
    "gptq-w4-g32-asym-v2": "int4 (group 32, asymmetric, float32 scales)",
    "gptq-w4-g32-sym": "int4 (group 32, symmetric, float16 scales)",
    "gptq-w8-g32": "int8 (group 32)",
}


def _model(folder: Path) -> LlamaForCausalLM:
    device = host_device()
    model, _ = load_model(load_model_config(folder), local_weights(folder), device, torch.float32,
                          layer_ops(device), WeightLoader())
    return model


def _layer0(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Layer 0's weights as served, under the checkpoint's names (fused projections split)."""
    layer = model.layers[0]
    out: dict[str, torch.Tensor] = {}
    for fused, parts in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")),
                         ("mlp.gate_up_proj", ("gate_proj", "up_proj")), ("self_attn.o_proj", ("o_proj",)),
                         ("mlp.down_proj", ("down_proj",))):
        module = layer.get_submodule(fused)
        weight = module.dequantized() if isinstance(module, QuantizedLinear) else cast(torch.Tensor, module.weight)
        rows = model.shard_rows(fused.split(".")[-1], weight.shape[0]) if len(parts) > 1 else [0, weight.shape[0]]
        prefix = f"model.layers.0.{fused.rsplit('.', 1)[0]}"
        for i, part in enumerate(parts):
            out[f"{prefix}.{part}.weight"] = weight[rows[i]:rows[i + 1]].float()
    return out


def _last_logits(model: LlamaForCausalLM, ids: list[int], lengths: tuple[int, ...]) -> torch.Tensor:
    """The logits at the last position of each prefix of `ids` of the given lengths."""
    runner = make_runner(model, host_device(), 32, 8, enforce_eager=True)
    blocks = BlockManager(num_blocks=32, block_size=8)
    seqs = [Sequence(f"p{n}", ids[:n], SamplingParams(max_tokens=1), 0.0) for n in lengths]
    for seq in seqs:
        blocks.grow(seq, seq.num_tokens)
    logits, _ = runner.execute([ScheduledSequence(s, s.num_tokens) for s in seqs])
    return logits.float()


@pytest.mark.parametrize("name", NAMES)
def test_tool_written_checkpoint_equals_the_tools_dequantization(name: str) -> None:
    folder = FIXTURES / name
    ref = load_file(folder / "reference.safetensors")
    model = _model(folder)
    schemes = {layer.scheme.describe() for layer in model.quantized_layers().values()}
    described = SERVED[name]
    assert schemes == (described if isinstance(described, set) else {described}), schemes
    served = _layer0(model)
    for weight, expected in ref.items():
        if weight.endswith(".weight"):  # the repack is exact (int4's zero: to float32 rounding)
            bound = 1e-6 * expected.abs().max().item()
            assert (served[weight] - expected).abs().max().item() <= bound, f"{name} {weight}"
    ids = ref["input_ids"][0].tolist()
    lengths = (5, 11, len(ids))
    got = _last_logits(model, ids, lengths)
    want = ref["logits_dequantized"][0, [n - 1 for n in lengths]]
    assert (got - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item()), name


def test_kv_cache_scales_are_kept() -> None:
    """compressed-tensors' kv_cache_scheme: each attention layer holds the checkpoint's k_scale / v_scale."""
    folder = FIXTURES / "ct-fp8-static-kv"
    model = _model(folder)
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for i, layer in enumerate(model.layers):
            attention = layer.get_submodule("self_attn")
            for name in ("k_scale", "v_scale"):
                stored = f.get_tensor(f"model.layers.{i}.self_attn.{name}").float()
                kept = getattr(attention, name)
                assert kept is not None and torch.equal(kept.detach().float(), stored.reshape(1)), (i, name)
    assert _model(FIXTURES / "ct-fp8-dynamic").layers[0].get_submodule("self_attn").k_scale is None


@pytest.mark.parametrize("name", ["ct-fp8-static-kv", "fp8-tensor-static"])
def test_static_input_scales_are_kept(name: str) -> None:
    """llm-compressor's static FP8 activations (and AutoFP8's layout): each quantized layer's activations
    take the largest input_scale of the checkpoint tensors it fuses, as the GEMMs that quantize them read it."""
    folder = FIXTURES / name
    model = _model(folder)
    stored = load_file(folder / "model.safetensors")
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    layers = model.quantized_layers()
    assert layers
    for path, layer in layers.items():
        block, projection = path.rsplit(".", 1)
        scales = [stored[f"model.{block}.{part}.input_scale"].float().reshape(1)
                  for part in fused.get(projection, (projection,))]
        assert torch.equal(cast(torch.Tensor, layer.activation_scale()), torch.cat(scales).amax().reshape(1)), path
