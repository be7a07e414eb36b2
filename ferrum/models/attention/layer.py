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
from ferrum.models.layers.parallel import RowParallelLinear, TensorParallel


class AttentionInputs(Protocol):
    """One step's attention inputs, as a backend builds them (`AttentionBackend.step_inputs`)."""

    def attend(self, layer: Attention, qkv: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """qkv: [T, q_size + 2 kv_size] -> attention output [T, q_size]; writes k, v to the cache."""
        ...


class Attention(nn.Module):
    """`config` is this rank's (its share of the heads under tensor parallelism)."""

    def __init__(self, config: ModelConfig, ops: LayerOps, tp: TensorParallel) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj: nn.Linear | RowParallelLinear = (
            nn.Linear(self.q_size, config.hidden_size, bias=False) if tp.size == 1
            else RowParallelLinear(self.q_size, config.hidden_size, False, tp))
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, ops) if config.qk_norm else None

    def forward(self, x: torch.Tensor, cache: KVCache, batch: AttentionInputs) -> torch.Tensor:
        out = batch.attend(self, self.qkv_proj(x), cache)  # rope, cache write and attention
        return self.o_proj(out)
