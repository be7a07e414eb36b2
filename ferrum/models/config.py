"""The model's shape and numerics, read from an HF `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ferrum.dtypes import serving_dtype
from ferrum.models.errors import ModelConfigError
from ferrum.models.registry import resolve_architecture
from ferrum.weights.locations.model_files import local_model_folder
from ferrum.weights.quantization.published.base import PublishedFormat
from ferrum.weights.quantization.published.detect import checkpoint_format


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts MLP: a router picks `top_k` of `num_experts` gated MLPs per token, their
    outputs summed by the router's softmax weights (renormalised over the chosen when `normalize`);
    with `shared_intermediate_size`, a shared MLP every token runs, scaled by a sigmoid gate
    (Qwen2-MoE). The layers in `sparse_layers` are MoE, the rest dense MLPs of ModelConfig's size.
    Grouped top-k and several shared experts (DeepSeek-V3, GLM-4.5) would be more fields here."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    normalize: bool
    sparse_layers: tuple[int, ...]
    shared_intermediate_size: int = 0  # 0: no shared expert
    block: str = "mlp"  # the checkpoint's module name of the block ("block_sparse_moe": Mixtral)
    expert_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # Mixtral: w1, w3, w2


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # bias on q/k/v projections
    qk_norm: bool  # per-head RMSNorm on q and k (Qwen3)
    mlp_bias: bool
    dtype: torch.dtype  # the checkpoint's dtype
    sliding_window: int | None  # the attention window in tokens (a query sees itself and the window - 1 before it)
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # the published format its weights are stored in (config.json's quantization_config); None: unquantized
    published: PublishedFormat | None = field(default=None, compare=False)
    moe: MoeConfig | None = None  # a mixture of experts' MLPs; None: dense
    # the layers whose attention is limited to sliding_window; None: every layer (when sliding_window is set)
    window_layers: tuple[int, ...] | None = None

    def layer_window(self, layer: int) -> int | None:
        """The attention window of decoder layer `layer`, None where it sees the whole context."""
        if self.sliding_window is None or (self.window_layers is not None and layer not in self.window_layers):
            return None
        return self.sliding_window

    @property
    def uniform_window(self) -> int | None:
        """The window when every layer has it (then a sequence's KV blocks before the window can be given
        back); None when some layer sees the whole context."""
        windows = {self.layer_window(i) for i in range(self.num_layers)}
        return windows.pop() if len(windows) == 1 else None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def _rope_from(raw: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes `rope_parameters`; older configs use rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    scaling = raw.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    if kind not in ("default", "linear", "llama3"):
        raise ModelConfigError(f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)")
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(params.get("original_max_position_embeddings", 8192)),
    )


def _int_list(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _checkpoint_dtype(name: Any) -> torch.dtype:
    """The dtype config.json says the weights are stored in; float32 when it names no serving dtype."""
    try:
        return serving_dtype(str(name))
    except ValueError:
        return torch.float32


def _legacy_quantize_config(folder: Path) -> dict[str, Any] | None:
    """An older GPTQ folder's quantize_config.json (AutoGPTQ, before quantization_config moved into config.json)."""
    path = folder / "quantize_config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"{path}: cannot be read as JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{path}: expected a JSON object")
    return {"quant_method": "gptq", **raw}


def _moe_from(raw: dict[str, Any], architecture: str, layers: int) -> MoeConfig | None:
    """The MoE block of a Qwen3-MoE, Qwen2-MoE or Mixtral config.json; None for dense models."""
    if architecture == "MixtralForCausalLM":
        return MoeConfig(num_experts=int(raw["num_local_experts"]), top_k=int(raw["num_experts_per_tok"]),
                         intermediate_size=int(raw["intermediate_size"]), normalize=True,
                         sparse_layers=tuple(range(layers)), block="block_sparse_moe", expert_names=("w1", "w3", "w2"))
    if architecture not in ("Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM"):
        return None
    step = int(raw.get("decoder_sparse_step", 1))
    dense = set(_int_list(raw.get("mlp_only_layers")))
    experts = int(raw["num_experts"] if "num_experts" in raw else raw["num_local_experts"])  # (transformers 5 writes
    # num_local_experts; the published Qwen configs say num_experts)
    sparse = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    shared = int(raw.get("shared_expert_intermediate_size") or 0) if architecture == "Qwen2MoeForCausalLM" else 0
    return MoeConfig(num_experts=experts, top_k=int(raw["num_experts_per_tok"]),
                     intermediate_size=int(raw["moe_intermediate_size"]),
                     normalize=bool(raw.get("norm_topk_prob", architecture == "Qwen3MoeForCausalLM")),
                     sparse_layers=sparse, shared_intermediate_size=shared)


