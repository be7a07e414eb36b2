"""Where weights come from (`WeightSource`) and in which format (`WeightFormat`, `RawLayout`).

Sources are frozen, hashable values, checked when they are built:

    File(path, tensor_name=None)                          a local file (or a model folder, or an index)
    Url(url, headers={}, sha256=None)                     http:// or https:// only
    HuggingFace(repo_id, filename, revision=None, cache_dir=None)
    S3(bucket, key, region=None, endpoint=None, sha256=None)
    Memory(data, format)                                  bytes already in memory

The same types name a whole model folder (a model location, see ferrum.weights.locations.uri): a File of a
directory, a Url ending in "/", an S3 key that is empty or ends in "/" (a prefix), a HuggingFace
source with filename "" (the repository). `source.child(name)` is the file `name` in such a folder;
`pins` (Url and S3 folders) pin files of the folder by name to a sha256, which the child carries.

Every source also takes, by keyword, `tensor_name` (the tensor's name inside the file when it differs
from the TensorSpec's name) and `format` (a `WeightFormat`, a `RawLayout`, or None to detect it from
the file name or the first bytes). `source.display` is the string errors and logs use: for URLs the
query string (which may carry a signature) and any user:password are left out.
"""

from __future__ import annotations

import enum
import os
import posixpath
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType
from typing import ClassVar, TypeAlias

import torch

from ferrum.weights.errors import UnsupportedError
from ferrum.weights.spec.dtypes import as_dtype, as_shape, numel

__all__ = [
    "S3",
    "File",
    "FormatHint",
    "HuggingFace",
    "Memory",
    "RawLayout",
    "Url",
    "WeightFormat",
    "WeightSource",
    "check_relative_path",
    "is_folder",
    "normalize_sha256",
    "object_of",
    "sibling",
]


class PicklableMappings:
    """Pickling for the frozen values here that hold read-only mappings (MappingProxyType, which
    pickle refuses): they travel as dicts and are read-only again on arrival, e.g. to an engine
    process."""

    def __getstate__(self) -> dict[str, object]:
        return {k: dict(v) if isinstance(v, MappingProxyType) else v for k, v in self.__dict__.items()}

    def __setstate__(self, state: dict[str, object]) -> None:
        for key, value in state.items():
            object.__setattr__(self, key, MappingProxyType(value) if isinstance(value, dict) else value)


class WeightFormat(enum.Enum):
    SAFETENSORS = "safetensors"
    PYTORCH = "pytorch"  # torch.load(weights_only=True) only
    NUMPY = "numpy"  # .npy / .npz, allow_pickle=False
    RAW = "raw"  # bare little-endian bytes of one tensor; dtype and shape given explicitly
    GGUF = "gguf"  # llama.cpp's single-file models: float tensors as such, quantized ones as raw blocks
    ONNX = "onnx"  # recognised, refused (UnsupportedError)


@dataclass(frozen=True)
class RawLayout:
    """The dtype and shape of a RAW file (bare bytes of one tensor, as stored, before transformations).
    A source whose `format` is the bare `WeightFormat.RAW` takes them from the TensorSpec instead."""

    dtype: torch.dtype
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", as_dtype(self.dtype))
        object.__setattr__(self, "shape", as_shape(self.shape))

    @property
    def nbytes(self) -> int:
        return numel(self.shape) * self.dtype.itemsize

    @property
    def format(self) -> WeightFormat:
        return WeightFormat.RAW


FormatHint: TypeAlias = WeightFormat | RawLayout | None


def _check_format(where: str, fmt: object, *, allow_none: bool = True) -> None:
    if fmt is None and allow_none:
        return
    if not isinstance(fmt, (WeightFormat, RawLayout)):
        raise TypeError(f"{where}: format must be a WeightFormat or a RawLayout, got {fmt!r}")


def _check_tensor_name(where: str, name: object) -> None:
    if name is not None and (not isinstance(name, str) or not name):
        raise TypeError(f"{where}: tensor_name must be a non-empty string or None, got {name!r}")


