"""compressed-tensors checkpoints (quant_method "compressed-tensors", as llm-compressor writes them).

config_groups name which modules (targets: "Linear", a module name, or "re:" + a regex) carry which
weight scheme; `ignore` lists modules stored unquantized; `format` says how weights are stored. Per
quantized module M (N outputs, K inputs):

    pack-quantized   M.weight_packed int32 [N, K * b / 32] (value j of a word at bits b*j, stored + 2^(b-1)),
                     M.weight_scale [N, G], M.weight_zero_point int32 [N * b / 32, G] (asymmetric; packed
                     along the outputs), M.weight_shape [2], M.weight_g_idx [K] (activation order "group")
    int-quantized    M.weight int8 [N, K], M.weight_scale [N, 1]
    float-quantized  M.weight float8_e4m3fn [N, K], M.weight_scale [N, 1] (channel) or [1] (tensor)
    w = (q - zero_point) * scale, q signed

Served as: 4-bit groups or channels in the seam's int4 (zero = -zero_point * scale; scales and zeros
in the checkpoint's dtype when symmetric, float32 otherwise: exact); 8-bit symmetric integers as int8
and FP8 as fp8, with float32 scales per output row (channel, tensor) or per group of a row's inputs
(group; block: each row takes its row block's). An FP8 group's static per-tensor input_activations
(`dynamic: false`: M.input_scale [1]) are kept as the fp8 scheme's static input scale (see fp8.py);
other activation schemes are read as dynamic: Ferrum's kernels quantize those activations per token;
`k_scale` / `v_scale` of a `kv_cache_scheme` are loaded into each attention layer (`kv_cache_scales`)
for an FP8 KV cache; nothing reads them yet.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ferrum.weights.quantization.published.base import (
    PublishedFormat,
    Repacked,
    TensorInfo,
    act_order,
    expect,
    expect_scalar,
    matching,
    pack_int4_rows,
    static_input_scale,
    unpack_int32,
)
from ferrum.weights.quantization.published.gptq import one_group_size
from ferrum.weights.quantization.scheme import QuantizationConfigError, QuantMethod, QuantScheme
from ferrum.weights.quantization.tensor import QuantizedTensor

__all__ = ["CompressedTensorsFormat"]

_FLOATS = (torch.float16, torch.bfloat16, torch.float32)
_FORMATS = ("pack-quantized", "int-quantized", "float-quantized", "naive-quantized")
_UNUSED_SUFFIXES = (".input_scale", ".input_zero_point", ".k_scale", ".v_scale", ".output_scale",
                    ".input_global_scale")


@dataclass(frozen=True)
class _Group:
    label: str
    targets: tuple[str, ...]
    bits: int
    kind: str  # int | float
    strategy: str  # group | channel | tensor
    group_size: int
    symmetric: bool
    fmt: str
    static_input: bool = False  # FP8 weights with static per-tensor FP8 activations (an input_scale a module)


def _dtype(config: Mapping[str, Any]) -> torch.dtype:
    name = str(config.get("torch_dtype", config.get("dtype", "bfloat16"))).removeprefix("torch.")
    return {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}.get(name, torch.bfloat16)


class CompressedTensorsFormat(PublishedFormat):
    name = "compressed-tensors"

    def __init__(self, config: Mapping[str, Any], model_config: Mapping[str, Any]) -> None:
        default_fmt = str(config.get("format", "dense"))
        self.ignore: tuple[str, ...] = tuple(config.get("ignore") or ())
        self.checkpoint_dtype = _dtype(model_config)
        self.row_blocks: dict[str, int] = {}  # block strategy: rows a scale block spans, by config group
        self.groups: list[_Group] = []
        for label, group in (config.get("config_groups") or {}).items():
            weights = group.get("weights")
            if not weights:
                raise QuantizationConfigError(f"compressed-tensors config group {label!r} quantizes no weights "
                                              "(activation-only schemes are not served)")
            fmt = str(group.get("format") or default_fmt)
            self.groups.append(self._group(label, group.get("targets") or (), weights, fmt,
                                           group.get("input_activations") or {}))
        if not self.groups:
            raise QuantizationConfigError("compressed-tensors quantization_config has no config_groups")
        self.kv_cache = config.get("kv_cache_scheme") is not None

    def _group(self, label: str, targets: Any, weights: Mapping[str, Any], fmt: str,
               activations: Mapping[str, Any]) -> _Group:
        bits, kind = int(weights.get("num_bits", 8)), str(weights.get("type", "int"))
        strategy = str(weights.get("strategy", "tensor"))
        symmetric = bool(weights.get("symmetric", True))
        group_size = int(weights.get("group_size") or 0)
        what = f"compressed-tensors config group {label!r} ({bits}-bit {kind}, {strategy}, format {fmt})"
        if fmt not in _FORMATS:
            raise QuantizationConfigError(f"{what}: format {fmt!r} is not served; Ferrum reads {', '.join(_FORMATS)}")
        if kind == "int" and bits == 4 and strategy in ("group", "channel"):
            pass
        elif kind == "int" and bits == 8 and strategy in ("channel", "group") and symmetric:
            pass
        elif kind == "float" and bits == 8 and strategy in ("channel", "tensor", "group", "block"):
            if strategy == "block":
                block = list(weights.get("block_structure") or ())
                if len(block) != 2:
                    raise QuantizationConfigError(f"{what}: block strategy without a block_structure [rows, inputs]")
                group_size = int(block[1])
                self.row_blocks[label] = int(block[0])
        else:
            raise QuantizationConfigError(
                f"{what}{'' if symmetric else ', asymmetric'}: not served; Ferrum serves 4-bit integer groups or "
                "channels, 8-bit symmetric integer channels or groups and FP8 tensors, channels, groups or "
                "blocks (NVFP4 and MXFP4 "
                "run on vLLM)")
        if strategy in ("group", "block") and (group_size < 16 or group_size & (group_size - 1)):
            raise QuantizationConfigError(f"{what}: groups of {group_size} inputs: Ferrum's kernels take "
                                          "power-of-two groups of 16 or more")
        static = (kind == "float" and bool(activations) and activations.get("dynamic") is False
                  and str(activations.get("type", "")) == "float" and str(activations.get("strategy", "")) == "tensor"
                  and bool(activations.get("symmetric", True)))
        return _Group(label, tuple(targets), bits, kind, strategy, group_size, symmetric, fmt, static)

    @property
    def kv_cache_scales(self) -> bool:
        return self.kv_cache

    def describe(self) -> str:
        kinds = sorted({f"{g.kind}{g.bits} {g.strategy}" + (f" {g.group_size}" if g.strategy in ("group", "block")
                                                              else "") for g in self.groups})
        return f"compressed-tensors ({', '.join(kinds)})"

    def _group_of(self, module: str) -> _Group | None:
        if matching(module, self.ignore):
            return None
        for group in self.groups:
            if "Linear" in group.targets or matching(module, tuple(t for t in group.targets if t != "Linear")):
                return group
        return None

    def scheme(self, module: str, k: int) -> QuantScheme | None:
        group = self._group_of(module)
        if group is None:
            return None
        per_group = group.strategy in ("group", "block")
        if group.kind == "float" or group.bits == 8:
            method: QuantMethod = "fp8" if group.kind == "float" else "int8"
            if per_group:
                return QuantScheme(method, group.group_size, per_group=True, static_input=group.static_input)
            return QuantScheme(method, static_input=group.static_input)
        size = group.group_size if group.strategy == "group" else one_group_size(k)
        return QuantScheme("int4", size, group.symmetric, self.checkpoint_dtype if group.symmetric else torch.float32)

    def tensors(self, module: str) -> dict[str, str]:
        group = self._group_of(module)
        assert group is not None
        roles: tuple[str, ...]
        if group.fmt == "pack-quantized":
            roles = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx")
        else:
            roles = ("weight", "weight_scale", "weight_zero_point", "weight_g_idx")
        if group.static_input:
            roles += ("input_scale",)
        return {role: f"{module}.{role}" for role in roles}

    def optional(self, role: str) -> bool:
        return role in ("weight_zero_point", "weight_shape", "weight_g_idx")

    def check(self, module: str, n: int, k: int, infos: Mapping[str, TensorInfo]) -> list[str]:
        group = self._group_of(module)
        assert group is not None
        names, problems = self.tensors(module), list[str]()
        per = 32 // group.bits
        groups = -(-k // group.group_size) if group.strategy in ("group", "block") else 1
        if group.fmt == "pack-quantized":
            expect(problems, infos, names, "weight_packed", (n, -(-k // per)), (torch.int32,))
        else:
            dtype = torch.float8_e4m3fn if group.kind == "float" else torch.int8
            expect(problems, infos, names, "weight", (n, k), (dtype,))
        scale_shape: tuple[int, ...] = (1,) if group.strategy == "tensor" else (n, groups)
        if group.strategy == "block":
            scale_shape = (-(-n // self.row_blocks[group.label]), groups)
        info = infos.get("weight_scale")
        if info is not None and group.strategy == "tensor" and tuple(info[0]) == ():
            scale_shape = ()
        expect(problems, infos, names, "weight_scale", scale_shape, _FLOATS)
        if info is not None and group.bits == 4 and group.symmetric and info[1] != self.checkpoint_dtype and not (
                info[1] == torch.float16 and self.checkpoint_dtype == torch.float32):
            problems.append(f"tensor {names['weight_scale']!r} is {str(info[1]).removeprefix('torch.')}, but "
                            f"config.json's dtype is {str(self.checkpoint_dtype).removeprefix('torch.')}")
        if not group.symmetric:
            expect(problems, infos, names, "weight_zero_point", (-(-n // per), groups), (torch.int32,))
        elif "weight_zero_point" in infos:
            problems.append(f"tensor {names['weight_zero_point']!r}: the config says symmetric")
        if "weight_g_idx" in infos:
            expect(problems, infos, names, "weight_g_idx", (k,), (torch.int32, torch.int64))
        if group.static_input:
            expect_scalar(problems, infos, names, "input_scale")
        return problems

    def repack(self, module: str, n: int, k: int, raw: Mapping[str, torch.Tensor], dtype: torch.dtype) -> Repacked:
        group = self._group_of(module)
        scheme = self.scheme(module, k)
        assert group is not None and scheme is not None
        scale = raw["weight_scale"]
        if group.strategy == "block":  # each row takes its row block's scales
            scale = scale.repeat_interleave(self.row_blocks[group.label], dim=0)[:n]
        if scheme.method == "fp8":
            if scheme.per_group:
                rows = scale.float()
            else:
                rows = scale.float().reshape(-1).expand(n) if group.strategy == "tensor" else scale.float().reshape(n)
            parts = {"qweight": raw["weight"], "scale": rows.contiguous()}
            if group.static_input:
                parts["input_scale"] = static_input_scale(raw["input_scale"], f"{module}.input_scale", n)
            return Repacked(QuantizedTensor(scheme, (n, k), dtype, parts))
        if group.fmt == "pack-quantized":
            q = unpack_int32(raw["weight_packed"], group.bits)[:, :k]  # unsigned: signed + 2^(b-1)
        else:
            q = raw["weight"].to(torch.int32) + (1 << (group.bits - 1))
        if scheme.method == "int8":
            scale8 = scale.float() if scheme.per_group else scale.float().reshape(n)
            return Repacked(QuantizedTensor(scheme, (n, k), dtype, {
                "qweight": (q - 128).to(torch.int8), "scale": scale8.contiguous()}))
        order = None
        if "weight_g_idx" in raw:
            order = act_order(raw["weight_g_idx"], scheme.group_size, scale.shape[1], f"{module}.weight_g_idx")
            if order is not None:
                q = q[:, order]
        assert scheme.params is not None
        if group.symmetric:
            zero = torch.zeros_like(scale, dtype=scheme.params)
        else:  # packed along the outputs, stored + 8
            zp = unpack_int32(raw["weight_zero_point"].t(), group.bits).t()[:n] - (1 << (group.bits - 1))
            zero = (-zp.float() * scale.float()).to(scheme.params)
        parts = {"qweight": pack_int4_rows(q), "scale": scale.to(scheme.params).contiguous(),
                 "zero": zero.contiguous()}
        return Repacked(QuantizedTensor(scheme, (n, k), dtype, parts), order)

    def unused(self, name: str) -> bool:
        return name.endswith(_UNUSED_SUFFIXES)
