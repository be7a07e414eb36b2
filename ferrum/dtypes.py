"""The one table of dtypes Ferrum knows: names and aliases to torch dtypes, SafeTensors codes, and
which of them a model may be served in.

    parse_dtype("bf16")        torch.bfloat16 (torch names, "torch.float16", aliases, SafeTensors codes)
    dtype_name(torch.float16)  "float16"
    SERVING_DTYPES             the dtypes weights and activations may be kept in: float32, bfloat16, float16

Every other module (backends, weights, models, engine, config) takes its dtypes from here.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

import torch

__all__ = [
    "ALIASES",
    "SAFETENSORS_TO_TORCH",
    "SERVING_DTYPES",
    "TORCH_TO_SAFETENSORS",
    "dtype_name",
    "dtype_names",
    "parse_dtype",
    "serving_dtype",
]


def _optional(name: str) -> torch.dtype | None:
    value = getattr(torch, name, None)
    return value if isinstance(value, torch.dtype) else None


# Short names people write in configs and on the command line (lower case).
ALIASES: Mapping[str, torch.dtype] = MappingProxyType(
    {
        "fp64": torch.float64,
        "f64": torch.float64,
        "double": torch.float64,
        "fp32": torch.float32,
        "f32": torch.float32,
        "float": torch.float32,
        "fp16": torch.float16,
        "f16": torch.float16,
        "half": torch.float16,
        "bf16": torch.bfloat16,
        "fp8": torch.float8_e4m3fn,  # the usual fp8 of inference weights and activations
        "i64": torch.int64,
        "long": torch.int64,
        "i32": torch.int32,
        "int": torch.int32,
        "i16": torch.int16,
        "short": torch.int16,
        "i8": torch.int8,
        "u8": torch.uint8,
        "bool": torch.bool,
    }
)

# SafeTensors codes that torch can hold. F4 / F6_* (sub-byte, packed) are known to the header parser
# but have no torch equivalent here, so loading them is refused as unsupported.
SAFETENSORS_TO_TORCH: Mapping[str, torch.dtype] = MappingProxyType(
    {
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
)
TORCH_TO_SAFETENSORS: Mapping[torch.dtype, str] = MappingProxyType(
    {dtype: code for code, dtype in SAFETENSORS_TO_TORCH.items()}
)

SERVING_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


def parse_dtype(value: torch.dtype | str) -> torch.dtype:
    """A torch dtype from a dtype or a name: torch attribute names ("bfloat16"), "torch.float16",
    aliases ("fp16", "bf16", "half", "fp8") and SafeTensors codes ("F32", "BF16"); ValueError if
    unknown, TypeError if not a string."""
    if isinstance(value, torch.dtype):
        return value
    if not isinstance(value, str):
        raise TypeError(f"expected a torch.dtype or a dtype name, got {type(value).__name__}: {value!r}")
    key = value.strip().removeprefix("torch.")
    if key in SAFETENSORS_TO_TORCH:
        return SAFETENSORS_TO_TORCH[key]
    lowered = key.lower()
    if lowered in ALIASES:
        return ALIASES[lowered]
    found = getattr(torch, lowered, None)
    if isinstance(found, torch.dtype):
        return found
    raise ValueError(f"unknown dtype {value!r}")


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a dtype: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


def dtype_names(dtypes: Iterable[torch.dtype]) -> str:
    """Sorted, comma-separated canonical names, or "none"."""
    names = sorted(dtype_name(dtype) for dtype in dtypes)
    return ", ".join(names) if names else "none"


def serving_dtype(value: str | torch.dtype) -> torch.dtype:
    """A dtype a model may be served in (float32, bfloat16, float16, by any of their names);
    ValueError naming the valid ones otherwise."""
    try:
        dtype = parse_dtype(value)
    except (TypeError, ValueError):
        dtype = None
    if dtype not in SERVING_DTYPES:
        valid = ", ".join(dtype_name(d) for d in SERVING_DTYPES)
        raise ValueError(f"dtype must be auto, {valid} (or fp32, bf16, fp16), got {value!r}")
    return dtype