def check_relative_path(where: str, what: str, value: object) -> str:
    """A relative POSIX path that stays where it is put: no leading '/', no '..', no backslashes."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{where}: {what} must be a non-empty string, got {value!r}")
    parts = value.split("/")
    if value.startswith("/") or "\\" in value or any(p in ("", ".", "..") for p in parts) or "\0" in value:
        raise ValueError(
            f"{where}: {what} {value!r} must be a plain relative path (no leading '/', no empty, '.' or '..' parts)"
        )
    return value


_SHA256 = re.compile(r"[0-9a-f]{64}")


def normalize_sha256(where: str, value: object) -> str:
    """A lowercase 64-digit hex sha256, or ValueError naming `where`."""
    if not isinstance(value, str) or not _SHA256.fullmatch(value.strip().lower()):
        raise ValueError(f"{where}: sha256 must be 64 hex digits, got {value!r}")
    return value.strip().lower()


def _pins(where: str, value: object) -> Mapping[str, str]:
    """A folder's pins: relative file name -> sha256 (checked), frozen."""
    if not isinstance(value, Mapping):
        raise TypeError(f"{where}: pins must map file names to sha256 digests, got {value!r}")
    pins = {}
    for name, digest in value.items():
        check_relative_path(where, "pinned file name", name)
        pins[name] = normalize_sha256(f"{where}: sha256 of {name}", digest)
    return MappingProxyType(pins)


@dataclass(frozen=True)
class File:
    path: Path
    tensor_name: str | None = None
    format: FormatHint = field(default=None, kw_only=True)

    kind: ClassVar[str] = "file"

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)):
            raise TypeError(f"File: path must be a str or a path, got {self.path!r}")
        object.__setattr__(self, "path", Path(self.path).expanduser())
        _check_tensor_name(str(self.path), self.tensor_name)
        _check_format(str(self.path), self.format)

    @property
    def display(self) -> str:
        return str(self.path)

    @property
    def filename(self) -> str:
        return self.path.name

    def child(self, name: str) -> File:
        check_relative_path(self.display, "file name", name)
        return File(self.path / name)


def _display_url(parts: urllib.parse.SplitResult) -> str:
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port is not None else ""
    query = "?…" if parts.query else ""
    return f"{parts.scheme}://{host}{port}{parts.path}{query}"


@dataclass(frozen=True)
class Url(PicklableMappings):
    url: str  # a file, or a folder when its path ends in "/"
    headers: Mapping[str, str] = field(default_factory=dict)
    sha256: str | None = None
    tensor_name: str | None = field(default=None, kw_only=True)
    format: FormatHint = field(default=None, kw_only=True)
    pins: Mapping[str, str] = field(default_factory=dict, kw_only=True)  # folder: file name -> sha256

    kind: ClassVar[str] = "url"

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url:
            raise TypeError(f"Url: url must be a non-empty string, got {self.url!r}")
        try:
            parts = urllib.parse.urlsplit(self.url)
            parts.port  # noqa: B018 - raises ValueError on a bad port
        except ValueError as exc:
            raise ValueError(f"{self.url}: not a valid URL: {exc}") from None
        scheme = parts.scheme.lower()
        if scheme not in ("http", "https"):
            what = f"URL scheme {scheme}:// is not supported" if scheme else "the URL has no scheme"
            raise UnsupportedError(
                _display_url(parts) if scheme else self.url,
                f"{what}: a Url source must be http:// or https://"
                + (" (use the S3 source for s3://)" if scheme == "s3" else "")
                + (" (use the HuggingFace source for hf://)" if scheme == "hf" else "")
                + (" (use the File source for local files)" if scheme == "file" else ""),
            )
        if not parts.hostname:
            raise ValueError(f"{self.url}: URL has no host")
        where = _display_url(parts)
        if not isinstance(self.headers, Mapping):
            raise TypeError(f"{where}: headers must be a mapping of str to str")
        for key, value in self.headers.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"{where}: header {key!r} must map a str to a str, got {value!r}")
            if any(c in key + value for c in "\r\n\0"):
                raise ValueError(f"{where}: header {key!r} contains a line break or NUL")
        object.__setattr__(self, "headers", MappingProxyType(dict(self.headers)))
        if self.sha256 is not None:
            object.__setattr__(self, "sha256", normalize_sha256(where, self.sha256))
        object.__setattr__(self, "pins", _pins(where, self.pins))
        _check_tensor_name(where, self.tensor_name)
        _check_format(where, self.format)

    def __hash__(self) -> int:
        return hash(
            (self.url, tuple(sorted(self.headers.items())), self.sha256, self.tensor_name, self.format,
             tuple(sorted(self.pins.items())))
        )

    @property
    def display(self) -> str:
        return _display_url(urllib.parse.urlsplit(self.url))

    @property
    def filename(self) -> str:
        return urllib.parse.unquote(posixpath.basename(urllib.parse.urlsplit(self.url).path))

    def child(self, name: str) -> Url:
        """The file `name` in this folder URL (its query string, a signature say, kept)."""
        check_relative_path(self.display, "file name", name)
        parts = urllib.parse.urlsplit(self.url)
        folder = parts.path if parts.path.endswith("/") else parts.path + "/"
        url = urllib.parse.urlunsplit((parts.scheme, parts.netloc, folder + urllib.parse.quote(name), parts.query, ""))
        return Url(url, self.headers, self.pins.get(name), pins=self.pins)


