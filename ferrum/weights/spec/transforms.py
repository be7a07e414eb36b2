"""Tensor transformations a TensorSpec applies, in order, after reading and before the final check:

    Transpose(dims=None)            numpy.transpose semantics: a permutation of all dims; None reverses them
    Reshape(shape)                  one dim may be -1
    Cast(dtype)
    Scale(factor)                   floating / complex tensors only (Cast first for integers)
    Slice(dim, start, end=None, step=1)   Python slice semantics along one dim, step >= 1
    Quantize(method)                refused: quantization is not yet supported

Transformations never write into their input (which may be a read-only or shared memory map). A
pipeline that did anything ends with `.contiguous()` (a no-op when already contiguous).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ferrum.weights.errors import SpecMismatchError, TransformError, UnsupportedError
from ferrum.weights.spec.dtypes import as_dtype, as_shape, dtype_name

__all__ = [
    "Cast",
    "Quantize",
    "Reshape",
    "Scale",
    "Slice",
    "TensorTransformation",
    "Transpose",
    "apply_transformations",
    "check_result",
]


class TensorTransformation(abc.ABC):
    """A step from one tensor to the next. `where` (the file) and `name` (the tensor) are for errors."""

    @abc.abstractmethod
    def apply(self, tensor: torch.Tensor, *, where: str, name: str) -> torch.Tensor: ...

    def ensure_supported(self, *, where: str, name: str) -> None:
        """Raises UnsupportedError before any I/O when this transformation cannot run at all; every
        transformation can by default."""
        return


def _dim(tensor: torch.Tensor, dim: int, step: TensorTransformation, where: str, name: str) -> int:
    if not -tensor.dim() <= dim < max(tensor.dim(), 1):
        raise TransformError(
            where, f"tensor {name!r}: {step!r}: dim {dim} is out of range for shape {tuple(tensor.shape)}"
        )
    return dim % max(tensor.dim(), 1)


@dataclass(frozen=True)
class Transpose(TensorTransformation):
    dims: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.dims is not None:
            dims = tuple(self.dims)
            if any(isinstance(d, bool) or not isinstance(d, int) for d in dims):
                raise TypeError(f"Transpose: dims must be ints, got {self.dims!r}")
            object.__setattr__(self, "dims", dims)

    def apply(self, tensor: torch.Tensor, *, where: str, name: str) -> torch.Tensor:
        if self.dims is None:
            return tensor.permute(*reversed(range(tensor.dim())))
        n = tensor.dim()
        if len(self.dims) != n or sorted(d % n if -n <= d < n else -1 for d in self.dims) != list(range(n)):
            raise TransformError(
                where,
                f"tensor {name!r}: {self!r}: dims must be a permutation of the {n} dims of shape {tuple(tensor.shape)}",
            )
        return tensor.permute(*self.dims)


@dataclass(frozen=True)
class Reshape(TensorTransformation):
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", as_shape(self.shape, allow_minus_one=True))

    def apply(self, tensor: torch.Tensor, *, where: str, name: str) -> torch.Tensor:
        try:
            return tensor.reshape(self.shape)
        except RuntimeError:
            raise TransformError(
                where,
                f"tensor {name!r}: {self!r}: cannot reshape {tuple(tensor.shape)} ({tensor.numel()} elements) "
                f"to {self.shape}",
            ) from None


@dataclass(frozen=True)
class Cast(TensorTransformation):
    dtype: torch.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", as_dtype(self.dtype))

    def apply(self, tensor: torch.Tensor, *, where: str, name: str) -> torch.Tensor:
        if tensor.is_complex() and not self.dtype.is_complex:
            raise TransformError(
                where,
                f"tensor {name!r}: {self!r}: casting complex to {dtype_name(self.dtype)} would drop data",
            )
        return tensor.to(self.dtype)


@dataclass(frozen=True)
class Scale(TensorTransformation):
    factor: float

    def __post_init__(self) -> None:
        if isinstance(self.factor, bool) or not isinstance(self.factor, (int, float)):
            raise TypeError(f"Scale: factor must be a number, got {self.factor!r}")
        if not math.isfinite(self.factor):
            raise ValueError(f"Scale: factor must be finite, got {self.factor!r}")

    def apply(self, tensor: torch.Tensor, *, where: str, name: str) -> torch.Tensor:
        if not (tensor.is_floating_point() or tensor.is_complex()):
            raise TransformError(
                where,
                f"tensor {name!r}: {self!r}: needs a floating tensor, got {dtype_name(tensor.dtype)} (Cast first)",
            )
        return tensor * self.factor


@dataclass(frozen=True)
class Slice(TensorTransformation):
    dim: int
    start: int | None = None
    end: int | None = None
    step: int = 1

    def __post_init__(self) -> None:
        for label, value in (
            ("dim", self.dim),
            ("step", self.step),
            ("start", self.start),
            ("end", self.end),
        ):
            optional = label in ("start", "end")
            if (value is not None or not optional) and (
                isinstance(value, bool) or not isinstance(value, int)
            ):
                raise TypeError(
                    f"Slice: {label} must be an int{' or None' if optional else ''}, got {value!r}"
                )
        if self.step < 1:
            raise ValueError(f"Slice: step must be >= 1, got {self.step}")

    def apply(self, tensor: torch.Tensor, *, where: str, name: str) -> torch.Tensor:
        if tensor.dim() == 0:
            raise TransformError(where, f"tensor {name!r}: {self!r}: cannot slice a 0-dim tensor")
        dim = _dim(tensor, self.dim, self, where, name)
        index: Sequence[slice] = (slice(None),) * dim + (slice(self.start, self.end, self.step),)
        return tensor[tuple(index)]


@dataclass(frozen=True)
class Quantize(TensorTransformation):
    method: str

    def ensure_supported(self, *, where: str, name: str) -> None:
        raise UnsupportedError(
            where, f"tensor {name!r}: quantization is not yet supported (Quantize method {self.method!r})"
        )

    def apply(self, tensor: torch.Tensor, *, where: str, name: str) -> torch.Tensor:
        self.ensure_supported(where=where, name=name)
        return tensor


def apply_transformations(
    tensor: torch.Tensor, transformations: Sequence[TensorTransformation], *, where: str, name: str
) -> torch.Tensor:
    for step in transformations:
        tensor = step.apply(tensor, where=where, name=name)
    return tensor.contiguous() if transformations else tensor


def check_result(
    tensor: torch.Tensor,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    where: str,
    name: str,
    transformations: Sequence[TensorTransformation] = (),
) -> None:
    """SpecMismatchError naming the tensor, the expected and the actual shape / dtype."""
    actual_shape = tuple(tensor.shape)
    if actual_shape == tuple(shape) and tensor.dtype == dtype:
        return
    after = f" after {', '.join(map(repr, transformations))}" if transformations else ""
    problems = []
    if actual_shape != tuple(shape):
        problems.append(f"shape {tuple(shape)} expected, got {actual_shape}")
    if tensor.dtype != dtype:
        problems.append(f"dtype {dtype_name(dtype)} expected, got {dtype_name(tensor.dtype)}")
    raise SpecMismatchError(where, f"tensor {name!r}{after}: {'; '.join(problems)}")
