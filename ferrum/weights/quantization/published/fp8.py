"""FP8 checkpoints (quant_method "fp8": transformers' FP8 and FineGrainedFP8 quantizers, Qwen's and
DeepSeek's FP8 releases, vLLM's serialized fp8).

Per quantized module M (N outputs, K inputs):

    M.weight             float8_e4m3fn [N, K]
    M.weight_scale       float32 [] or [1]           per tensor: w = q * scale
    M.weight_scale_inv   float32 [N / bn, K / bk]    blocks of weight_block_size [bn, bk]: w = q * scale_inv
    M.input_scale        float32 [] or [1]           activation_scheme static: x is quantized as x / input_scale

Served as fp8 with float32 scales: a per-tensor scale as one per output row, block scales as one per
group of bk inputs of each row (the row's block's: exact, 1/bn of the scales' size more memory). A static
input scale is kept per output row too (`QuantScheme.static_input`): where Ferrum's GEMMs quantize the
activations (tensor cores, from 17 rows) they scale them by it, the largest of a fused layer's parts',
as vLLM does; decode-sized products read the activations unquantized (W8A16) whichever the scheme.
`modules_to_not_convert` / `ignored_layers` name modules stored unquantized.
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
    expect_scalar,
    matching,
    static_input_scale,
)
from ferrum.weights.quantization.scheme import QuantizationConfigError, QuantScheme
from ferrum.weights.quantization.tensor import QuantizedTensor

__all__ = ["Fp8Format"]


class Fp8Format(PublishedFormat):
    name = "fp8"

    def __init__(self, config: Mapping[str, Any]) -> None:
        block = config.get("weight_block_size")
        self.block: tuple[int, int] | None = None
        if block:
            if (len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)
                    or block[1] < 16 or block[1] & (block[1] - 1)):
                raise QuantizationConfigError(
                    f"FP8 weight_block_size {list(block)}: Ferrum serves blocks [rows, inputs] whose inputs are a "
                    "power of two >= 16")
            self.block = (int(block[0]), int(block[1]))
        fmt = str(config.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise QuantizationConfigError(f"FP8 fmt {fmt!r}: Ferrum serves float8 e4m3")
        self.activation_scheme = str(config.get("activation_scheme") or "dynamic").lower()
        if self.activation_scheme not in ("dynamic", "static"):
            raise QuantizationConfigError(f"FP8 activation_scheme {self.activation_scheme!r}: Ferrum serves dynamic "
                                          "and static")
        self.static = self.activation_scheme == "static"
        self.skip: tuple[str, ...] = tuple(config.get("modules_to_not_convert") or ()) + tuple(
            config.get("ignored_layers") or ())

    def describe(self) -> str:
        scales = f"{self.block[0]}x{self.block[1]} block" if self.block else "per-tensor"
        activations = "static activation scales" if self.static else "dynamic activations"
        return f"fp8 (e4m3, {scales} weight scales, {activations})"

    def scheme(self, module: str, k: int) -> QuantScheme | None:
        if matching(module, self.skip) or module.split(".")[-1] == "lm_head":
            return None
        if self.block:
            return QuantScheme("fp8", self.block[1], per_group=True, static_input=self.static)
        return QuantScheme("fp8", static_input=self.static)

    def tensors(self, module: str) -> dict[str, str]:
        scale = "weight_scale_inv" if self.block else "weight_scale"
        names = {"weight": f"{module}.weight", scale: f"{module}.{scale}"}
        if self.static:
            names["input_scale"] = f"{module}.input_scale"
        return names

    def check(self, module: str, n: int, k: int, infos: Mapping[str, TensorInfo]) -> list[str]:
        names, problems = self.tensors(module), list[str]()
        expect(problems, infos, names, "weight", (n, k), (torch.float8_e4m3fn,))
        floats = (torch.float32, torch.bfloat16, torch.float16)
        if self.static:
            expect_scalar(problems, infos, names, "input_scale")
        if self.block:
            expect(problems, infos, names, "weight_scale_inv", (-(-n // self.block[0]), -(-k // self.block[1])), floats)
            return problems
        expect_scalar(problems, infos, names, "weight_scale")
        return problems

    def repack(self, module: str, n: int, k: int, raw: Mapping[str, torch.Tensor], dtype: torch.dtype) -> Repacked:
        scheme = self.scheme(module, k)
        assert scheme is not None
        if self.block:  # each row takes its row block's scales (exact: float32 values copied)
            scale = raw["weight_scale_inv"].float().repeat_interleave(self.block[0], dim=0)[:n].contiguous()
        else:
            scale = raw["weight_scale"].float().reshape(1).expand(n).contiguous()
        parts = {"qweight": raw["weight"], "scale": scale}
        if self.static:
            parts["input_scale"] = static_input_scale(raw["input_scale"], f"{module}.input_scale", n)
        return Repacked(QuantizedTensor(scheme, (n, k), dtype, parts))

    def unused(self, name: str) -> bool:
        return name.endswith((".k_scale", ".v_scale") if self.static else (".input_scale", ".k_scale", ".v_scale"))
