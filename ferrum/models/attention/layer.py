"""`Attention`: a decoder's attention layer (the fused q/k/v projection, optional per-head q/k
norms, the output projection); rope, the cache write and attention itself are the step's
`AttentionInputs`, from the attention backend."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from ferrum.models.attention.layout import KVCache
from ferrum.models.config import ModelConfig
from ferrum.models.layers import LayerOps, RMSNorm
from ferrum.models.layers.linear import LinearFactory
from ferrum.models.layers.parallel import RowParallelLinear, TensorParallel
from ferrum.models.layers.quantized_linear import QuantizedLinear


class AttentionInputs(Protocol):
    """One step's attention inputs, as a backend builds them (`AttentionBackend.step_inputs`)."""

    def attend(self, layer: Attention, qkv: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """qkv: [T, q_size + 2 kv_size] -> attention output [T, q_size]; writes k, v to the cache."""
        ...


class Attention(nn.Module):
    """`config` is this rank's (its share of the heads under tensor parallelism); `prefix` is the
    module's path in the model ("layers.3.self_attn"), which names its projections' quantization."""

    def __init__(self, config: ModelConfig, ops: LayerOps, tp: TensorParallel, linears: LinearFactory | None = None,
                 prefix: str = "self_attn") -> None:
        super().__init__()
        linears = linears or LinearFactory()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = linears.linear(f"{prefix}.qkv_proj", config.hidden_size, self.q_size + 2 * self.kv_size,
                                       config.attention_bias)
        self.o_proj: nn.Linear | RowParallelLinear | QuantizedLinear = (
            linears.linear(f"{prefix}.o_proj", self.q_size, config.hidden_size, False) if tp.size == 1
            else linears.row_parallel(f"{prefix}.o_proj", self.q_size, config.hidden_size, False, tp))
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops) if config.qk_norm else None
        # a checkpoint's FP8 KV-cache scales (compressed-tensors' kv_cache_scheme), loaded as parameters;
        # nothing reads them yet (the KV cache is stored in the serving dtype)
        self.k_scale: nn.Parameter | None = None
        self.v_scale: nn.Parameter | None = None
        if linears.published is not None and linears.published.format.kv_cache_scales:
            self.k_scale = nn.Parameter(torch.ones(1), requires_grad=False)
            self.v_scale = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, x: torch.Tensor, cache: KVCache, batch: AttentionInputs) -> torch.Tensor:
        out = batch.attend(self, self.qkv_proj(x), cache)  # rope, cache write and attention
        return self.o_proj(out)