_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


@dataclass(frozen=True)
class HuggingFace:
    repo_id: str
    filename: str
    revision: str | None = None
    cache_dir: Path | None = None
    tensor_name: str | None = field(default=None, kw_only=True)
    format: FormatHint = field(default=None, kw_only=True)

    kind: ClassVar[str] = "huggingface"

    def __post_init__(self) -> None:
        if not isinstance(self.repo_id, str) or not _REPO_ID.fullmatch(self.repo_id) or ".." in self.repo_id:
            raise ValueError(
                f"HuggingFace: repo_id must look like 'org/name' or 'name', got {self.repo_id!r}"
            )
        where = f"hf://{self.repo_id}"
        if self.filename != "":  # "": the repository itself
            check_relative_path(where, "filename", self.filename)
        if self.revision is not None and (not isinstance(self.revision, str) or not self.revision.strip()):
            raise ValueError(f"{where}: revision must be a non-empty string or None, got {self.revision!r}")
        if self.cache_dir is not None:
            if not isinstance(self.cache_dir, (str, os.PathLike)):
                raise TypeError(f"{where}: cache_dir must be a path or None, got {self.cache_dir!r}")
            object.__setattr__(self, "cache_dir", Path(self.cache_dir).expanduser())
        _check_tensor_name(where, self.tensor_name)
        _check_format(where, self.format)

    @property
    def display(self) -> str:
        rev = f"@{self.revision}" if self.revision else ""
        return f"hf://{self.repo_id}{rev}" + (f"/{self.filename}" if self.filename else "")

    def child(self, name: str) -> HuggingFace:
        check_relative_path(self.display, "file name", name)
        path = posixpath.join(self.filename, name) if self.filename else name
        return replace(self, filename=path, tensor_name=None, format=None)


_BUCKET = re.compile(r"[a-z0-9][a-z0-9.\-_]{1,254}")


@dataclass(frozen=True)
class S3(PicklableMappings):
    bucket: str
    key: str  # an object, or a folder: "" (the bucket) or a prefix ending in "/"
    region: str | None = None
    endpoint: str | None = None
    sha256: str | None = None
    tensor_name: str | None = field(default=None, kw_only=True)
    format: FormatHint = field(default=None, kw_only=True)
    pins: Mapping[str, str] = field(default_factory=dict, kw_only=True)  # folder: file name -> sha256

    kind: ClassVar[str] = "s3"

    def __post_init__(self) -> None:
        if not isinstance(self.bucket, str) or not _BUCKET.fullmatch(self.bucket):
            raise ValueError(f"S3: {self.bucket!r} is not a valid bucket name")
        if not isinstance(self.key, str) or self.key.startswith("/"):
            raise ValueError(f"s3://{self.bucket}: key must be a string not starting with '/'")
        where = self.display
        if self.sha256 is not None:
            object.__setattr__(self, "sha256", normalize_sha256(where, self.sha256))
        object.__setattr__(self, "pins", _pins(where, self.pins))
        if self.region is not None and (not isinstance(self.region, str) or not self.region):
            raise ValueError(f"{where}: region must be a non-empty string or None")
        if self.endpoint is not None:
            parts = urllib.parse.urlsplit(self.endpoint) if isinstance(self.endpoint, str) else None
            if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"{where}: endpoint must be an http(s) URL, got {self.endpoint!r}")
        _check_tensor_name(where, self.tensor_name)
        _check_format(where, self.format)

    def __hash__(self) -> int:
        return hash((self.bucket, self.key, self.region, self.endpoint, self.sha256, self.tensor_name, self.format,
                     tuple(sorted(self.pins.items()))))

    @property
    def display(self) -> str:
        return f"s3://{self.bucket}/{self.key}"

    @property
    def filename(self) -> str:
        return posixpath.basename(self.key)

    def child(self, name: str) -> S3:
        """The object `name` under this prefix."""
        check_relative_path(self.display, "file name", name)
        prefix = self.key if not self.key or self.key.endswith("/") else self.key + "/"
        return S3(self.bucket, prefix + name, self.region, self.endpoint, self.pins.get(name), pins=self.pins)


