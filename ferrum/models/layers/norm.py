"""RMSNorm, with the residual add folded in."""

from __future__ import annotations

import torch
from torch import nn

from ferrum.models.layers.ops import LayerOps, rms_norm_reference, torch_ops


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, ops: LayerOps | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps
        self.ops = ops or torch_ops()

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Norm of x, or of x + residual; returns (normed, the summed input as the next residual)."""
        return self.ops.rms_norm(x, self.weight, self.eps, residual)

    def norm(self, x: torch.Tensor) -> torch.Tensor:
        """The plain norm of x (per-head q/k norms of the torch attention path)."""
        return rms_norm_reference(x, self.weight, self.eps)
