"""`QuantWeight`: a quantized linear weight as the kernels read it (no triton import).

    int8   qweight int8 [N, K], scale float32 [N]:               w = q * scale
    fp8    qweight float8_e4m3fn [N, K], scale float32 [N]:      w = q * scale
           (with group_size: scale float32 [N, ceil(K/group_size)], a scale per group of a row's inputs;
           input_scale float32 [1]: a checkpoint's static activation scale, which the W8A8 GEMM quantizes
           x by instead of per row)
    int4   qweight uint8 [N, K/2] (input 2j in byte j's low nibble, 2j + 1 in its high nibble),
           scale and zero [N, ceil(K/group_size)] in the activations' dtype:  w = (q - 8) * scale + zero,
           input k in group k // group_size (the last group shorter where group_size does not divide K)
           with sub_scales (llama.cpp's Q4_K, w = d * sc * q - dmin * m): scale int16 [N, ceil(K/32)]
           (sc | m << 8, each 6 bits) and zero int64 [N, ceil(K/256)] (float32 d in the low word, dmin in
           the high one), a group of 32 inputs and a super-block of 8 groups

(the layout of ferrum.weights.quantization's QuantizedTensor, which the models' quantized linear
layers hold and hand to the kernels as this.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch


@dataclass(frozen=True)
class QuantWeight:
    kind: Literal["int8", "fp8", "int4"]
    qweight: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None = None  # int4 only
    group_size: int = 0  # int4's; int8 / fp8: 0 for a scale per row, else inputs per scale
    input_scale: torch.Tensor | None = None  # fp8: a static activation scale, float32 [1]
    sub_scales: bool = False  # int4: scale and zero are Q4_K's sub-scales and super-block factors

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1]) * (2 if self.kind == "int4" else 1)
