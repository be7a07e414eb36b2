"""The gated MLP: down(silu(gate(x)) * up(x)), with gate and up fused in one projection."""

from __future__ import annotations

import torch
from torch import nn

from ferrum.models.layers.ops import LayerOps, torch_ops
from ferrum.models.layers.parallel import RowParallelLinear


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, bias: bool, ops: LayerOps | None = None) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj: nn.Linear | RowParallelLinear = nn.Linear(intermediate, hidden, bias=bias)  # row-split under TP
        self.ops = ops or torch_ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
