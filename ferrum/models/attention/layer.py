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
    module's path in the model ("layers.3.self_attn"), which names its projections' quantization; `window`:
    the layer's sliding window (a query sees itself and the window - 1 keys before it), None for the whole
    context."""

    def __init__(self, config: ModelConfig, ops: LayerOps, tp: TensorParallel, linears: LinearFactory | None = None,
                 prefix: str = "self_attn", window: int | None = None) -> None:
        super().__init__()
        linears = linears or LinearFactory()
        self.window = window
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
        # an fp8 KV cache's scales, k's then v's (the cache holds k / kv_scale[0], v / kv_scale[1]): the
        # checkpoint's where it has them, else measured at start-up (ferrum.models.attention.kv_scales)
        self.register_buffer("kv_scale", torch.ones(2), persistent=False)
        self.kv_scale: torch.Tensor
        self.kv_amax: torch.Tensor | None = None  # while measuring: the largest |k| (a rotation bound) and |v| seen
        # a checkpoint's FP8 KV-cache scales (compressed-tensors' kv_cache_scheme), loaded as parameters
        self.k_scale: nn.Parameter | None = None
        self.v_scale: nn.Parameter | None = None
        if linears.published is not None and linears.published.format.kv_cache_scales:
            self.k_scale = nn.Parameter(torch.ones(1), requires_grad=False)
            self.v_scale = nn.Parameter(torch.ones(1), requires_grad=False)

    def forward(self, x: torch.Tensor, cache: KVCache, batch: AttentionInputs) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        if self.kv_amax is not None:
            self._observe(qkv)
        out = batch.attend(self, qkv, cache)  # rope, cache write and attention
        return self.o_proj(out)

    def _observe(self, qkv: torch.Tensor) -> None:
        """Raises kv_amax to this step's largest |v| and a bound on its largest rotated |k|: rope turns
        each pair (i, i + head_dim/2) by an angle, so no rotated element exceeds the pair's norm."""
        assert self.kv_amax is not None
        k = qkv[:, self.q_size : self.q_size + self.kv_size].float().view(-1, self.num_kv_heads, self.head_dim)
        if self.k_norm is not None:
            k = self.k_norm.norm(k).float()
        half = self.head_dim // 2
        pair = (k[..., :half].square() + k[..., half:].square()).sqrt()
        v = qkv[:, self.q_size + self.kv_size :].float()
        seen = torch.stack([pair.amax(), v.abs().amax()])
        torch.maximum(self.kv_amax, seen, out=self.kv_amax)
