"""Building blocks shared by every decoder: norms, rotary embedding, MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ferrum.models.config import RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Norm of x, or of x + residual; returns (normed, the summed input as the next residual)."""
        if x.is_cuda:
            from ferrum.models import triton_kernels

            normed, summed = triton_kernels.rms_norm(x, self.weight, self.eps, residual)
            return normed, x if summed is None else summed
        if residual is not None:
            x = x + residual
        return self.norm(x), x

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        # HF's order of operations, in float32; torch's fused rms_norm accumulates in bf16 on CPU,
        # which the large activations of real checkpoints do not survive.
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


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

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
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


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused in one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if gate_up.is_cuda:
            from ferrum.models import triton_kernels

            return self.down_proj(triton_kernels.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
