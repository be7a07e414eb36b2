"""The gated MLP: down(silu(gate(x)) * up(x)), with gate and up fused in one projection."""

from __future__ import annotations

import torch
from torch import nn

from ferrum.models.layers.linear import LinearFactory
from ferrum.models.layers.ops import LayerOps, torch_ops
from ferrum.models.layers.parallel import RowParallelLinear, TensorParallel
from ferrum.models.layers.quantized_linear import QuantizedLinear


class GatedMLP(nn.Module):
    """`prefix`: the module's path in the model ("layers.3.mlp"), which names its layers' quantization;
    under tensor parallelism (`tp`) `intermediate` is this rank's share and down_proj is row-split."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, ops: LayerOps | None = None,
                 linears: LinearFactory | None = None, prefix: str = "mlp", tp: TensorParallel | None = None) -> None:
        super().__init__()
        linears = linears or LinearFactory()
        self.intermediate = intermediate
        self.gate_up_proj = linears.linear(f"{prefix}.gate_up_proj", hidden, 2 * intermediate, bias)
        self.down_proj: nn.Linear | RowParallelLinear | QuantizedLinear = (
            linears.linear(f"{prefix}.down_proj", intermediate, hidden, bias) if tp is None or tp.size == 1
            else linears.row_parallel(f"{prefix}.down_proj", intermediate, hidden, bias, tp))
        self.ops = ops or torch_ops()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.ops.silu_and_mul(self.gate_up_proj(x)))
