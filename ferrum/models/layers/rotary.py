"""Rotary position embedding: the cos / sin tables of each position (llama3 and linear scaling
included) and the rotation of q and k (the half-split layout HF checkpoints use)."""

from __future__ import annotations

import math

import torch
from torch import nn

from ferrum.models.config import RopeConfig


def rope_inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        # Llama 3.1 scaling: keep high frequencies, divide low ones by `factor`, blend in between.
        old_len = rope.original_max_position_embeddings
        low_freq_wavelen = old_len / rope.low_freq_factor
        high_freq_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(medium, blended, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Rotates q and k by position (the half-split layout HF checkpoints use)."""

    cos_table: torch.Tensor  # buffers: [max_positions, head_dim] float32
    sin_table: torch.Tensor

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        if torch.get_default_device().type == "meta":  # a model laid out before it is allocated: shapes alone
            # (arithmetic on meta tensors runs torch's reference ops, whose first call imports torch._dynamo:
            # 1.2-1.4 s of a CPU server's start-up; the tables are computed where the model is allocated)
            self.register_buffer("cos_table", torch.empty(max_positions, head_dim), persistent=False)
            self.register_buffer("sin_table", torch.empty(max_positions, head_dim), persistent=False)
            return
        inv_freq = rope_inverse_frequencies(rope, head_dim)
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_table", emb.cos(), persistent=False)
        self.register_buffer("sin_table", emb.sin(), persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for `positions` [T], shaped [T, 1, head_dim] to broadcast over heads."""
        cos = self.cos_table.index_select(0, positions).unsqueeze(1).to(dtype)
        sin = self.sin_table.index_select(0, positions).unsqueeze(1).to(dtype)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + _rotate_half(x) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
