"""CPU: the LM head's weight in int8 for decode steps of a few rows (quantization auto's choice).

A decode step on the CPU streams every weight once a token, and the LM head of a small model is a
large share of them (SmolLM2-135M: 57 MB of bf16 against 66 MB for all its int4 layers). Int8 in
groups of 32 inputs halves its bytes. The activations stay in float32 and so do the logits
(torch.ops.ferrum_cpu.int8_float_gemv): the only error is the weight's rounding, at most half a
step (max |w| over the group / 254). Rounding the head's input to int8 as well, as llama.cpp does
for its Q8_0 head, flipped a near-tie in the demo model's greedy answer to "What is the capital of
France?" (the answer llama-server gives); this form keeps bf16's answer.

Steps of up to ROWS rows go through the int8 kernel in calls of at most CHUNK rows; each row's logits
are the same bits however many rows come with it, so a speculative verify step's rows (k + 1 at batch 1)
score as a one-row decode does and greedy outputs match plain decoding. Steps of more rows (large
batches, prefill) take `dense`, the head it was made from: there the product is bound by compute.
Measured on a 2-core AMD EPYC Zen 4 (avx512_bf16/vnni, 49152x576 head, 2 threads): int8 in chunks of 4
against the bf16 GEMM, 2.00 / 4.73 ms at 4 rows, 3.03 / 5.15 at 5, 3.75 / 4.37 at 8, 5.72 / 5.16 at 12.
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
    ROWS = 8  # beyond 8 rows the bf16 GEMM wins (see above)
    CHUNK = 4  # the kernel's rows a call

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
        if x.shape[0] <= self.CHUNK:
            return self._int8(x)
        return torch.cat([self._int8(rows) for rows in x.split(self.CHUNK)])

    def _int8(self, x: torch.Tensor) -> torch.Tensor:
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
