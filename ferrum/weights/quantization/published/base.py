"""What every published checkpoint format answers (`PublishedFormat`), and the integer packings they share.

A published quantized checkpoint stores each quantized linear layer as several tensors (packed values,
scales, zero points, an input order) under the layer's module name, in its own layout. A format says,
per linear module (HF name, e.g. "model.layers.0.self_attn.q_proj"):

    scheme(module, k)        the QuantScheme it is served in (None: stored unquantized, as .weight)
    tensors(module)          role -> checkpoint tensor name, e.g. "qweight" -> "...q_proj.qweight"
    check(...)               what is wrong with those tensors' shapes and dtypes (from the header, before reading)
    repack(...)              the tensors, read, in the seam's layout (QuantizedTensor parts), exactly,
                             and the order of the inputs where the checkpoint reordered them (GPTQ's act order)

and which other tensors it holds that serving does not read (`unused`: e.g. activation scales, which
Ferrum's kernels compute per token). `PublishedLayers` answers for a model's own (fused) layers.
"""

from __future__ import annotations

import abc
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch

from ferrum.weights.quantization.arith import int4_factors, unpack_int4
from ferrum.weights.quantization.scheme import QuantizationConfigError, QuantScheme
from ferrum.weights.quantization.tensor import QuantizedTensor

__all__ = [
    "PublishedFormat",
    "PublishedLayers",
    "RepackError",
    "Repacked",
    "TensorInfo",
    "pack_int4_rows",
    "unpack_int32",
]

TensorInfo = tuple[tuple[int, ...], torch.dtype]
log = logging.getLogger(__name__)


class RepackError(ValueError):
    """A published layer's tensors disagree with its quantization_config; names the tensor and what is wrong."""


@dataclass(frozen=True)
class Repacked:
    """One layer's weight in the seam's layout, and the order its inputs are stored in (None: as given)."""

    weight: QuantizedTensor
    input_order: torch.Tensor | None = None  # int64 [K]: stored input j is the layer's input input_order[j]


class PublishedFormat(abc.ABC):
    """A published checkpoint's quantization (config.json's quantization_config)."""

    name: ClassVar[str]  # vLLM's --quantization name for it
    # a fused layer whose parts are stored in different schemes may be served unquantized (every part can
    # be read dense: `dense`); otherwise it is an error
    dense_fallback: ClassVar[bool] = False

    @property
    def kv_cache_scales(self) -> bool:
        """The checkpoint holds each attention layer's k_scale and v_scale (an FP8 KV cache's scales)."""
        return False

    @abc.abstractmethod
    def describe(self) -> str: ...

    @abc.abstractmethod
    def scheme(self, module: str, k: int) -> QuantScheme | None:
        """How linear module `module` (k input features) is served; None: it is stored unquantized."""

    @abc.abstractmethod
    def tensors(self, module: str) -> dict[str, str]:
        """The checkpoint tensors of quantized module `module`: role -> name (optional ones included)."""

    def optional(self, role: str) -> bool:
        """Whether a role of `tensors` may be absent from the checkpoint."""
        return False

    @abc.abstractmethod
    def check(self, module: str, n: int, k: int, infos: Mapping[str, TensorInfo]) -> list[str]:
        """What is wrong with the module's tensors (role -> (shape, dtype) of those present), as messages
        naming each tensor; empty when they fit the config and an [n, k] weight."""

    @abc.abstractmethod
    def repack(self, module: str, n: int, k: int, raw: Mapping[str, torch.Tensor],
               dtype: torch.dtype) -> Repacked:
        """The module's weight from its tensors (role -> tensor, on the device it is repacked on) in
        `scheme`'s layout, `dtype` the model's; RepackError naming a tensor whose values are wrong."""

    def common_scheme(self, schemes: list[QuantScheme | None]) -> QuantScheme | None:
        """One scheme that holds every one of these parts' repacked weights exactly (`widen`), for a fused
        layer whose parts the checkpoint stores differently; None: there is none (the default)."""
        return None

    def unused(self, name: str) -> bool:
        """A checkpoint tensor of the format that serving does not read (it is not an unknown tensor);
        `name` as stored."""
        return False

    def stored_name(self, name: str) -> str:
        """The name the checkpoint stores HF tensor `name` under (GGUF's own names)."""
        return name

    def checkpoint_name(self, stored: str) -> str | None:
        """The HF name of stored tensor `stored` (None: it has none, e.g. GGUF's rope_freqs)."""
        return stored

    def dense(self, name: str, stored: TensorInfo) -> DenseTensor:
        """How HF tensor `name`, served unquantized, is read from its stored (shape, dtype)."""
        return DenseTensor(tuple(stored[0]))


