"""AWQ checkpoints (quant_method "awq", version "gemm", as AutoAWQ and GPTQModel write them).

Per quantized module M, with K inputs, N outputs and groups of g inputs (4-bit, zero points):

    M.qweight  int32 [K, N / 8]      8 outputs per word in AutoAWQ's order: the value at bits 4*i is
                                     output 8w + (0, 2, 4, 6, 1, 3, 5, 7)[i]
    M.qzeros   int32 [K / g, N / 8]  the zero points, packed alike
    M.scales   float16 [K / g, N]
    w[n, k] = (q[k, n] - z[k // g, n]) * scales[k // g, n]

Served in the seam's int4 with zero = (8 - z) * scale, scales and zeros in float32 (exact).
`modules_to_not_convert` names modules stored unquantized.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ferrum.weights.quantization.published.base import (
    PublishedFormat,
    Repacked,
    TensorInfo,
    expect,
    matching,
    pack_int4_rows,
    unpack_int32,
)
from ferrum.weights.quantization.scheme import QuantizationConfigError, QuantScheme
from ferrum.weights.quantization.tensor import QuantizedTensor

__all__ = ["AwqFormat"]

_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output each nibble of a word holds
_UNDO = tuple(_ORDER.index(i) for i in range(8))  # the nibble holding each output


def unpack_awq(packed: torch.Tensor) -> torch.Tensor:
    """AWQ's int32 [R, N / 8] -> values [R, N] in output order."""
    nibbles = unpack_int32(packed, 4).reshape(packed.shape[0], -1, 8)
    return nibbles[..., list(_UNDO)].reshape(packed.shape[0], -1)


class AwqFormat(PublishedFormat):
    name = "awq"

    def __init__(self, config: Mapping[str, Any]) -> None:
        bits = config.get("bits", config.get("w_bit", 4))
        if bits != 4:
            raise QuantizationConfigError(f"AWQ with bits={bits!r}: Ferrum serves 4-bit AWQ")
        version = str(config.get("version", "gemm")).lower()
        if version != "gemm":
            raise QuantizationConfigError(
                f"AWQ version {version!r}: Ferrum reads the GEMM layout (re-save the model with AutoAWQ's "
                "version='gemm', or serve it with vLLM)")
        group = config.get("group_size", config.get("q_group_size", 128))
        if not isinstance(group, int) or isinstance(group, bool) or group < 16 or group & (group - 1):
            raise QuantizationConfigError(
                f"AWQ group_size {group!r}: Ferrum's int4 kernels take power-of-two groups of 16 or more")
        self.group_size: int = group
        if not config.get("zero_point", True):
            raise QuantizationConfigError("AWQ with zero_point false: Ferrum serves AWQ's GEMM layout with zero points")
        self.skip: tuple[str, ...] = tuple(config.get("modules_to_not_convert") or ())

    def describe(self) -> str:
        return f"awq (4-bit, group {self.group_size}, zero point, gemm)"

    def scheme(self, module: str, k: int) -> QuantScheme | None:
        if matching(module, self.skip) or module.split(".")[-1] == "lm_head":
            return None
        return QuantScheme("int4", self.group_size, False, torch.float32)

    def tensors(self, module: str) -> dict[str, str]:
        return {role: f"{module}.{role}" for role in ("qweight", "qzeros", "scales")}

    def check(self, module: str, n: int, k: int, infos: Mapping[str, TensorInfo]) -> list[str]:
        names, problems = self.tensors(module), list[str]()
        if n % 8 or k % self.group_size:
            return [f"{module}: {n} outputs do not pack 8 a word, or {k} inputs do not divide into groups of "
                    f"{self.group_size}"]
        groups = k // self.group_size
        expect(problems, infos, names, "qweight", (k, n // 8), (torch.int32,))
        expect(problems, infos, names, "qzeros", (groups, n // 8), (torch.int32,))
        expect(problems, infos, names, "scales", (groups, n), (torch.float16, torch.bfloat16, torch.float32))
        return problems

    def repack(self, module: str, n: int, k: int, raw: Mapping[str, torch.Tensor], dtype: torch.dtype) -> Repacked:
        scheme = self.scheme(module, k)
        assert scheme is not None and scheme.params is not None
        q = unpack_awq(raw["qweight"]).t()  # [N, K]
        zeros = unpack_awq(raw["qzeros"]).t().float()  # [N, G]
        scales = raw["scales"].t().float()
        zero = (8.0 - zeros) * scales
        parts = {"qweight": pack_int4_rows(q), "scale": scales.to(scheme.params).contiguous(),
                 "zero": zero.to(scheme.params).contiguous()}
        return Repacked(QuantizedTensor(scheme, (n, k), dtype, parts))
