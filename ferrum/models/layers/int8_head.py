"""CPU: the LM head's weight in int8 for decode steps of a few rows (quantization auto's choice).

A decode step on the CPU streams every weight once a token, and the LM head of a small model is a
large share of them (SmolLM2-135M: 57 MB of bf16 against 66 MB for all its int4 layers). Int8 in
groups of 32 inputs halves its bytes. The activations stay in float32 and so do the logits
(torch.ops.ferrum_cpu.int8_float_gemv): the only error is the weight's rounding, at most half a
step (max |w| over the group / 254). Rounding the head's input to int8 as well, as llama.cpp does
for its Q8_0 head, flipped a near-tie in the demo model's greedy answer to "What is the capital of
France?" (the answer llama-server gives); this form keeps bf16's answer.

Steps of more than ROWS rows (large batches, prefill) take `dense`, the head it was made from: there
the product is bound by compute, and the bf16 GEMM is faster than converting int8 to float per row.
"""

from __future__ import annotations

from typing import TypeGuard

import torch
from torch import nn

from ferrum.weights.quantization.arith import quantize
from ferrum.weights.quantization.scheme import QuantScheme

GROUP = 32


class Int8Head(nn.Module):
    qweight: torch.Tensor  # int8 [N, K]
    scale: torch.Tensor  # float32 [N, K / 32]
    ROWS = 4  # the float kernel's cost grows with the rows; beyond 4 the bf16 GEMM wins (a 49152x576 head)

    def __init__(self, dense: nn.Linear) -> None:
        super().__init__()
        self.dense = dense
        self.in_features, self.out_features = dense.in_features, dense.out_features
        stored = quantize(dense.weight.detach(), QuantScheme("int8", group_size=GROUP, per_group=True))
        self.register_buffer("qweight", stored.parts["qweight"].contiguous())
        self.register_buffer("scale", stored.parts["scale"].float().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] > self.ROWS:
            out: torch.Tensor = self.dense(x)
            return out
        logits: torch.Tensor = torch.ops.ferrum_cpu.int8_float_gemv(x, self.qweight, self.scale, GROUP)
        return logits

    def dequantized(self) -> torch.Tensor:
        """The weight the int8 values stand for, float32 [N, K]."""
        n, k = self.qweight.shape
        return (self.qweight.float().view(n, k // GROUP, GROUP) * self.scale[..., None]).view(n, k)


def int8_head_fits(head: nn.Module) -> TypeGuard[nn.Linear]:
    """A plain (unsplit, unquantized, bias-free) head whose inputs divide into groups of 32."""
    return (type(head) is nn.Linear and head.bias is None and head.in_features % GROUP == 0
            and head.weight.is_floating_point())