@dataclass(frozen=True)
class DenseTensor:
    """A tensor served unquantized from a published checkpoint: its logical shape, the block type to
    dequantize it from (None: stored as a plain tensor) and the heads whose row halves to put back in
    HF order (GGUF's llama attn_q / attn_k; None: in order)."""

    shape: tuple[int, ...]
    dequantize: str | None = None
    interleaved_heads: int | None = None


def expect(problems: list[str], infos: Mapping[str, TensorInfo], tensors: Mapping[str, str], role: str,
           shape: tuple[int, ...], dtypes: tuple[torch.dtype, ...]) -> None:
    """Appends what is wrong with tensor `role` against `shape` and one of `dtypes` (missing, shape, dtype)."""
    info = infos.get(role)
    name = tensors[role]
    if info is None:
        problems.append(f"tensor {name!r} is missing")
        return
    got_shape, got_dtype = info
    if tuple(got_shape) != tuple(shape):
        problems.append(f"tensor {name!r} has shape {tuple(got_shape)}, expected {tuple(shape)}")
    if got_dtype not in dtypes:
        wanted = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
        problems.append(f"tensor {name!r} is {str(got_dtype).removeprefix('torch.')}, expected {wanted}")


def expect_scalar(problems: list[str], infos: Mapping[str, TensorInfo], tensors: Mapping[str, str], role: str) -> None:
    """expect() for a per-tensor scale: shape [] or [1], a float dtype."""
    info = infos.get(role)
    expect(problems, infos, tensors, role, () if info is not None and tuple(info[0]) == () else (1,),
           (torch.float32, torch.bfloat16, torch.float16))


def static_input_scale(scale: torch.Tensor, name: str, rows: int) -> torch.Tensor:
    """A checkpoint's static activation scale (tensor `name`, one value) as float32 [rows], the layer's
    `input_scale` part; RepackError unless it is finite and positive."""
    value = scale.float().reshape(1)
    if not bool(torch.isfinite(value).all()) or float(value[0]) <= 0:
        raise RepackError(f"tensor {name!r}: a static input scale must be finite and positive, got {float(value[0])}")
    return value.expand(rows).contiguous()


