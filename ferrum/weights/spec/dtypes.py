"""Dtype and shape values as the weights package accepts them: a `torch.dtype` or a name
("float16", "fp16", "half", "bf16", "F32", ...; the table is ferrum.dtypes), and a shape as a tuple
of non-negative ints."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from ferrum.dtypes import SAFETENSORS_TO_TORCH, TORCH_TO_SAFETENSORS, dtype_name, parse_dtype

__all__ = ["SAFETENSORS_TO_TORCH", "TORCH_TO_SAFETENSORS", "as_dtype", "as_shape", "dtype_name", "numel"]

def as_dtype(value: torch.dtype | str) -> torch.dtype:
    """A torch dtype from a dtype or any name ferrum.dtypes knows."""
    return parse_dtype(value)


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
