"""The committed quantized-checkpoint fixtures (tests/data/quantized/, written by
scripts/make_quantized_fixtures.py with the real tools): every folder has its checkpoint files and a reference whose
shapes match its config. No tool is imported: what the tensors hold is checked by the loaders' own tests."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "quantized"
LINEARS = (
    "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
    "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj",
)
# fixture -> (quant_method in config.json, layer-0 linears the tool left unquantized, has the tool's own logits)
EXPECTED: dict[str, tuple[str, frozenset[str], bool]] = {
    "gptq-w4-g32-sym": ("gptq", frozenset(), True),
    "gptq-w4-g32-asym-descact": ("gptq", frozenset(), True),
    "gptq-w4-channel": ("gptq", frozenset(), True),
    "gptq-w8-g32": ("gptq", frozenset(), True),
    "gptq-w4-g32-asym-v2": ("gptq", frozenset(), True),
    "awq-w4-g32-gemm": ("awq", frozenset(), True),
    "fp8-block32": ("fp8", frozenset(), True),
    "fp8-tensor-static": ("fp8", frozenset(), False),
    "ct-w4a16-g32": ("compressed-tensors", frozenset(), True),
    "ct-w4a16-g32-asym-ignore": ("compressed-tensors", frozenset({"mlp.down_proj"}), True),
    "ct-w4a16-channel": ("compressed-tensors", frozenset(), True),
    "ct-w8a8-int8": ("compressed-tensors", frozenset(), True),
    "ct-fp8-dynamic": ("compressed-tensors", frozenset(), True),
    "ct-fp8-static-kv": ("compressed-tensors", frozenset(), True),
}


def _config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def _weight_shapes(config: dict) -> dict[str, tuple[int, int]]:
    """[out, in] of each linear, from the model's config."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    return {
        "self_attn.q_proj": (q, hidden), "self_attn.k_proj": (kv, hidden), "self_attn.v_proj": (kv, hidden),
        "self_attn.o_proj": (hidden, q), "mlp.gate_proj": (inter, hidden), "mlp.up_proj": (inter, hidden),
        "mlp.down_proj": (hidden, inter),
    }


def test_every_fixture_folder_is_listed() -> None:
    folders = {p.name for p in FIXTURES.iterdir() if p.is_dir()}
    assert folders == set(EXPECTED) | {"base"}
    assert (FIXTURES / "README.md").is_file()


def test_base_reference_matches_its_config() -> None:
    config = _config(FIXTURES / "base")
    assert "quantization_config" not in config
    reference = load_file(str(FIXTURES / "base" / "reference.safetensors"))
    tokens = reference["input_ids"].shape[1]
    assert reference["logits"].shape == (1, tokens, config["vocab_size"])


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_files_and_reference_shapes(name: str) -> None:
    folder = FIXTURES / name
    method, unquantized, has_logits = EXPECTED[name]
    config = _config(folder)
    assert config["quantization_config"]["quant_method"] == method
    if method == "gptq":  # gptqmodel writes both
        assert json.loads((folder / "quantize_config.json").read_text())["quant_method"] == "gptq"
    assert (folder / "model.safetensors").stat().st_size > 0

    reference = load_file(str(folder / "reference.safetensors"))
    input_ids = reference["input_ids"]
    assert input_ids.dtype == torch.int64 and input_ids.shape[0] == 1
    logits_shape = (1, input_ids.shape[1], config["vocab_size"])
    logits = ["logits_dequantized", "logits"] if has_logits else ["logits_dequantized"]
    assert "logits" in reference if has_logits else "logits" not in reference
    for key in logits:
        assert reference[key].dtype == torch.float32 and reference[key].shape == logits_shape, key
        assert torch.isfinite(reference[key]).all(), key

    shapes = _weight_shapes(config)
    weights = {k for k in reference if k.endswith(".weight")}
    assert weights == {f"model.layers.0.{linear}.weight" for linear in LINEARS if linear not in unquantized}
    for linear in LINEARS:
        key = f"model.layers.0.{linear}.weight"
        if key in weights:
            assert reference[key].dtype == torch.float32 and reference[key].shape == shapes[linear], key
            assert torch.isfinite(reference[key]).all(), key
