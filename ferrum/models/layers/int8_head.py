"""CPU: the LM head's weight in int8 (quantization auto's choice).

A decode step on the CPU streams every weight once a token, and the LM head of a small model is a
large share of them (SmolLM2-135M: 57 MB of bf16 against 66 MB for all its int4 layers). Int8 in
groups of 32 inputs halves its bytes. The activations stay in float32 and so do the logits
(torch.ops.ferrum_cpu.int8_float_gemv): the only error is the weight's rounding, at most half a
step (max |w| over the group / 254). Rounding the head's input to int8 as well, as llama.cpp does
for its Q8_0 head, flipped a near-tie in the demo model's greedy answer to "What is the capital of
France?" (the answer llama-server gives); this form keeps bf16's answer.

Every step goes through the int8 kernel, whatever its rows (it reads each weight row once for 4 rows
of x): a row's logits are the same bits however many rows come with it, so the head adds nothing to what
a request's answer owes to its batch, and a speculative verify step's rows (k + 1 at batch 1) score as a
one-row decode does. (A dense product of the unrounded weight past 8 rows, as this head once
took, gave a row in a large batch logits that differed from its logits alone by the weight's rounding.)
Measured on a 2-core AMD EPYC Zen 3 (AVX2 only, 49152 x 576, 2 threads, `python scripts/cpu_kernel_ab.py
--head-rows ...`), ms: int8 1.1 / 2.1 / 8.5 / 34 / 68 / 163 at 1 / 4 / 16 / 64 / 128 / 256 rows; torch's
dense float32 product 8.4 / 18 / 20 / 40 / 66 / 132 and bfloat16 3.2 / 12 / 46 / 184 / 364 / 751. So only
float32 models at 128 rows and more would be faster dense (by up to 1.24x).
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

    def __init__(self, dense: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = dense.in_features, dense.out_features
        stored = quantize(dense.weight.detach(), QuantScheme("int8", group_size=GROUP, per_group=True))
        self.register_buffer("qweight", stored.parts["qweight"].contiguous())
        self.register_buffer("scale", stored.parts["scale"].float().contiguous())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
