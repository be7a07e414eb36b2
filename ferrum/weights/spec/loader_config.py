"""`WeightLoaderConfig`: how the WeightLoader, the downloader and the caches work."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Literal, TypeAlias

from ferrum.weights.spec.sources import PicklableMappings, normalize_sha256

__all__ = ["DEFAULT_CACHE_DIR", "MiB", "ProgressMode", "WeightLoaderConfig"]

MiB = 1024 * 1024
# the cache's folder when none is given (the server's configuration also takes it from FERRUM_CACHE)
DEFAULT_CACHE_DIR = Path("~/.cache/ferrum")


ProgressMode: TypeAlias = Literal["auto", "bar", "log", "off"]
_PROGRESS_MODES = ("auto", "bar", "log", "off")


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
    cache_dir: Path = DEFAULT_CACHE_DIR  # expanded ('~') when the config is made
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
