"""What a compute backend offers, what a deployment asks of one, and how the two are compared.

Device strings follow one grammar everywhere in `ferrum.backends`: "cpu", "mps", "cuda" or
"cuda:N". A bare kind in a requirement ("cuda") is served by any device of that kind; an indexed
one ("cuda:1") only by that exact device. Quantization methods are named as the served model's
`quantization.method` names them ("int8", "int4", "fp8"; ferrum.weights.quantization.scheme).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType

import torch

from ferrum.dtypes import ALIASES, dtype_name, dtype_names
from ferrum.dtypes import parse_dtype as _parse_dtype

DEVICE_KINDS: tuple[str, ...] = ("cuda", "mps", "cpu")
VALID_DEVICE_FORMS = "cpu, mps, cuda, cuda:N"

__all__ = ["BackendCapabilities", "BackendRequirements", "device_is_served", "dtype_name", "dtype_names",
           "parse_device", "parse_dtype"]


def parse_dtype(name: str) -> torch.dtype:
    """A dtype from a config name such as "bf16" or "float32" (ferrum.dtypes); ValueError if unknown."""
    try:
        return _parse_dtype(name)
    except (TypeError, ValueError):
        raise ValueError(f"unknown dtype {name!r}; valid names: {', '.join(ALIASES)} or a torch dtype name") from None


def parse_device(device: str) -> tuple[str, int | None]:
    """Split a device string into (kind, index); only "cuda" takes an index. ValueError if malformed."""
    if not isinstance(device, str):
        raise ValueError(f"device must be a string, got {device!r}")
    kind, separator, index_text = device.partition(":")
    if kind not in DEVICE_KINDS:
        raise ValueError(f"unknown device {device!r}; valid forms: {VALID_DEVICE_FORMS}")
    if not separator:
        return kind, None
    if kind != "cuda" or not index_text.isdigit() or not index_text.isascii():
        raise ValueError(f"malformed device {device!r}; valid forms: {VALID_DEVICE_FORMS}")
    return kind, int(index_text)


def device_is_served(requested: str, offered_devices: Iterable[str]) -> bool:
    """Whether `requested` ("cuda" or "cuda:1", say) is one of, or names the kind of, `offered_devices`."""
    requested_kind, requested_index = parse_device(requested)
    for offered in offered_devices:
        offered_kind, offered_index = parse_device(offered)
        if offered_kind == requested_kind and (requested_index is None or requested_index == offered_index):
            return True
    return False


def _empty_extras() -> Mapping[str, object]:
    return MappingProxyType({})


@dataclass(frozen=True)
class BackendRequirements:
    """What a deployment needs from a backend; the defaults ask for nothing."""

    devices: tuple[str, ...] = ()
    dtypes: tuple[torch.dtype, ...] = ()
    min_batch_size: int = 1
    min_sequence_length: int = 1
    requires_flash_attention: bool = False
    requires_paged_attention: bool = False
    tensor_parallel_size: int = 1  # devices the model is split across (set from the engine config)
    quantization: tuple[str, ...] = ()  # weight quantization methods the backend must run ("int4", ...)

    def __post_init__(self) -> None:
        for device in self.devices:
            parse_device(device)
        object.__setattr__(self, "quantization", tuple(self.quantization))
        for method in self.quantization:
            if not isinstance(method, str) or not method or method != method.strip().lower():
                raise ValueError(f"quantization must hold lower-case method names, got {method!r}")
        for dtype in self.dtypes:
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"dtypes must hold torch.dtype values, got {dtype!r}")
        for name in ("min_batch_size", "min_sequence_length", "tensor_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, object]) -> BackendRequirements:
        """Parse a YAML-style mapping, e.g. {"devices": ["cuda"], "dtypes": ["bf16"], "quantization": ["int4"]}.

        `devices`, `dtypes` and `quantization` take a list or a single string. Any unknown key or bad value raises
        ValueError naming the key.
        """
        if not isinstance(mapping, Mapping):
            raise ValueError(f"backend requirements must be a mapping, got {type(mapping).__name__}")
        known_keys = [requirement_field.name for requirement_field in fields(cls)]
        unknown_keys = sorted(str(key) for key in mapping if key not in known_keys)
        if unknown_keys:
            raise ValueError(
                f"unknown backend requirement key(s) {', '.join(map(repr, unknown_keys))}; "
                f"valid keys: {', '.join(known_keys)}"
            )
        parsed: dict[str, object] = {}
        for key, value in mapping.items():
            try:
                parsed[key] = _parse_requirement_value(key, value)
            except ValueError as error:
                raise ValueError(f"backend requirement {key!r}: {error}") from None
        return cls(**parsed)  # type: ignore[arg-type]


def _parse_requirement_value(key: str, value: object) -> object:
    if key == "devices":
        devices = _string_list(value)
        for device in devices:
            parse_device(device)
        return devices
    if key == "dtypes":
        return tuple(parse_dtype(name) for name in _string_list(value))
    if key == "quantization":
        return tuple(dict.fromkeys(name.strip().lower() for name in _string_list(value)))
    if key in ("min_batch_size", "min_sequence_length", "tensor_parallel_size"):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"must be a positive integer, got {value!r}")
        return value
    if not isinstance(value, bool):
        raise ValueError(f"must be true or false, got {value!r}")
    return value


def _string_list(value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        return tuple(value)
    raise ValueError(f"must be a string or a list of strings, got {value!r}")


@dataclass(frozen=True)
class BackendCapabilities:
    """What one backend offers, as probed (or, for tests, as declared)."""

    supported_dtypes: frozenset[torch.dtype]
    devices: tuple[str, ...]
    max_batch_size: int
    max_sequence_length: int
    supports_fp16: bool
    supports_bf16: bool
    supports_int8: bool
    flash_attention: bool
    paged_attention: bool
    cuda_graphs: bool
    memory_alignment: int  # bytes
    total_memory_bytes: int
    free_memory_bytes: int
    # tensor parallelism: whether a model can be split across devices from this backend's one, and
    # across how many at most (this device and the ones after it; the CPU's ranks share its cores)
    supports_tensor_parallelism: bool = False
    max_tensor_parallel_size: int = 1
    # weight quantization methods the backend runs ("int8", "int4", "fp8"), and, for a method it would
    # run on other hardware, what this device lacks: {"fp8": "fp8 needs compute capability 8.9; ..."}
    quantization: frozenset[str] = frozenset()
    quantization_needs: Mapping[str, str] = field(default_factory=lambda: MappingProxyType({}), hash=False)
    extras: Mapping[str, object] = field(default_factory=_empty_extras, hash=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "supported_dtypes", frozenset(self.supported_dtypes))
        object.__setattr__(self, "quantization", frozenset(self.quantization))
        object.__setattr__(self, "quantization_needs", MappingProxyType(dict(self.quantization_needs)))
        object.__setattr__(self, "devices", tuple(self.devices))
        object.__setattr__(self, "extras", MappingProxyType(dict(self.extras)))
        for device in self.devices:
            parse_device(device)
        for flag_name, dtype in (
            ("supports_fp16", torch.float16),
            ("supports_bf16", torch.bfloat16),
            ("supports_int8", torch.int8),
        ):
            if getattr(self, flag_name) != (dtype in self.supported_dtypes):
                supported = dtype_names(self.supported_dtypes)
                raise ValueError(f"{flag_name} disagrees with supported_dtypes ({supported})")
        for name in ("max_batch_size", "max_sequence_length", "memory_alignment", "max_tensor_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.memory_alignment & (self.memory_alignment - 1):
            raise ValueError(f"memory_alignment must be a power of two, got {self.memory_alignment}")
        if not 0 <= self.free_memory_bytes <= self.total_memory_bytes:
            raise ValueError(
                f"need 0 <= free_memory_bytes <= total_memory_bytes, "
                f"got {self.free_memory_bytes} and {self.total_memory_bytes}"
            )

    def meets_requirements(self, requirements: BackendRequirements) -> bool:
        return not self.unmet_requirements(requirements)

    def unmet_requirements(self, requirements: BackendRequirements) -> list[str]:
        """One human-readable line per requirement these capabilities fail; empty when all are met."""
        unmet: list[str] = []
        offered_devices = ", ".join(self.devices) or "none"
        supported_dtypes = dtype_names(self.supported_dtypes)
        for device in requirements.devices:
            if not device_is_served(device, self.devices):
                unmet.append(f"requires device {device}, has {offered_devices}")
        for dtype in requirements.dtypes:
            if dtype not in self.supported_dtypes:
                unmet.append(f"requires dtype {dtype_name(dtype)}, supports {supported_dtypes}")
        if requirements.min_batch_size > self.max_batch_size:
            unmet.append(
                f"requires batch size {requirements.min_batch_size}, max batch size is {self.max_batch_size}"
            )
        if requirements.min_sequence_length > self.max_sequence_length:
            unmet.append(
                f"requires sequence length {requirements.min_sequence_length}, "
                f"max sequence length is {self.max_sequence_length}"
            )
        if requirements.requires_flash_attention and not self.flash_attention:
            unmet.append("requires flash attention, not supported")
        if requirements.requires_paged_attention and not self.paged_attention:
            unmet.append("requires paged attention, not supported")
        tp = requirements.tensor_parallel_size
        if tp > 1 and not self.supports_tensor_parallelism:
            unmet.append(f"requires tensor parallelism over {tp} devices, not supported")
        elif tp > self.max_tensor_parallel_size:
            unmet.append(f"requires tensor parallelism over {tp} devices, can span {self.max_tensor_parallel_size}")
        for method in requirements.quantization:
            if method not in self.quantization:
                unmet.append(self.quantization_refusal(method))
        return unmet

    def quantization_refusal(self, method: str) -> str:
        """Why weights quantized with `method` cannot run here (the device's shortfall where known)."""
        if method in self.quantization_needs:
            return f"requires quantization {method}: {self.quantization_needs[method]}"
        return f"requires quantization {method}, runs {', '.join(sorted(self.quantization)) or 'none'}"
