"""Tensor transformations a TensorSpec applies, in order, after reading and before the final check:

    Transpose(dims=None)            numpy.transpose semantics: a permutation of all dims; None reverses them
    Reshape(shape)                  one dim may be -1
    Cast(dtype)
    Scale(factor)                   floating / complex tensors only (Cast first for integers)
    Slice(dim, start, end=None, step=1)   Python slice semantics along one dim, step >= 1
    Dequantize(block_type)          raw GGUF blocks uint8 [..., bytes per row] -> float32 [..., values per row]
                                    (ggml's own dequantization, gguf-py's: Q8_0, Q5_K, Q6_K, ...)
    Quantize(scheme, compute_device="cpu", kernel=None)   the last step only: a floating [N, K] tensor
                                    becomes a QuantizedTensor (packed values, scales, zeros), computed
                                    on `compute_device` (the model's GPU, where it has one), by
                                    `kernel` where it takes the scheme

Transformations never write into their input (which may be a read-only or shared memory map). A
pipeline that did anything ends with `.contiguous()` (a no-op when already contiguous); one that ends
in Quantize yields the QuantizedTensor instead, its shape and dtype the logical [N, K] and the
full-precision dtype it was made from.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ferrum.weights.errors import SpecMismatchError, TransformError, UnsupportedError
from ferrum.weights.quantization.arith import QuantizeKernel, quantize
from ferrum.weights.quantization.scheme import QuantizationConfigError, QuantScheme
from ferrum.weights.quantization.tensor import QuantizedTensor
from ferrum.weights.spec.dtypes import as_dtype, as_shape, dtype_name

__all__ = [
    "Cast",
    "Dequantize",
    "Quantize",
    "Reshape",
    "Scale",
    "Slice",
    "TensorTransformation",
    "Transpose",
    "apply_transformations",
    "check_order",
    "check_result",
    "final_quantize",
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
class Dequantize(TensorTransformation):
    """A GGUF tensor's raw blocks (uint8 rows) to the float32 values they stand for, by gguf-py's
    dequantization of `block_type` (a ggml type name, e.g. "Q6_K")."""

    block_type: str

    def __post_init__(self) -> None:
        from gguf import GGMLQuantizationType

        if self.block_type not in GGMLQuantizationType.__members__:
            raise ValueError(f"Dequantize: unknown ggml type {self.block_type!r}")

    def apply(self, tensor: torch.Tensor, *, where: str, name: str) -> torch.Tensor:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import dequantize

        kind = GGMLQuantizationType[self.block_type]
        size = GGML_QUANT_SIZES[kind][1]
        if tensor.dtype != torch.uint8 or tensor.dim() == 0 or tensor.shape[-1] % size:
            raise TransformError(where, f"tensor {name!r}: {self!r}: needs uint8 rows of whole {size}-byte blocks, "
                                 f"got {tuple(tensor.shape)} {dtype_name(tensor.dtype)}")
        try:
            values = dequantize(tensor.contiguous().numpy(), kind)
        except NotImplementedError:
            raise TransformError(where, f"tensor {name!r}: gguf-py cannot dequantize {self.block_type}") from None
        return torch.from_numpy(values.astype("float32", copy=False))


@dataclass(frozen=True)
class Quantize(TensorTransformation):
    """The last step of a spec: its floating [N, K] tensor in `scheme`'s stored layout, quantized in
    float32 on `compute_device` (the tensor is moved there first; the parts stay there), by `kernel`
    where it takes the scheme (a faster implementation of the same arithmetic)."""

    scheme: QuantScheme
    compute_device: str = "cpu"
    kernel: QuantizeKernel | None = field(default=None, compare=False, repr=False)

    def __repr__(self) -> str:
        on = f", on {self.compute_device}" if self.compute_device != "cpu" else ""
        return f"Quantize({self.scheme.describe()}{on})"

    def __post_init__(self) -> None:
        if not isinstance(self.scheme, QuantScheme):
            raise TypeError(f"Quantize: scheme must be a QuantScheme, got {self.scheme!r}")
        if self.compute_device != "cpu":
            object.__setattr__(self, "compute_device", str(torch.device(self.compute_device)))

    def ensure_supported(self, *, where: str, name: str) -> None:
        from ferrum.backends.registry import device_kind_available

        kind = torch.device(self.compute_device).type
        if not device_kind_available(kind):
            raise UnsupportedError(
                where, f"tensor {name!r}: {self!r}: quantizing on {self.compute_device} needs a {kind} device, "
                "which is not here"
            )

    def check_spec(self, shape: tuple[int, ...], dtype: torch.dtype, *, where: str, name: str) -> None:
        """TransformError unless a spec of `shape` and `dtype` (the logical weight) can be quantized."""
        if len(shape) != 2 or not dtype.is_floating_point:
            raise TransformError(
                where, f"tensor {name!r}: {self!r} makes a floating [N, K] weight; the spec says "
                f"{shape} {dtype_name(dtype)}"
            )
        self._check_in_features(shape[1], where=where, name=name)

    def apply(self, tensor: torch.Tensor, *, where: str, name: str) -> torch.Tensor:
        raise TransformError(where, f"tensor {name!r}: {self!r} must be the last transformation")

    def quantize(self, tensor: torch.Tensor, *, where: str, name: str) -> QuantizedTensor:
        if tensor.dim() != 2 or not tensor.is_floating_point():
            raise TransformError(
                where, f"tensor {name!r}: {self!r}: needs a floating [N, K] tensor, got "
                f"{tuple(tensor.shape)} {dtype_name(tensor.dtype)}"
            )
        self._check_in_features(tensor.shape[1], where=where, name=name)
        if self.compute_device != "cpu":
            tensor = tensor.to(self.compute_device)
        return quantize(tensor, self.scheme, self.kernel)

    def _check_in_features(self, k: int, *, where: str, name: str) -> None:
        try:
            self.scheme.check_in_features(k, f"tensor {name!r}")
        except QuantizationConfigError as exc:
            raise TransformError(where, str(exc)) from None


def final_quantize(transformations: Sequence[TensorTransformation]) -> Quantize | None:
    """The Quantize that ends `transformations`, if one does."""
    last = transformations[-1] if transformations else None
    return last if isinstance(last, Quantize) else None


def check_order(transformations: Sequence[TensorTransformation], *, where: str, name: str) -> None:
    """TransformError when a Quantize is anywhere but last (it yields a QuantizedTensor, which no
    further transformation takes)."""
    for step in transformations[:-1]:
        if isinstance(step, Quantize):
            raise TransformError(
                where, f"tensor {name!r}: {step!r} must be the last transformation, "
                f"not before {transformations[-1]!r}"
            )


def apply_transformations(
    tensor: torch.Tensor, transformations: Sequence[TensorTransformation], *, where: str, name: str
) -> torch.Tensor | QuantizedTensor:
    """The tensor after every step; a QuantizedTensor when the last step is a Quantize."""
    final = final_quantize(transformations)
    steps = transformations[:-1] if final is not None else transformations
    for step in steps:
        tensor = step.apply(tensor, where=where, name=name)
    if final is not None:
        return final.quantize(tensor, where=where, name=name)
    return tensor.contiguous() if steps else tensor


def check_result(
    tensor: torch.Tensor | QuantizedTensor,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    *,
    where: str,
    name: str,
    transformations: Sequence[TensorTransformation] = (),
) -> None:
    """SpecMismatchError naming the tensor, the expected and the actual shape / dtype (of a
    QuantizedTensor: its logical shape and dtype, and its parts against its scheme's layout)."""
    actual_shape = tuple(tensor.shape)
    layout = tensor.layout_problems() if isinstance(tensor, QuantizedTensor) else []
    if actual_shape == tuple(shape) and tensor.dtype == dtype and not layout:
        return
    after = f" after {', '.join(map(repr, transformations))}" if transformations else ""
    problems = []
    if actual_shape != tuple(shape):
        problems.append(f"shape {tuple(shape)} expected, got {actual_shape}")
    if tensor.dtype != dtype:
        problems.append(f"dtype {dtype_name(dtype)} expected, got {dtype_name(tensor.dtype)}")
    problems += layout
    raise SpecMismatchError(where, f"tensor {name!r}{after}: {'; '.join(problems)}")