@dataclass(frozen=True)
class Memory:
    """Bytes of a whole file of `format` (a bytearray or memoryview is copied into bytes)."""

    data: bytes
    format: WeightFormat | RawLayout
    tensor_name: str | None = field(default=None, kw_only=True)
    name: str = field(default="<memory>", kw_only=True)

    kind: ClassVar[str] = "memory"

    def __post_init__(self) -> None:
        if isinstance(self.data, (bytearray, memoryview)):
            object.__setattr__(self, "data", bytes(self.data))
        if not isinstance(self.data, bytes):
            raise TypeError(f"{self.name}: data must be bytes, got {type(self.data).__name__}")
        _check_format(self.name, self.format, allow_none=False)
        _check_tensor_name(self.name, self.tensor_name)

    def __repr__(self) -> str:
        return f"Memory(<{len(self.data)} bytes>, {self.format!r}, tensor_name={self.tensor_name!r})"

    @property
    def display(self) -> str:
        return f"{self.name} ({len(self.data)} bytes)"

    @property
    def filename(self) -> str:
        return ""


WeightSource: TypeAlias = File | Url | HuggingFace | S3 | Memory
SOURCE_TYPES: tuple[type, ...] = (File, Url, HuggingFace, S3, Memory)


def is_folder(source: WeightSource) -> bool:
    """Whether `source` names a folder (a model location) rather than one object; a File is a
    folder when it is a directory on disk now."""
    if isinstance(source, File):
        return source.path.is_dir()
    if isinstance(source, Url):
        return urllib.parse.urlsplit(source.url).path.endswith("/")
    if isinstance(source, S3):
        return source.key == "" or source.key.endswith("/")
    if isinstance(source, HuggingFace):
        return source.filename == ""
    return False


def object_of(source: WeightSource) -> WeightSource:
    """The source with `tensor_name` dropped: one key per stored object, so specs that read different
    tensors of the same file share one fetch."""
    if not isinstance(source, SOURCE_TYPES):
        raise TypeError(f"not a WeightSource: {source!r}")
    return source if source.tensor_name is None else replace(source, tensor_name=None)


def sibling(source: WeightSource, name: str) -> WeightSource:
    """The source of file `name` next to `source` (a shard named by a SafeTensors index), with the same
    headers / revision / endpoint. `name` must be a plain relative path; it cannot climb out."""
    check_relative_path(source.display, "file name", name)
    if isinstance(source, File):
        return File(source.path.parent / name)
    if isinstance(source, Url):
        parts = urllib.parse.urlsplit(source.url)
        path = posixpath.join(posixpath.dirname(parts.path), urllib.parse.quote(name))
        url = urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))
        return Url(url, source.headers, source.pins.get(name), pins=source.pins)
    if isinstance(source, HuggingFace):
        return replace(
            source,
            filename=posixpath.join(posixpath.dirname(source.filename), name),
            tensor_name=None,
            format=None,
        )
    if isinstance(source, S3):
        return replace(
            source, key=posixpath.join(posixpath.dirname(source.key), name), tensor_name=None, format=None,
            sha256=source.pins.get(name),
        )
    raise UnsupportedError(source.display, "a Memory source has no neighbouring files (shards)")