def unpack_int32(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words [..., W] -> their values [..., W * 32 / bits] (int32, 0 .. 2^bits - 1): value j of a
    word in bits [bits * j, bits * (j + 1)), as GPTQ, AWQ (before its column order) and compressed-tensors pack."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, device=packed.device, dtype=torch.int32)
    values = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    return values.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def pack_int4_rows(q: torch.Tensor) -> torch.Tensor:
    """Values 0..15 [N, K] (K even) -> the seam's uint8 [N, K/2] (input 2j low nibble, 2j + 1 high)."""
    q8 = q.to(torch.uint8)
    return q8[:, 0::2] | (q8[:, 1::2] << 4)


def widen(weight: QuantizedTensor, target: QuantScheme) -> QuantizedTensor:
    """`weight` in `target`, a scheme that holds it exactly: int4 or int8 (with or without zeros) into int8
    with a float32 scale (and zero) per group of `target.group_size`, which divides the weight's own group
    size; int4's codes u become u - 8; Q4_K's sub-scales into int4 with float32 scales and zeros
    (QuantScheme.expanded). RepackError where `target` cannot hold it exactly."""
    scheme = weight.scheme
    if scheme == target:
        return weight
    if scheme.sub_scales and target == scheme.expanded():  # Q4_K's factors as float32 scales and zeros
        factors = int4_factors(weight)
        return QuantizedTensor(target, weight.shape, weight.dtype, {
            "qweight": weight.parts["qweight"], "scale": factors[0].float().contiguous(),
            "zero": factors[1].float().contiguous()})
    zeros = scheme.offsets or (scheme.method == "int4" and not scheme.symmetric)  # symmetric int4's are 0
    g, g2 = scheme.group_size, target.group_size
    if (target.method != "int8" or not target.per_group or (zeros and not target.offsets) or g % g2
            or scheme.method not in ("int4", "int8") or (scheme.method == "int8" and not scheme.per_group)):
        raise RepackError(f"a {scheme.describe()} weight cannot be held exactly as {target.describe()}")
    q = weight.parts["qweight"]
    codes = (unpack_int4(q).to(torch.int16) - 8).to(torch.int8) if scheme.method == "int4" else q
    groups = -(-weight.shape[1] // g2)

    def per_target_group(part: torch.Tensor) -> torch.Tensor:
        return part.float().repeat_interleave(g // g2, dim=1)[:, :groups].contiguous()

    scale, zero = int4_factors(weight) if scheme.method == "int4" else (weight.parts["scale"], weight.parts.get("zero"))
    parts = {"qweight": codes.contiguous(), "scale": per_target_group(scale)}
    if target.offsets:
        parts["zero"] = per_target_group(zero) if zero is not None and zeros else torch.zeros_like(parts["scale"])
    return QuantizedTensor(target, weight.shape, weight.dtype, parts)


def act_order(g_idx: torch.Tensor, group: int, groups: int, name: str) -> torch.Tensor | None:
    """The order that sorts inputs by their group index `g_idx` [K] (GPTQ's act order), None when it is
    already k // group; RepackError naming tensor `name` for indices out of range or groups not each of
    `group` inputs."""
    g_idx = g_idx.to(torch.int64)
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= groups:
        raise RepackError(f"tensor {name!r}: group indices {int(g_idx.min())}..{int(g_idx.max())} are out of "
                          f"range for {groups} groups")
    plain = torch.arange(g_idx.shape[0], device=g_idx.device) // group
    if torch.equal(g_idx, plain):
        return None
    order = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[order], plain):
        raise RepackError(f"tensor {name!r}: its groups do not each hold {group} inputs (act order may only "
                          "reorder the inputs)")
    return order


def matching(name: str, targets: tuple[str, ...]) -> bool:
    """Whether module `name` is named by one of `targets`: equal, a suffix after a dot, or "re:" + a regex
    matched from the start (compressed-tensors' and FP8 configs' ignore lists)."""
    import re

    for target in targets:
        if target.startswith("re:"):
            if re.match(target[3:], name):
                return True
        elif name == target or name.endswith("." + target):
            return True
    return False


class PublishedLayers:
    """A published format's schemes for a model's own linear layers: a fused projection (qkv_proj,
    gate_up_proj) takes the one scheme of the checkpoint modules it is made of (`modules(path)`)."""

    def __init__(self, fmt: PublishedFormat, modules: Callable[[str], list[str]]) -> None:
        self.format = fmt
        self.modules = modules

    def describe(self) -> str:
        return self.format.describe()

    def scheme_for(self, path: str, in_features: int) -> QuantScheme | None:
        names = self.modules(path)
        schemes = {name: self.format.scheme(name, in_features) for name in names}
        distinct = set(schemes.values())
        if len(distinct) > 1:
            listed = "; ".join(f"{name}: {s.describe() if s else 'unquantized'}" for name, s in schemes.items())
            common = self.format.common_scheme(list(schemes.values()))
            if common is not None:
                log.info("%s: its parts are stored in different formats (%s): served as %s, which holds each "
                         "exactly", path, listed, common.describe())
                return common
            if self.format.dense_fallback:
                log.warning("%s: its parts are stored in different formats (%s): served unquantized, dequantized "
                            "at load", path, listed)
                return None
            raise QuantizationConfigError(
                f"{path} is made of {', '.join(names)}, which the checkpoint stores differently ({listed}); "
                "Ferrum fuses them into one layer and needs one scheme")
        return distinct.pop()
