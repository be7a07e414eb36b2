"""The Llama-family decoder: Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, SmolLM2.

One model class; the family members differ only by flags in ModelConfig. The model says which
checkpoint tensors fill which of its parameters (`weight_bindings`): q/k/v and gate/up are fused
into one projection each, so their checkpoint tensors fill row ranges of one parameter. Every linear
layer is made by one `LinearFactory` from the served model's quantization (a quantized layer's
"parameter" is its quantized storage). The loader (ferrum.models.loader) turns that into the
WeightLoader's TensorSpecs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ferrum.models.attention.layer import Attention, AttentionInputs
from ferrum.models.attention.layout import KVCache
from ferrum.models.config import ModelConfig
from ferrum.models.layers import GatedMLP, LayerOps, RMSNorm, RotaryEmbedding, torch_ops
from ferrum.models.layers.int8_head import Int8Head
from ferrum.models.layers.linear import LinearFactory, check_skip
from ferrum.models.layers.moe import MoE
from ferrum.models.layers.parallel import (
    ParallelLMHead,
    RowParallelLinear,
    Shard,
    ShardPlan,
    TensorParallel,
    VocabParallelEmbedding,
)
from ferrum.models.layers.quantized_linear import QuantizedLinear
from ferrum.weights.quantization.tensor import QuantizedTensor


@dataclass(frozen=True)
class WeightBinding:
    """A checkpoint tensor and the parameter rows it fills."""

    checkpoint_name: str  # e.g. "model.layers.0.self_attn.q_proj.weight"
    parameter: str  # e.g. "layers.0.self_attn.qkv_proj.weight" (a quantized layer's: its storage)
    rows: tuple[int, int] | None = None  # the rows [start, end) of the parameter; None: all of it
    shard: Shard | None = None  # under tensor parallelism: the part of the checkpoint tensor this rank reads


class DecoderLayer(nn.Module):
    """`prefix`: the layer's path in the model ("layers.3"); its MLP a mixture of experts where
    ModelConfig.moe says so for this layer."""

    def __init__(self, config: ModelConfig, ops: LayerOps, tp: TensorParallel, linears: LinearFactory,
                 prefix: str, index: int = 0) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.self_attn = Attention(config, ops, tp, linears, f"{prefix}.self_attn", config.layer_window(index))
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        self.mlp: GatedMLP | MoE
        if config.moe is not None and index in config.moe.sparse_layers:
            self.mlp = MoE(config.hidden_size, config.moe, ops, linears, f"{prefix}.mlp", tp)
        else:
            self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias, ops, linears,
                                f"{prefix}.mlp", tp)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cache: KVCache, batch: AttentionInputs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: this layer's input before its residual add; returns (MLP output, residual stream)."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cache, batch)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


LINEAR_LAYERS = (nn.Linear, RowParallelLinear, ParallelLMHead, QuantizedLinear)

# checkpoint projection -> (our fused projection, its shard)
FUSED_PROJECTIONS = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


def checkpoint_modules(path: str) -> list[str]:
    """The checkpoint's linear modules (HF names) that our linear layer `path` is made of:
    "layers.0.self_attn.qkv_proj" -> its q_proj, k_proj and v_proj; "lm_head" -> "lm_head"."""
    if path == "lm_head":
        return [path]
    parent, _, leaf = path.rpartition(".")
    parts = [name for name, (fused, _) in FUSED_PROJECTIONS.items() if fused == leaf] or [leaf]
    return [f"model.{parent}.{part}" for part in parts]


class LlamaForCausalLM(nn.Module):
    """`config` is the whole model's; with `tp` (tensor parallelism) this is one rank's shard of
    it: its heads, MLP columns and vocabulary rows (ferrum.models.layers.parallel.ShardPlan).
    `linears` makes its linear layers (quantized where the served model's quantization says so; a
    tied lm_head is the embedding and never quantized)."""

    def __init__(self, config: ModelConfig, ops: LayerOps | None = None, tp: TensorParallel | None = None,
                 linears: LinearFactory | None = None) -> None:
        super().__init__()
        ops = ops or torch_ops()
        tp = tp or TensorParallel.single()
        linears = linears or LinearFactory()
        self.config = config
        self.tp = tp
        self.shard = ShardPlan(config, tp.rank, tp.size)
        rank_config = self.shard.rank_config()
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
        self.embed_tokens: nn.Embedding | VocabParallelEmbedding
        self.lm_head: nn.Linear | ParallelLMHead | QuantizedLinear | Int8Head
        rows = self.shard.vocab_rows
        if tp.size == 1:
            # its storage given, not drawn: nn.Embedding's normal_ init on the meta device would import
            # torch._dynamo (the loader fills the weight)
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size,
                                             _weight=torch.empty(config.vocab_size, config.hidden_size))
        else:
            self.embed_tokens = VocabParallelEmbedding(rows, self.shard.vocab_start, config.hidden_size, tp)
        if config.tie_word_embeddings:
            self.lm_head = LinearFactory().lm_head(rows, config.hidden_size, config.vocab_size, tp)
        else:
            self.lm_head = linears.lm_head(rows, config.hidden_size, config.vocab_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(rank_config, ops, tp, linears, f"layers.{i}", i)
                                    for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, ops)
        if config.tie_word_embeddings:
            self.tie_embeddings()
        if linears.quantization is not None:
            check_skip(linears.quantization, [name for name, module in self.named_modules()
                                              if isinstance(module, LINEAR_LAYERS)])

    def tie_embeddings(self) -> None:
        """The LM head reads the embedding's weight (tie_word_embeddings)."""
        assert not isinstance(self.lm_head, QuantizedLinear)
        self.lm_head.weight = self.embed_tokens.weight

    def quantized_layers(self) -> dict[str, QuantizedLinear]:
        """The quantized linear layers, by module path."""
        return {name: m for name, m in self.named_modules() if isinstance(m, QuantizedLinear)}

    def weight_destinations(self) -> dict[str, torch.Tensor | QuantizedTensor]:
        """Everything the checkpoint fills, by name: the parameters, and each quantized layer's
        storage as "<layer>.weight" (a tied lm_head's weight appears once, as the embedding's)."""
        destinations: dict[str, torch.Tensor | QuantizedTensor] = {
            name: p.data for name, p in self.named_parameters()}
        for name, layer in self.quantized_layers().items():
            destinations[f"{name}.weight"] = layer.storage()
        return destinations

    def forward(self, input_ids: torch.Tensor, kv_caches: list[KVCache], batch: AttentionInputs) -> torch.Tensor:
        """input_ids: [T] (their positions and the cache slots are in `batch`, the attention
        backend's step inputs). Returns final hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer, cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cache, batch)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    def shard_rows(self, fused: str, rows: int) -> list[int]:
        """Row offsets of the parts of a fused projection (this rank's) of `rows` rows: q, k, v or gate, up."""
        c = self.shard.rank_config()
        if fused == "qkv_proj":
            return [0, c.q_size, c.q_size + c.kv_size, c.q_size + 2 * c.kv_size]
        return [0, rows // 2, rows]

    def weight_bindings(self) -> list[WeightBinding]:
        """Every checkpoint tensor the model needs (HF names), the parameter rows it fills and, for
        a tensor-parallel rank, the part of it the rank reads. The rotary tables are computed, and a
        tied lm_head is the embedding, so neither is listed."""
        bindings: list[WeightBinding] = []
        by_fused = {(fused, shard): name for name, (fused, shard) in FUSED_PROJECTIONS.items()}
        experts: set[str] = set()  # a mixture of experts' stacked parameters, filled expert by expert
        shared: dict[str, int] = {}  # a shared expert's module path -> its whole intermediate size
        moe = self.config.moe
        for name, module in self.named_modules():
            if isinstance(module, MoE) and moe is not None:
                block = f"model.{name.rpartition('.')[0]}.{module.moe.block}"
                bindings.append(WeightBinding(f"{block}.gate.weight", f"{name}.gate.weight"))
                for parameter, tensor_name, span in module.checkpoint_rows():
                    projection = "down_proj" if parameter == "experts_down" else "gate_proj"
                    bindings.append(WeightBinding(f"{block}.{tensor_name}", f"{name}.{module.destination(parameter)}",
                                                  span, self.shard.checkpoint_shard(projection, "weight",
                                                                                    moe.intermediate_size)))
                experts.update((f"{name}.gate.weight", f"{name}.{module.destination('experts_gate_up')}",
                                f"{name}.{module.destination('experts_down')}"))
                shared[f"{name}.shared_expert"] = moe.shared_intermediate_size
        for parameter, tensor in self.weight_destinations().items():
            if parameter in experts:
                continue
            parts = parameter.split(".")
            checkpoint = parameter if parameter.startswith("lm_head.") else f"model.{parameter}"
            if len(parts) >= 2 and parts[-2] in ("qkv_proj", "gate_up_proj"):
                rows = self.shard_rows(parts[-2], tensor.shape[0])
                whole = shared.get(".".join(parts[:-2]))  # a shared expert's intermediate size
                for part in range(len(rows) - 1):
                    projection = by_fused[(parts[-2], part)]
                    name = ".".join(["model", *parts[:-2], projection, parts[-1]])
                    bindings.append(WeightBinding(name, parameter, (rows[part], rows[part + 1]),
                                                  self.shard.checkpoint_shard(projection, parts[-1], whole)))
            else:
                shard = self.shard.checkpoint_shard(parts[-2], parts[-1], shared.get(".".join(parts[:-2])))
                fill = None if shard is None or shard.end - shard.start == tensor.shape[shard.dim] else (
                    0, shard.end - shard.start)  # the last rank's vocabulary rows past the end stay unused
                bindings.append(WeightBinding(checkpoint, parameter, fill, shard))
        return bindings


def ignored_checkpoint_tensor(name: str, config: ModelConfig) -> bool:
    """Checkpoint tensors the model has no parameter for and does not need: rotary tables (computed
    here), and an lm_head a checkpoint stores although it is tied to the embedding."""
    return "rotary_emb" in name or (name == "lm_head.weight" and config.tie_word_embeddings)
