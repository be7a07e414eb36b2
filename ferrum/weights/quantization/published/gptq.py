"""GPTQ checkpoints (quant_method "gptq", as GPTQModel, AutoGPTQ and optimum write them).

Per quantized module M, with K inputs, N outputs, G groups and b bits (4 or 8):

    M.qweight  int32 [K * b / 32, N]   32/b inputs of one output per word, input i of the word at bits b*i
    M.qzeros   int32 [G, N * b / 32]   the zero points, 32/b outputs per word; checkpoint_format "gptq"
                                       stores z - 1 (the original packing's off-by-one: a stored 15 is
                                       z = 16, as its kernels compute), "gptq_v2" z itself
    M.scales   float16 [G, N]
    M.g_idx    int32 [K]               input k's group (desc_act: groups in order of importance, not k // g)
    w[n, k] = (q[k, n] - z[g_idx[k], n]) * scales[g_idx[k], n]

Served as: 4-bit in the seam's int4 ((q - 8) * scale + zero with zero = (8 - z) * scale: float16 scales
and zeros when symmetric (z = 8, zero 0), float32 otherwise, exact either way); 8-bit symmetric as
int8 (q - 128, float32 scales per group, or per row for group_size -1); 8-bit asymmetric as int8 with
zeros per group (`offsets`: q - 128, zero = (128 - z) * scale in float32, exact; group_size -1 one
group a row). group_size -1 is one group a row (the
scheme's group size is K rounded up to a power of two: one ragged group). With desc_act the inputs
are stored sorted by group, and the layer reorders its input to match (`Repacked.input_order`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ferrum.weights.quantization.published.base import (
    PublishedFormat,
    Repacked,
    RepackError,
    TensorInfo,
    act_order,
    expect,
    matching,
    pack_int4_rows,
    unpack_int32,
)
from ferrum.weights.quantization.scheme import QuantizationConfigError, QuantScheme
from ferrum.weights.quantization.tensor import QuantizedTensor

__all__ = ["GptqFormat", "one_group_size"]


def one_group_size(k: int) -> int:
    """The int4 group size that makes one (ragged) group of a row of k inputs: k rounded up to a power of two."""
    return max(16, 1 << (k - 1).bit_length())


class GptqFormat(PublishedFormat):
    name = "gptq"

    def __init__(self, config: Mapping[str, Any]) -> None:
        bits = config.get("bits")
        if bits not in (4, 8):
            raise QuantizationConfigError(
                f"GPTQ with bits={bits!r}: Ferrum serves 4- and 8-bit GPTQ (a {bits}-bit checkpoint runs on vLLM's "
                "or GPTQModel's own kernels)")
        self.bits: int = bits
        group = config.get("group_size", 128)
        if not isinstance(group, int) or isinstance(group, bool) or (group != -1 and group < 1):
            raise QuantizationConfigError(f"GPTQ group_size must be a positive integer or -1, got {group!r}")
        self.group_size: int = group
        self.desc_act = bool(config.get("desc_act", False))
        self.symmetric = bool(config.get("sym", True))
        fmt = str(config.get("checkpoint_format", config.get("format", "gptq"))).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise QuantizationConfigError(
                f"GPTQ checkpoint_format {fmt!r}: Ferrum reads 'gptq' and 'gptq_v2' (a Marlin- or BitBLAS-packed "
                "checkpoint needs the tool that wrote it to re-save it as gptq)")
        self.zero_offset = 1 if fmt == "gptq" else 0  # v1 stores z - 1
        self.checkpoint_format = fmt
        self.lm_head = bool(config.get("lm_head", False))
        skip = config.get("modules_to_not_convert") or ()
        self.skip: tuple[str, ...] = tuple(skip)

    def describe(self) -> str:
        group = "per channel" if self.group_size == -1 else f"group {self.group_size}"
        act = ", desc_act" if self.desc_act else ""
        return (f"gptq ({self.bits}-bit, {group}, {'symmetric' if self.symmetric else 'asymmetric'}{act}, "
                f"{self.checkpoint_format})")

    def groups(self, k: int) -> int:
        return 1 if self.group_size == -1 else -(-k // self.group_size)

    def scheme(self, module: str, k: int) -> QuantScheme | None:
        if matching(module, self.skip) or (module.split(".")[-1] == "lm_head" and not self.lm_head):
            return None
        group = one_group_size(k) if self.group_size == -1 else self.group_size
        if self.bits == 8 and not self.symmetric:
            return QuantScheme("int8", group, per_group=True, offsets=True)
        if self.bits == 8:
            return QuantScheme("int8") if self.group_size == -1 else QuantScheme("int8", group, per_group=True)
        if group < 16 or group & (group - 1):
            raise QuantizationConfigError(
                f"GPTQ group_size {self.group_size}: Ferrum's int4 kernels take power-of-two groups of 16 or more")
        params = torch.float16 if self.symmetric else torch.float32
        return QuantScheme("int4", group, self.symmetric, params)

    def tensors(self, module: str) -> dict[str, str]:
        return {role: f"{module}.{role}" for role in ("qweight", "qzeros", "scales", "g_idx")}

    def optional(self, role: str) -> bool:
        return role == "g_idx" and not self.desc_act

    def check(self, module: str, n: int, k: int, infos: Mapping[str, TensorInfo]) -> list[str]:
        per, names, problems = 32 // self.bits, self.tensors(module), list[str]()
        if k % per or n % per:
            problems.append(f"{module}: {n} x {k} does not pack into {self.bits}-bit words of {per}")
            return problems
        groups = self.groups(k)
        if self.group_size != -1 and k % self.group_size:
            problems.append(f"{module}: its {k} inputs do not divide into groups of {self.group_size}")
        expect(problems, infos, names, "qweight", (k // per, n), (torch.int32,))
        expect(problems, infos, names, "qzeros", (groups, n // per), (torch.int32,))
        expect(problems, infos, names, "scales", (groups, n), (torch.float16, torch.bfloat16, torch.float32))
        if "g_idx" in infos or not self.optional("g_idx"):
            expect(problems, infos, names, "g_idx", (k,), (torch.int32, torch.int64))
        return problems

    def repack(self, module: str, n: int, k: int, raw: Mapping[str, torch.Tensor], dtype: torch.dtype) -> Repacked:
        names = self.tensors(module)
        scheme = self.scheme(module, k)
        assert scheme is not None
        groups = self.groups(k)
        q = unpack_int32(raw["qweight"].t(), self.bits)  # [N, K]: the packed dim last
        zeros = unpack_int32(raw["qzeros"], self.bits)[:, :n] + self.zero_offset  # [G, N]
        scales = raw["scales"]
        g_idx = raw.get("g_idx")
        order = None
        if g_idx is not None:
            order = act_order(g_idx, k if self.group_size == -1 else self.group_size, groups, names["g_idx"])
            if order is not None:
                q = q[:, order]
        mid = 1 << (self.bits - 1)
        if self.symmetric and not bool((zeros == mid).all()):
            raise RepackError(f"tensor {names['qzeros']!r}: the config says sym but zero points are not all {mid} "
                              f"(checkpoint_format {self.checkpoint_format!r})")
        if self.bits == 8:
            qweight = (q - mid).to(torch.int8)
            scale = scales.t().float().contiguous() if scheme.per_group else scales[0].float()
            parts = {"qweight": qweight, "scale": scale}
            if scheme.offsets:  # (q - z) s = (q - 128) s + (128 - z) s
                parts["zero"] = ((mid - zeros).t().float() * scale).contiguous()
        else:
            assert scheme.params is not None
            scale = scales.t().to(scheme.params)  # [N, G]
            zero = ((mid - zeros).t().float() * scales.t().float()).to(scheme.params)
            parts = {"qweight": pack_int4_rows(q), "scale": scale.contiguous(), "zero": zero.contiguous()}
        return Repacked(QuantizedTensor(scheme, (n, k), dtype, parts), order)
