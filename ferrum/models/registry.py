"""Which HF architectures Ferrum runs, and the model class for each."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ferrum.models.errors import ModelConfigError

# Every entry is a Llama-family decoder; the differences are flags in ModelConfig
# (q/k/v bias for Qwen2, per-head q/k norm for Qwen3, a mixture of experts' MLPs: ModelConfig.moe).
SUPPORTED_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "Qwen2MoeForCausalLM",
    "MixtralForCausalLM",
)

_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


class UnsupportedArchitectureError(ModelConfigError):
    """config.json names an architecture Ferrum does not run."""


def resolve_architecture(raw_config: dict[str, Any], path: Path) -> str:
    names = list(raw_config.get("architectures") or [])
    if not names and raw_config.get("model_type") in _MODEL_TYPES:
        names = [_MODEL_TYPES[raw_config["model_type"]]]
    for name in names:
        if name in SUPPORTED_ARCHITECTURES:
            return name
    found = ", ".join(names) or f"model_type={raw_config.get('model_type')!r}"
    raise UnsupportedArchitectureError(
        f"{path}: architecture {found} is not supported; "
        f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )
