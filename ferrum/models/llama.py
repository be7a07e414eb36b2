"""The Llama-family decoder: Llama 2/3.x, Mistral, Qwen2/2.5, Qwen3, SmolLM2.

One model class; the family members differ only by flags in ModelConfig.
"""

from __future__ import annotations

import torch
from torch import nn

from ferrum.models.attention import AttentionBatch, KVCache
from ferrum.models.config import ModelConfig
from ferrum.models.layers import GatedMLP, RMSNorm, RotaryEmbedding


class Attention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if config.qk_norm else None

    def forward(self, x: torch.Tensor, cache: KVCache, batch: AttentionBatch) -> torch.Tensor:
        out = batch.attend(self, self.qkv_proj(x), cache)  # rope, cache write and attention
        return self.o_proj(out)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, config.mlp_bias)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cache: KVCache, batch: AttentionBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: this layer's input before its residual add; returns (MLP output, residual stream)."""
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cache, batch)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        kv_caches: list[KVCache],
        batch: AttentionBatch,
    ) -> torch.Tensor:
        """input_ids: [T] (their positions are in `batch`). Returns final hidden states [T, hidden]."""
        x = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer, cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, cache, batch)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden).float()

    # HF checkpoint names -> (our parameter, shard index) for the fused projections.
    FUSED = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def shard_offsets(self, fused: str) -> list[int]:
        c = self.config
        if fused == "qkv_proj":
            return [0, c.q_size, c.q_size + c.kv_size, c.q_size + 2 * c.kv_size]
        return [0, c.intermediate_size, 2 * c.intermediate_size]
