"""Values the WeightLoader takes and gives: `TensorSpec` (what to load), `WeightMetadata` (what a file
holds), `WeightLoaderCapabilities` (what this loader can do) and `WeightLoaderConfig` (how it works)."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Literal, TypeAlias

import torch

from ferrum.weights.dtypes import as_dtype, as_shape
from ferrum.weights.sources import (
    SOURCE_TYPES,
    PicklableMappings,
    WeightFormat,
    WeightSource,
    normalize_sha256,
)
from ferrum.weights.transforms import TensorTransformation

__all__ = [
    "MiB",
    "ProgressMode",
    "TensorSpec",
    "WeightLoaderCapabilities",
    "WeightLoaderConfig",
    "WeightMetadata",
    "default_cache_dir",
]

MiB = 1024 * 1024


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to load: read `source` (the tensor `source.tensor_name or name` in it), apply
    `transformations` in order, check the result has exactly `shape` and `dtype`, move it to `device`."""

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
        elif type(self.transformations) is not tuple:
            object.__setattr__(self, "transformations", ())

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


ProgressMode: TypeAlias = Literal["auto", "bar", "log", "off"]
_PROGRESS_MODES = ("auto", "bar", "log", "off")


def default_cache_dir() -> Path:
    """$FERRUM_CACHE if set, else ~/.cache/ferrum."""
    return Path(os.environ.get("FERRUM_CACHE") or "~/.cache/ferrum").expanduser()


def _frozen_str_map(where: str, value: Mapping[str, str]) -> Mapping[str, str]:
    if not isinstance(value, Mapping):
        raise TypeError(f"WeightLoaderConfig: {where} must be a mapping of str to str")
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"WeightLoaderConfig: {where}[{k!r}] must map a str to a str, got {v!r}")
    return MappingProxyType(dict(value))


@dataclass(frozen=True)
class WeightLoaderConfig(PicklableMappings):
    """How the loader and the downloader work. `expected_sha256` maps a URL (as written in the Url
    source) to the sha256 its file must have. `progress`: "auto" (a bar on a TTY, log lines
    otherwise), "bar", "log" or "off"."""

    cache_enabled: bool = True
    cache_dir: Path = field(default_factory=default_cache_dir)
    max_cache_size_bytes: int | None = None  # None: no limit
    max_concurrent_downloads: int = 8
    chunk_size: int = 16 * MiB
    timeout_s: float = 60.0
    max_retries: int = 5
    verify_integrity: bool = True
    default_headers: Mapping[str, str] = field(default_factory=dict)
    expected_sha256: Mapping[str, str] = field(default_factory=dict)
    progress: ProgressMode = "auto"

    def __post_init__(self) -> None:
        if not isinstance(self.cache_dir, (str, os.PathLike)):
            raise TypeError(f"WeightLoaderConfig: cache_dir must be a path, got {self.cache_dir!r}")
        object.__setattr__(self, "cache_dir", Path(self.cache_dir).expanduser())
        _positive_int("max_concurrent_downloads", self.max_concurrent_downloads)
        _positive_int("chunk_size", self.chunk_size)
        if self.max_cache_size_bytes is not None:
            _positive_int("max_cache_size_bytes", self.max_cache_size_bytes)
        if (
            isinstance(self.max_retries, bool)
            or not isinstance(self.max_retries, int)
            or self.max_retries < 0
        ):
            raise ValueError(f"WeightLoaderConfig: max_retries must be an int >= 0, got {self.max_retries!r}")
        if (
            isinstance(self.timeout_s, bool)
            or not isinstance(self.timeout_s, (int, float))
            or not (self.timeout_s > 0)
        ):
            raise ValueError(f"WeightLoaderConfig: timeout_s must be > 0, got {self.timeout_s!r}")
        if self.progress not in _PROGRESS_MODES:
            raise ValueError(
                f"WeightLoaderConfig: progress must be one of {_PROGRESS_MODES}, got {self.progress!r}"
            )
        object.__setattr__(self, "default_headers", _frozen_str_map("default_headers", self.default_headers))
        sums = _frozen_str_map("expected_sha256", self.expected_sha256)
        object.__setattr__(
            self,
            "expected_sha256",
            MappingProxyType({url: normalize_sha256(url, h) for url, h in sums.items()}),
        )


def _positive_int(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"WeightLoaderConfig: {name} must be an int >= 1, got {value!r}")


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
