"""The one builder of tiny random-weight model folders for the tests (transformers is test-only; a model
without the demo tokenizer takes ferrum.tokenizer.synthetic's).

    FAMILIES / tiny_config(family)    a small config of each supported dense family (7 variants)
    MOE_FAMILIES                      the mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral), same shapes
    save_hf_model(folder, config)     an HF model of that config with spread-out random weights,
                                      saved as a model folder; the model is returned too (the reference)
    make_tiny_llama(folder)           a bf16 Llama with the demo model's tokenizer (vocab 49152), which
                                      Ferrum serves like any model folder
    folder_files(folder)              every file's bytes, for comparing copies
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "SmolLM2-135M-Instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
DEMO_VOCAB = 49152

COMMON: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    max_position_embeddings=256,
    rms_norm_eps=1e-5,
)


def _transformers() -> Any:
    return pytest.importorskip("transformers")


def _families() -> dict[str, Callable[..., Any]]:
    t = _transformers()
    return {
        "llama2-mha": lambda **o: t.LlamaConfig(**{**COMMON, **o}, num_key_value_heads=4, rope_theta=10000.0),
        "llama3.2-gqa-tied-rope-scaling": lambda **o: t.LlamaConfig(
            **{**COMMON, **o},
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "llama-linear-rope": lambda **o: t.LlamaConfig(
            **{**COMMON, **o}, num_key_value_heads=2, rope_scaling={"rope_type": "linear", "factor": 2.0}
        ),
        "mistral": lambda **o: t.MistralConfig(**{**COMMON, "sliding_window": None, **o}, num_key_value_heads=1),
        "qwen2-qkv-bias": lambda **o: t.Qwen2Config(**{**COMMON, **o}, num_key_value_heads=2, tie_word_embeddings=True),
        "qwen3-qk-norm": lambda **o: t.Qwen3Config(**{**COMMON, **o}, num_key_value_heads=2, head_dim=32),
        "smollm2-like": lambda **o: t.LlamaConfig(
            **{**COMMON, "num_attention_heads": 6, "hidden_size": 96, **o},
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_theta=100000.0,
        ),
    }


FAMILIES: tuple[str, ...] = (
    "llama2-mha",
    "llama3.2-gqa-tied-rope-scaling",
    "llama-linear-rope",
    "mistral",
    "qwen2-qkv-bias",
    "qwen3-qk-norm",
    "smollm2-like",
)


def _moe_families() -> dict[str, Callable[..., Any]]:
    t = _transformers()
    return {
        # 8 experts, top 2 renormalised, q/k norms; layer 1 a dense MLP (mlp_only_layers)
        "qwen3-moe": lambda **o: t.Qwen3MoeConfig(
            **{**COMMON, "intermediate_size": 96, **o}, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
            moe_intermediate_size=32, head_dim=16, mlp_only_layers=[1], norm_topk_prob=True),
        # routed experts (weights not renormalised) plus a gated shared expert, q/k/v bias
        "qwen2-moe": lambda **o: t.Qwen2MoeConfig(
            **{**COMMON, **o}, num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48),
        "mixtral": lambda **o: t.MixtralConfig(
            **{**COMMON, "intermediate_size": 48, **o}, num_key_value_heads=2, num_local_experts=4,
            num_experts_per_tok=2),
    }


MOE_FAMILIES: tuple[str, ...] = ("qwen3-moe", "qwen2-moe", "mixtral")


def tiny_config(family: str, **overrides: Any) -> Any:
    """A transformers config of `family` (one of FAMILIES or MOE_FAMILIES) with the tiny shapes, `overrides`
    applied."""
    families = _moe_families() if family in MOE_FAMILIES else _families()
    return families[family](**overrides)


def save_hf_model(
    folder: Path,
    config: Any,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    spread: float = 0.08,
    max_shard_size: str | None = None,
    demo_tokenizer: bool = False,
) -> Any:
    """An HF model of `config` with normal(0, spread) weights (errors then show, not hidden by tiny
    activations), saved into `folder` (sharded when `max_shard_size` is given, with the demo model's
    tokenizer files when asked: its vocabulary is 49152); returns the model, in float32, for reference."""
    t = _transformers()
    torch.manual_seed(seed)
    name = type(config).__name__.replace("Config", "ForCausalLM")
    model = getattr(t, name)(config).eval().float()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, spread)
    folder.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.to(dtype).save_pretrained(folder, **kwargs)
    if demo_tokenizer:
        for file in TOKENIZER_FILES:
            shutil.copyfile(DEMO / file, folder / file)
    return model.float()


def make_tiny_llama(folder: Path, seed: int = 0, max_shard_size: str | None = None) -> Path:
    """A bf16 Llama (2 layers, GQA, tied embeddings) with the demo tokenizer, written into `folder`:
    config.json, generation_config.json, safetensors weights (sharded when `max_shard_size` is given)
    and the tokenizer files."""
    t = _transformers()
    config = t.LlamaConfig(
        vocab_size=DEMO_VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = t.LlamaForCausalLM(config).to(torch.bfloat16)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    for name in TOKENIZER_FILES:
        shutil.copyfile(DEMO / name, folder / name)
    return folder


def folder_files(folder: Path) -> dict[str, bytes]:
    """Relative name -> content of every file in `folder` (follows symlinks)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