def _window_from(raw: dict[str, Any], architecture: str, layers: int) -> tuple[int | None, tuple[int, ...] | None]:
    """(sliding_window, window_layers) as transformers reads them: `layer_types` where config.json lists them
    ("sliding_attention" layers), else Qwen2/Qwen3's `use_sliding_window` from layer `max_window_layers` on
    (Qwen2-MoE: the even layers below it), else every layer where `sliding_window` is set (Mistral, Mixtral)."""
    window = raw.get("sliding_window")
    if not window:
        return None, None
    types = raw.get("layer_types")
    if types is not None:
        if not isinstance(types, list) or len(types) != layers:
            raise ModelConfigError(f"layer_types must list one type per layer ({layers}), got {types!r}")
        chosen = tuple(i for i, kind in enumerate(types) if kind == "sliding_attention")
        return (int(window), chosen) if chosen else (None, None)
    qwen = architecture.startswith("Qwen")
    if qwen and not raw.get("use_sliding_window", False):
        return None, None
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        first = int(raw.get("max_window_layers", layers))
        chosen = tuple(range(first, layers))
        return (int(window), chosen) if chosen else (None, None)
    if architecture == "Qwen2MoeForCausalLM":
        below = int(raw.get("max_window_layers", layers))
        chosen = tuple(i for i in range(min(below, layers)) if (i + 1) % 2)
        return (int(window), chosen) if chosen else (None, None)
    return int(window), None


def load_model_config(folder: str | Path) -> ModelConfig:
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        local_model_folder(Path(folder))  # raises the one verdict on what the folder lacks
        raise ModelConfigError(f"{path}: not found") from None  # (only if it was removed meanwhile)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"{path}: cannot be read as JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelConfigError(f"{path}: expected a JSON object")
    raw = {**raw.get("text_config", {}), **raw} if "text_config" in raw else raw
    architecture = resolve_architecture(raw, path)
    published = checkpoint_format(raw.get("quantization_config") or _legacy_quantize_config(Path(folder)), raw,
                                  str(path))
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
        layers = int(raw["num_hidden_layers"])
        sliding, window_layers = _window_from(raw, architecture, layers)
        config = ModelConfig(
            architecture=architecture,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=_rope_from(raw),
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", raw.get("qkv_bias", architecture in (
                "Qwen2ForCausalLM", "Qwen2MoeForCausalLM")))),
            qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            mlp_bias=bool(raw.get("mlp_bias", False)),
            dtype=_checkpoint_dtype(dtype_name),
            sliding_window=sliding,
            window_layers=window_layers,
            eos_token_ids=_int_list(raw.get("eos_token_id")),
            bos_token_id=raw.get("bos_token_id"),
            published=published,
            moe=_moe_from(raw, architecture, layers),
        )
    except KeyError as exc:
        raise ModelConfigError(f"{path}: missing required field {exc.args[0]!r}") from None
    except (TypeError, ValueError) as exc:
        raise ModelConfigError(f"{path}: bad value: {exc}") from None
    if config.moe is not None and published is not None:
        raise ModelConfigError(f"{path}: a {published.name} quantized mixture of experts ({architecture}): published "
                               f"quantized experts are not served yet; serve the unquantized checkpoint (on-load "
                               f"quantization, --quantization int8|int4|fp8, quantizes its experts too)")
    return config
