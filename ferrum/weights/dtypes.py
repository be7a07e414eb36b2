"""Dtype and shape values as the weights package accepts them: a `torch.dtype` or a name
("float16", "fp16", "half", "bf16", "F32", ...), and a shape as a tuple of non-negative ints.
Also the table between SafeTensors dtype codes and torch dtypes."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

__all__ = ["SAFETENSORS_TO_TORCH", "TORCH_TO_SAFETENSORS", "as_dtype", "as_shape", "dtype_name", "numel"]

_ALIASES: Mapping[str, torch.dtype] = {
    "fp64": torch.float64,
    "f64": torch.float64,
    "f32": torch.float32,
    "f16": torch.float16,
    "i64": torch.int64,
    "i32": torch.int32,
    "i16": torch.int16,
    "i8": torch.int8,
    "u8": torch.uint8,
    "double": torch.float64,
    "fp32": torch.float32,
    "float": torch.float32,
    "fp16": torch.float16,
    "half": torch.float16,
    "bf16": torch.bfloat16,
    "long": torch.int64,
    "int": torch.int32,
    "short": torch.int16,
    "bool": torch.bool,
}


def _optional(name: str) -> torch.dtype | None:
    value = getattr(torch, name, None)
    return value if isinstance(value, torch.dtype) else None


# SafeTensors codes that torch can hold. F4 / F6_* (sub-byte, packed) are known to the header parser but
# have no torch equivalent here, so loading them is refused as unsupported.
SAFETENSORS_TO_TORCH: Mapping[str, torch.dtype] = {
    code: dtype
    for code, dtype in {
        "BOOL": torch.bool,
        "U8": torch.uint8,
        "I8": torch.int8,
        "U16": torch.uint16,
        "I16": torch.int16,
        "U32": torch.uint32,
        "I32": torch.int32,
        "U64": torch.uint64,
        "I64": torch.int64,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "F32": torch.float32,
        "F64": torch.float64,
        "C64": torch.complex64,
        "F8_E5M2": _optional("float8_e5m2"),
        "F8_E4M3": _optional("float8_e4m3fn"),
        "F8_E5M2FNUZ": _optional("float8_e5m2fnuz"),
        "F8_E4M3FNUZ": _optional("float8_e4m3fnuz"),
        "F8_E8M0": _optional("float8_e8m0fnu"),
    }.items()
    if dtype is not None
}
TORCH_TO_SAFETENSORS: Mapping[torch.dtype, str] = {
    dtype: code for code, dtype in SAFETENSORS_TO_TORCH.items()
}


def as_dtype(value: torch.dtype | str) -> torch.dtype:
    """A torch dtype from a dtype or a name: torch attribute names ("bfloat16"), "torch.float16",
    common aliases ("fp16", "bf16", "half") and SafeTensors codes ("F32", "BF16")."""
    if isinstance(value, torch.dtype):
        return value
    if not isinstance(value, str):
        raise TypeError(f"expected a torch.dtype or a dtype name, got {type(value).__name__}: {value!r}")
    key = value.strip().removeprefix("torch.")
    if key in SAFETENSORS_TO_TORCH:
        return SAFETENSORS_TO_TORCH[key]
    lowered = key.lower()
    if lowered in _ALIASES:
        return _ALIASES[lowered]
    found = getattr(torch, lowered, None)
    if isinstance(found, torch.dtype):
        return found
    raise ValueError(f"unknown dtype {value!r}")


def dtype_name(dtype: torch.dtype) -> str:
    """'float16' for torch.float16."""
    return str(dtype).removeprefix("torch.")


def as_shape(value: Iterable[int], *, allow_minus_one: bool = False) -> tuple[int, ...]:
    """A shape as a tuple of ints >= 0 (or -1 once, for a reshape target, when `allow_minus_one`)."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"expected a shape (a sequence of ints), got {value!r}")
    dims = tuple(value)
    for dim in dims:
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"shape {dims!r}: dimension {dim!r} is not an int")
        if dim < 0 and not (allow_minus_one and dim == -1):
            raise ValueError(f"shape {dims!r}: negative dimension {dim}")
    if allow_minus_one and dims.count(-1) > 1:
        raise ValueError(f"shape {dims!r}: at most one dimension may be -1")
    return dims


def numel(shape: Iterable[int]) -> int:
    return math.prod(shape)
