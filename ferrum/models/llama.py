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

    def decode_logits_fused(self, input_ids: torch.Tensor, kv_caches: list[KVCache],
                            batch: AttentionBatch) -> torch.Tensor:
        """forward + compute_logits for a few decode rows on a GPU, each projection one fused
        kernel: the norm before it in its prologue, the residual add or silu*mul after it in its
        epilogue (ferrum.models.triton_gemv). Equal to the layered path up to rounding order."""
        from ferrum.models.triton_gemv import gemv, qkv_rope_store

        # the first layer reads its input rows straight from the embedding table (no gather kernel)
        h, rows = self.embed_tokens.weight, input_ids
        for layer, cache in zip(self.layers, kv_caches):
            attn, mlp, norm1, norm2 = layer.self_attn, layer.mlp, layer.input_layernorm, layer.post_attention_layernorm
            if attn.q_norm is None:  # rope and the cache write in the projection's epilogue
                q = qkv_rope_store(h, attn.qkv_proj.weight, attn.qkv_proj.bias, norm1.weight, norm1.eps,
                                   batch.positions, batch.cos_table, batch.sin_table, batch.slot_mapping,
                                   cache[0], cache[1], attn.num_heads, attn.num_kv_heads, attn.head_dim, x_rows=rows)
                out = batch.attend_stored(attn, q, cache)
            else:  # per-head q/k norms need whole heads: a separate rope kernel
                qkv = gemv(h, attn.qkv_proj.weight, bias=attn.qkv_proj.bias, norm_weight=norm1.weight, eps=norm1.eps,
                           x_rows=rows)
                out = batch.attend(attn, qkv, cache)
            h = gemv(out, attn.o_proj.weight, residual=h, residual_rows=rows)
            rows = None
            act = gemv(h, mlp.gate_up_proj.weight, bias=mlp.gate_up_proj.bias, norm_weight=norm2.weight,
                       eps=norm2.eps, gated=True)
            h = gemv(act, mlp.down_proj.weight, bias=mlp.down_proj.bias, residual=h)
        return gemv(h, self.lm_head.weight, norm_weight=self.norm.weight, eps=self.norm.eps, out_dtype=torch.float32)

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
