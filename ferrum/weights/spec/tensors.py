"""Values the WeightLoader takes and gives: `TensorSpec` (what to load), `WeightMetadata` (what a file
holds) and `WeightLoaderCapabilities` (what this loader can do)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TypeAlias

import torch

from ferrum.weights.spec.dtypes import as_dtype, as_shape
from ferrum.weights.spec.sources import SOURCE_TYPES, PicklableMappings, WeightFormat, WeightSource
from ferrum.weights.spec.transforms import Quantize, TensorTransformation, check_order, final_quantize

__all__ = ["TensorInfo", "TensorSpec", "WeightLoaderCapabilities", "WeightMetadata", "specs_by_name"]


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to load: read `source` (the tensor `source.tensor_name or name` in it), apply
    `transformations` in order, check the result has exactly `shape` and `dtype`, move it to `device`.
    Transformations ending in `Quantize` make a QuantizedTensor: `shape` is then the logical [N, K]
    and `dtype` the full-precision dtype it is made from (TransformError at construction when
    Quantize is not last or the shape / dtype cannot be quantized)."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: str = "cpu"
    source: WeightSource = field(kw_only=True)
    transformations: tuple[TensorTransformation, ...] = field(default=(), kw_only=True)

    def __post_init__(self) -> None:
        # Models build thousands of these: the common case (a tuple of ints, a torch.dtype, "cpu", no
        # transformations) is checked without conversions.
        if type(self.name) is not str or not self.name:
            raise TypeError(f"TensorSpec: name must be a non-empty string, got {self.name!r}")
        try:
            shape = self.shape
            if type(shape) is not tuple or not all(type(d) is int and d >= 0 for d in shape):
                object.__setattr__(self, "shape", as_shape(shape))
            if type(self.dtype) is not torch.dtype:
                object.__setattr__(self, "dtype", as_dtype(self.dtype))
            if self.device != "cpu":
                object.__setattr__(self, "device", str(torch.device(self.device)))
        except (TypeError, ValueError, RuntimeError) as exc:
            raise type(exc)(f"TensorSpec {self.name!r}: {exc}") from None
        if not isinstance(self.source, SOURCE_TYPES):
            raise TypeError(f"TensorSpec {self.name!r}: source must be a WeightSource, got {self.source!r}")
        if self.transformations:
            transformations = tuple(self.transformations)
            for t in transformations:
                if not isinstance(t, TensorTransformation):
                    raise TypeError(f"TensorSpec {self.name!r}: {t!r} is not a TensorTransformation")
            object.__setattr__(self, "transformations", transformations)
            check_order(transformations, where=self.source.display, name=self.name)
            quantize = final_quantize(transformations)
            if quantize is not None:
                quantize.check_spec(self.shape, self.dtype, where=self.source.display, name=self.name)
        elif type(self.transformations) is not tuple:
            object.__setattr__(self, "transformations", ())

    @property
    def quantize(self) -> Quantize | None:
        """The Quantize that ends the transformations (the spec makes a QuantizedTensor), if any."""
        return final_quantize(self.transformations)

    @property
    def stored_name(self) -> str:
        """The tensor's name inside its file."""
        return self.source.tensor_name or self.name


TensorInfo: TypeAlias = tuple[tuple[int, ...], torch.dtype]


@dataclass(frozen=True)
class WeightMetadata(PicklableMappings):
    """What a weights file holds, read from its header (SafeTensors: without reading the data).
    `extra`: the format's own string metadata (SafeTensors `__metadata__`; for a sharded checkpoint also
    the shard count as "shards")."""

    tensors: Mapping[str, TensorInfo]
    format: WeightFormat
    total_size_bytes: int
    dtypes: frozenset[torch.dtype]
    extra: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "tensors", MappingProxyType(dict(self.tensors)))
        object.__setattr__(self, "extra", MappingProxyType(dict(self.extra)))
        object.__setattr__(self, "dtypes", frozenset(self.dtypes))

    @classmethod
    def of(
        cls, tensors: Mapping[str, TensorInfo], fmt: WeightFormat, extra: Mapping[str, str] | None = None
    ) -> WeightMetadata:
        """Metadata with `total_size_bytes` and `dtypes` derived from `tensors`."""
        total = sum(_nbytes(shape, dtype) for shape, dtype in tensors.values())
        return cls(tensors, fmt, total, frozenset(d for _, d in tensors.values()), extra or {})


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = dtype.itemsize
    for dim in shape:
        n *= dim
    return n


@dataclass(frozen=True)
class WeightLoaderCapabilities:
    formats: frozenset[WeightFormat]  # formats it can read (ONNX is not among them)
    sources: frozenset[str]  # source kinds: "file", "url", "huggingface", "s3", "memory"
    max_tensor_size_bytes: int | None  # None: bounded only by memory / the address space
    streaming: bool  # remote tensors are handed over as their bytes arrive
    concurrent: bool  # load_tensors works on many tensors and sources at once
    transformations: frozenset[str]  # names of the transformation classes it applies


def specs_by_name(specs: Iterable[TensorSpec]) -> dict[str, TensorSpec]:
    """The specs keyed by name; two specs of one name are refused."""
    out: dict[str, TensorSpec] = {}
    for spec in specs:
        if not isinstance(spec, TensorSpec):
            raise TypeError(f"expected TensorSpec, got {spec!r}")
        if spec.name in out:
            raise ValueError(f"two TensorSpecs are named {spec.name!r}")
        out[spec.name] = spec
    return out
