"""Readers of the weight formats, over a local file (memory-mapped) or bytes in memory. All blocking:
the loader calls them from threads.

    SAFETENSORS  header validated by safetensors_header; tensors are views of a private (copy-on-write)
                 mmap of the file: nothing is read until used, nothing is copied; a tensor whose offset
                 is not aligned to its dtype, or that lives in read-only bytes (Memory), is copied once
    PYTORCH      torch.load(weights_only=True, mmap=True for zip checkpoints), never a full pickle; a
                 state dict (nested dicts / lists are flattened with '.'; non-tensor entries are
                 ignored) or one tensor
    NUMPY        .npy memory-mapped (copy-on-write), .npz members read (decompressed) on demand, so an
                 .npz's metadata reads every member; allow_pickle=False
    RAW          the bare bytes of one tensor; dtype and shape from a RawLayout, or from the TensorSpec
                 when the format is the bare WeightFormat.RAW; the size must match exactly
    GGUF         header parsed by gguf-py (formats.gguf: float tensors as such, quantized ones as raw
                 blocks uint8 [rows, bytes_per_row]); tensors are views of a private mmap like
                 SafeTensors'; from a local file only (a Memory source of GGUF is refused)
    ONNX         refused: UnsupportedError

Local SafeTensors headers are cached by file identity (device, inode, size, mtime, ctime), so that
get_metadata then load_tensors parse a header once; any write to the file invalidates its entry.

A file holding a single tensor (.npy, RAW, a torch.save of one tensor) answers to any tensor name;
its metadata names the tensor after the file's stem. Sharded checkpoints: an `*.index.json`
(`{"weight_map": {tensor: shard file}}`) next to its shards: `parse_index` / `index_shards` read it;
the loader opens each shard it needs like any other file.
"""

from __future__ import annotations

import abc
import io
import json
import math
import mmap
import os
import pickle
import re
import struct
import threading
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ferrum.weights.errors import (
    CorruptWeightsError,
    SourceNotFoundError,
    TensorNotFoundError,
    UnsupportedError,
    WeightError,
)
from ferrum.weights.formats.gguf import GGUF_MAGIC, GGUFHeader, gguf_header, gguf_metadata
from ferrum.weights.formats.safetensors_header import (
    SafetensorsHeader,
    TensorEntry,
    header_length,
    parse_header,
)
from ferrum.weights.spec.dtypes import SAFETENSORS_TO_TORCH, dtype_name
from ferrum.weights.spec.sources import FormatHint, RawLayout, WeightFormat, check_relative_path
from ferrum.weights.spec.tensors import TensorSpec, WeightMetadata

__all__ = [
    "GGUFWeights",
    "OpenedWeights",
    "StoredBytes",
    "detect_format",
    "format_from_name",
    "index_shards",
    "is_index_name",
    "metadata_from_header",
    "open_bytes",
    "open_local",
    "parse_index",
    "stored_dtype",
    "tensor_from_bytes",
]

_EXTENSIONS: Mapping[str, WeightFormat] = {
    ".safetensors": WeightFormat.SAFETENSORS,
    ".pt": WeightFormat.PYTORCH,
    ".pth": WeightFormat.PYTORCH,
    ".bin": WeightFormat.PYTORCH,
    ".ckpt": WeightFormat.PYTORCH,
    ".npy": WeightFormat.NUMPY,
    ".npz": WeightFormat.NUMPY,
    ".raw": WeightFormat.RAW,
    ".gguf": WeightFormat.GGUF,
    ".onnx": WeightFormat.ONNX,
}


# ---------------------------------------------------------------- detection


def is_index_name(filename: str) -> bool:
    """`model.safetensors.index.json`, `pytorch_model.bin.index.json`, ..."""
    return filename.endswith(".index.json")


def format_from_name(filename: str) -> WeightFormat | None:
    return _EXTENSIONS.get(os.path.splitext(filename)[1].lower())


def _zip_format(names: Sequence[str]) -> WeightFormat | None:
    if any(n.endswith("data.pkl") for n in names):
        return WeightFormat.PYTORCH
    if names and all(n.endswith(".npy") for n in names):
        return WeightFormat.NUMPY
    return None


def detect_format(
    filename: str, head: bytes, *, zip_names: Callable[[], Sequence[str]] | None = None, name: str
) -> WeightFormat:
    """The format from the file name's extension, else from its first bytes (`head`, 16 or more) and,
    for a zip, the names of its members (`zip_names()`, asked only for a zip)."""
    by_name = format_from_name(filename)
    if by_name is not None:
        return by_name
    if head.startswith(b"\x93NUMPY"):
        return WeightFormat.NUMPY
    if head.startswith(GGUF_MAGIC):
        return WeightFormat.GGUF
    if head.startswith(b"PK\x03\x04"):
        found = _zip_format(zip_names() if zip_names else ())
        if found is not None:
            return found
    if len(head) >= 9 and head[8:9] == b"{" and struct.unpack("<Q", head[:8])[0] > 1:
        return WeightFormat.SAFETENSORS
    if head[:1] == b"\x80":  # a pickle protocol opcode: a legacy (non-zip) torch.save
        return WeightFormat.PYTORCH
    raise UnsupportedError(
        name,
        "cannot tell the weights format from the file name or its first bytes: give format= on the source",
    )


def _resolved_format(hint: FormatHint, detect: Any) -> tuple[WeightFormat, RawLayout | None]:
    if isinstance(hint, RawLayout):
        return WeightFormat.RAW, hint
    return (hint if hint is not None else detect()), None


# ---------------------------------------------------------------- readers


class OpenedWeights(abc.ABC):
    """One weights object opened for reading. `tensor` returns the stored tensor (before the spec's
    transformations); `spec` is needed only by a bare RAW source, which takes its layout from it."""

    name: str
    format: WeightFormat

    @abc.abstractmethod
    def metadata(self) -> WeightMetadata: ...

    @abc.abstractmethod
    def tensor(self, stored_name: str, spec: TensorSpec | None = None) -> torch.Tensor: ...

    def stored_bytes(self, stored_name: str) -> StoredBytes | None:
        """The stored tensor's bytes, readable chunk by chunk into a caller's buffer (a device's
        staging buffer, or the destination tensor's own memory) without making a tensor first;
        None where the format has no such bytes (the reader then makes the tensor)."""
        return None

    def close(self) -> None:
        """Drops what the reader holds; tensors already handed out stay valid. Nothing to drop by default."""
        return


@dataclass(frozen=True)
class StoredBytes:
    """A stored tensor's dtype, shape and bytes: `read(buffer, offset)` fills `buffer` with bytes
    [offset, offset + len(buffer)) of the tensor."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    read: Callable[[memoryview, int], None]
    mapped: memoryview | None = None  # the same bytes in a mapping of the file, where there is one


    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize

    def sliced(self, dim: int, start: int, end: int) -> StoredBytes:
        """[start, end) along `dim`, reading only those bytes: one range when every dim before
        `dim` is 1 (a block of rows), else one range per run of the dims before it (the columns of
        each row)."""
        shape = list(self.shape)
        if not 0 <= dim < len(shape) or not 0 <= start <= end <= shape[dim]:
            raise ValueError(f"slice [{start}, {end}) of dim {dim} is outside shape {tuple(self.shape)}")
        inner = math.prod(shape[dim + 1 :]) * self.dtype.itemsize  # bytes per index of `dim`
        run = (end - start) * inner  # bytes of one run
        stride = shape[dim] * inner  # between runs in the stored tensor
        first = start * inner
        shape[dim] = end - start
        source = self.read
        # many short runs (a row-parallel shard: part of every row) from a mapping: copied as one
        # strided block, without a call per row (240,000 reads for a rank of an 8B model)
        mapped = np.frombuffer(self.mapped, dtype=np.uint8) if self.mapped is not None and run < stride else None

        def read(buffer: memoryview, offset: int) -> None:
            done = 0
            while done < len(buffer):
                at = offset + done
                index, within = divmod(at, run) if run else (0, 0)
                whole = (len(buffer) - done) // run if run else 0
                if mapped is not None and within == 0 and whole > 1:
                    rows = np.lib.stride_tricks.as_strided(mapped[index * stride + first :], shape=(whole, run),
                                                           strides=(stride, 1), writeable=False)
                    np.frombuffer(buffer[done : done + whole * run], dtype=np.uint8).reshape(whole, run)[...] = rows
                    done += whole * run
                    continue
                n = min(run - within, len(buffer) - done)
                source(buffer[done : done + n], index * stride + first + within)
                done += n

        return StoredBytes(self.dtype, tuple(shape), read)


def _missing(name: str, tensor: str, available: Sequence[str]) -> TensorNotFoundError:
    shown = ", ".join(repr(n) for n in list(available)[:5]) + (", ..." if len(available) > 5 else "")
    return TensorNotFoundError(name, f"no tensor {tensor!r} (it has {len(available)}: {shown})")


def _from_buffer(
    buf: Any, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...], *, writable: bool
) -> torch.Tensor:
    """A tensor over `buf[offset:offset+nbytes]`: a view when the buffer is writable (a private mmap)
    and the offset aligned, else one copy."""
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    if writable and offset % dtype.itemsize == 0:
        return torch.frombuffer(buf, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset).view(shape)
    out = torch.empty(shape, dtype=dtype)
    out.reshape(-1).view(torch.uint8).numpy()[:] = np.frombuffer(
        buf, dtype=np.uint8, count=nbytes, offset=offset
    )
    return out


def metadata_from_header(
    header: SafetensorsHeader, *, extra: Mapping[str, str] | None = None
) -> WeightMetadata:
    tensors = {}
    for entry in header.tensors.values():
        tensors[entry.name] = (entry.shape, _torch_dtype(header.name, entry.name, entry.dtype))
    return WeightMetadata.of(tensors, WeightFormat.SAFETENSORS, {**header.metadata, **(extra or {})})


def tensor_from_bytes(data: bytes, entry: TensorEntry, *, name: str) -> torch.Tensor:
    """A SafeTensors tensor from its bytes alone (as they arrive from a download): one copy."""
    dtype = _torch_dtype(name, entry.name, entry.dtype)
    if len(data) != entry.nbytes:
        raise CorruptWeightsError(
            name, f"tensor {entry.name!r}: got {len(data)} bytes, expected {entry.nbytes}"
        )
    return _from_buffer(data, 0, entry.nbytes, dtype, entry.shape, writable=False)


def stored_dtype(entry: TensorEntry, name: str) -> torch.dtype:
    """The torch dtype of a SafeTensors entry (UnsupportedError naming `name` when torch has none)."""
    return _torch_dtype(name, entry.name, entry.dtype)


def _torch_dtype(name: str, tensor: str, code: str) -> torch.dtype:
    dtype = SAFETENSORS_TO_TORCH.get(code)
    if dtype is None:
        raise UnsupportedError(
            name, f"tensor {tensor!r}: SafeTensors dtype {code} has no torch equivalent here"
        )
    return dtype


class SafetensorsReader(OpenedWeights):
    """A SafeTensors file in a buffer (a private mmap of a local file, or bytes in memory). With the
    file's `path`, `stored_bytes` reads with pread from the file (no page mapping on the way)."""

    format = WeightFormat.SAFETENSORS

    def __init__(
        self, buf: Any, header: SafetensorsHeader, *, name: str, writable: bool, path: Path | None = None
    ) -> None:
        self.name = name
        self.header = header
        self._buf = buf
        self._writable = writable
        self._file = _PreadFile(path, name) if path is not None else None

    def metadata(self) -> WeightMetadata:
        return metadata_from_header(self.header)

    def tensor(self, stored_name: str, spec: TensorSpec | None = None) -> torch.Tensor:
        entry = self.header.tensors.get(stored_name)
        if entry is None:
            raise _missing(self.name, stored_name, list(self.header.tensors))
        dtype = _torch_dtype(self.name, stored_name, entry.dtype)
        start = self.header.data_start + entry.begin
        return _from_buffer(self._buf, start, entry.nbytes, dtype, entry.shape, writable=self._writable)

    def stored_bytes(self, stored_name: str) -> StoredBytes | None:
        entry = self.header.tensors.get(stored_name)
        if entry is None:
            raise _missing(self.name, stored_name, list(self.header.tensors))
        dtype = _torch_dtype(self.name, stored_name, entry.dtype)
        start = self.header.data_start + entry.begin
        if self._file is not None:
            fd, name = self._file.fd(), self.name

            def pread(buffer: memoryview, offset: int) -> None:
                pread_into(fd, buffer, start + offset, name)

            mapped = memoryview(self._buf)[start : start + entry.nbytes] if self._buf is not None else None
            return StoredBytes(dtype, entry.shape, pread, mapped)
        data = memoryview(self._buf)

        def copy(buffer: memoryview, offset: int) -> None:
            buffer[:] = data[start + offset : start + offset + len(buffer)]

        return StoredBytes(dtype, entry.shape, copy, data[start : start + entry.nbytes])

    def close(self) -> None:
        self._buf = None
        if self._file is not None:
            self._file.close()


class _PreadFile:
    """A reader's file, opened on first use for pread (one descriptor, shared by its threads)."""

    def __init__(self, path: Path, name: str) -> None:
        self._path = path
        self._name = name
        self._fd: int | None = None
        self._lock = threading.Lock()

    def fd(self) -> int:
        with self._lock:
            if self._fd is None:
                try:
                    self._fd = os.open(self._path, os.O_RDONLY | os.O_CLOEXEC)
                except OSError as exc:
                    raise WeightError(self._name, f"cannot read: {exc.strerror or exc}") from None
            return self._fd

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


class GGUFWeights(OpenedWeights):
    """A GGUF file (formats.gguf) over a private mmap: tensors are views of it; `stored_bytes` reads
    with pread from the file. Quantized tensors come as their raw blocks (uint8 [rows, bytes_per_row])."""

    format = WeightFormat.GGUF

    def __init__(self, buf: Any, header: GGUFHeader, *, name: str, path: Path) -> None:
        self.name = name
        self.header = header
        self._buf = buf
        self._file = _PreadFile(path, name)

    def metadata(self) -> WeightMetadata:
        return gguf_metadata(self.header)

    def tensor(self, stored_name: str, spec: TensorSpec | None = None) -> torch.Tensor:
        info = self.header.tensors.get(stored_name)
        if info is None:
            raise _missing(self.name, stored_name, list(self.header.tensors))
        return _from_buffer(self._buf, info.offset, info.nbytes, info.dtype, info.shape, writable=True)

    def stored_bytes(self, stored_name: str) -> StoredBytes | None:
        info = self.header.tensors.get(stored_name)
        if info is None:
            raise _missing(self.name, stored_name, list(self.header.tensors))
        fd, name, start = self._file.fd(), self.name, info.offset

        def pread(buffer: memoryview, offset: int) -> None:
            pread_into(fd, buffer, start + offset, name)

        mapped = memoryview(self._buf)[start : start + info.nbytes] if self._buf is not None else None
        return StoredBytes(info.dtype, info.shape, pread, mapped)

    def close(self) -> None:
        self._buf = None
        self._file.close()


def pread_into(fd: int, buffer: memoryview, position: int, name: str) -> None:
    """Fills `buffer` from the file at `position` (preadv until it is full; `name` for the error
    when the file ends first)."""
    done = 0
    while done < len(buffer):
        got = os.preadv(fd, [buffer[done:]], position + done)
        if got == 0:
            raise CorruptWeightsError(name, f"file ended at byte {position + done}, inside a tensor")
        done += got


class DictReader(OpenedWeights):
    """Tensors already in hand (a torch.load result, a memory-mapped .npy). With `single`, the one
    tensor answers to any name."""

    def __init__(
        self, tensors: Mapping[str, torch.Tensor], fmt: WeightFormat, *, name: str, single: bool
    ) -> None:
        self.name = name
        self.format = fmt
        self._tensors = dict(tensors)
        self._single = single

    def metadata(self) -> WeightMetadata:
        return WeightMetadata.of(
            {k: (tuple(t.shape), t.dtype) for k, t in self._tensors.items()}, self.format
        )

    def tensor(self, stored_name: str, spec: TensorSpec | None = None) -> torch.Tensor:
        if self._single:
            return next(iter(self._tensors.values()))
        found = self._tensors.get(stored_name)
        if found is None:
            raise _missing(self.name, stored_name, list(self._tensors))
        return found


class RawReader(OpenedWeights):
    format = WeightFormat.RAW

    def __init__(
        self, buf: Any, size: int, layout: RawLayout | None, *, name: str, stem: str, writable: bool
    ) -> None:
        self.name = name
        self._buf = buf
        self._size = size
        self._layout = layout
        self._stem = stem
        self._writable = writable

    def _checked(self, layout: RawLayout) -> RawLayout:
        if layout.nbytes != self._size:
            raise CorruptWeightsError(
                self.name,
                f"RAW data is {self._size} bytes but shape {layout.shape} of {dtype_name(layout.dtype)} "
                f"needs {layout.nbytes}",
            )
        return layout

    def metadata(self) -> WeightMetadata:
        if self._layout is None:
            raise UnsupportedError(
                self.name, "a RAW source has no metadata without a RawLayout(dtype, shape)"
            )
        layout = self._checked(self._layout)
        return WeightMetadata.of({self._stem: (layout.shape, layout.dtype)}, WeightFormat.RAW)

    def tensor(self, stored_name: str, spec: TensorSpec | None = None) -> torch.Tensor:
        layout = self._layout
        if layout is None:
            if spec is None:
                raise UnsupportedError(
                    self.name, "a RAW source needs a RawLayout(dtype, shape) or a TensorSpec"
                )
            layout = RawLayout(spec.dtype, spec.shape)
        layout = self._checked(layout)
        return _from_buffer(self._buf, 0, layout.nbytes, layout.dtype, layout.shape, writable=self._writable)

    def close(self) -> None:
        self._buf = None


class NpzReader(OpenedWeights):
    """Members of an .npz are read (and decompressed) when asked for; allow_pickle=False."""

    format = WeightFormat.NUMPY

    def __init__(self, npz: Any, *, name: str) -> None:
        self.name = name
        self._npz = npz
        self._lock = threading.Lock()

    def metadata(self) -> WeightMetadata:
        return WeightMetadata.of(
            {k: (tuple(t.shape), t.dtype) for k in self._npz.files for t in [self.tensor(k)]},
            WeightFormat.NUMPY,
        )

    def tensor(self, stored_name: str, spec: TensorSpec | None = None) -> torch.Tensor:
        if stored_name not in self._npz.files:
            raise _missing(self.name, stored_name, list(self._npz.files))
        with self._lock:  # one zip file handle underneath
            array = _numpy_call(self.name, lambda: self._npz[stored_name])
        return _numpy_to_torch(array, name=self.name, tensor=stored_name)

    def close(self) -> None:
        self._npz.close()


# ---------------------------------------------------------------- PyTorch


_GLOBAL = re.compile(r"Unsupported global: GLOBAL ([\w.]+)|Unsupported operand \d+|Trying to [^\n]+")


def _torch_load(target: Path | bytes, *, name: str) -> Any:
    try:
        if isinstance(target, Path):
            return torch.load(target, map_location="cpu", weights_only=True, mmap=zipfile.is_zipfile(target))
        return torch.load(io.BytesIO(target), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        text = str(exc)
        if "Weights only load failed" in text:
            found = _GLOBAL.search(text)
            what = f" ({found.group(0)})" if found else ""
            raise UnsupportedError(
                name,
                f"this PyTorch checkpoint needs more than tensors and plain containers to unpickle{what}; "
                "only torch.load(weights_only=True) is allowed, a full pickle can run arbitrary code: refused "
                "(re-save it as a state dict of tensors, or as SafeTensors)",
            ) from None
        raise CorruptWeightsError(
            name, f"not a readable PyTorch checkpoint: {text.splitlines()[0] if text else exc!r}"
        ) from None
    except Exception as exc:  # noqa: BLE001 - torch.load fails on crafted input with many error types
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise CorruptWeightsError(
            name, f"not a readable PyTorch checkpoint: {type(exc).__name__}: {first}"
        ) from None


def _flatten(obj: Any, prefix: str, out: dict[str, torch.Tensor]) -> None:
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj.detach()
    elif isinstance(obj, Mapping):
        for key, value in obj.items():
            _flatten(value, f"{prefix}.{key}" if prefix else str(key), out)
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _flatten(value, f"{prefix}.{i}" if prefix else str(i), out)


def _pytorch_reader(loaded: Any, *, name: str, stem: str) -> DictReader:
    if isinstance(loaded, torch.Tensor):
        tensors, single = {stem: loaded.detach()}, True
    else:
        tensors, single = {}, False
        _flatten(loaded, "", tensors)
        if not tensors:
            raise CorruptWeightsError(
                name, f"the PyTorch checkpoint holds no tensors (a {type(loaded).__name__})"
            )
    for key, t in tensors.items():
        if t.layout != torch.strided or t.is_quantized:
            raise UnsupportedError(
                name, f"tensor {key!r}: only dense tensors are supported, got {t.layout} / {t.dtype}"
            )
    return DictReader(tensors, WeightFormat.PYTORCH, name=name, single=single)


# ---------------------------------------------------------------- NumPy


# NumPy parses each .npy header with ast.literal_eval, and CPython 3.11's AST constructor keeps one recursion
# counter per interpreter: two threads building ASTs at once can fail with "SystemError: AST constructor
# recursion depth mismatch" (python/cpython#106905). NumPy reads are serialised here, and one that still meets
# that error (another thread parsing something else) is tried again.
_NUMPY_PARSE = threading.Lock()


def _ast_safe(call: Any) -> Any:
    with _NUMPY_PARSE:
        try:
            return call()
        except SystemError as exc:
            if "AST constructor recursion depth" not in str(exc):
                raise
            return call()


def _numpy_call(name: str, call: Any) -> Any:
    try:
        return _ast_safe(call)
    except ValueError as exc:
        text = str(exc)
        if "pickle" in text.lower() or "python objects" in text.lower():
            raise UnsupportedError(
                name,
                "the NumPy data holds Python objects (a pickle); only plain arrays are loaded (allow_pickle=False)",
            ) from None
        raise CorruptWeightsError(name, f"not a valid NumPy file: {text}") from None
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise CorruptWeightsError(name, f"not a valid NumPy file: {exc}") from None


def _numpy_to_torch(array: Any, *, name: str, tensor: str) -> torch.Tensor:
    if not isinstance(array, np.ndarray):
        raise CorruptWeightsError(name, f"tensor {tensor!r}: not an array")
    if array.dtype.hasobject:
        raise UnsupportedError(name, f"tensor {tensor!r}: arrays of Python objects are not loaded")
    if not array.dtype.isnative:
        array = array.astype(array.dtype.newbyteorder("="))
    try:
        return torch.from_numpy(array)
    except TypeError:
        raise UnsupportedError(
            name, f"tensor {tensor!r}: NumPy dtype {array.dtype} has no torch equivalent"
        ) from None


def _npy_reader(path: Path, *, name: str, stem: str) -> DictReader:
    try:
        array = _ast_safe(lambda: np.load(path, mmap_mode="c", allow_pickle=False))
    except ValueError:
        array = _numpy_call(
            name, lambda: np.load(path, allow_pickle=False)
        )  # precise error, or a 0-byte array
    return DictReader(
        {stem: _numpy_to_torch(array, name=name, tensor=stem)}, WeightFormat.NUMPY, name=name, single=True
    )


def _numpy_bytes_reader(data: bytes, *, name: str) -> OpenedWeights:
    loaded = _numpy_call(name, lambda: np.load(io.BytesIO(data), allow_pickle=False))
    if isinstance(loaded, np.ndarray):
        return DictReader(
            {"tensor": _numpy_to_torch(loaded, name=name, tensor="tensor")},
            WeightFormat.NUMPY,
            name=name,
            single=True,
        )
    return NpzReader(loaded, name=name)


# ---------------------------------------------------------------- opening


def _map_file(path: Path, *, name: str) -> tuple[Any, os.stat_result]:
    """A private (copy-on-write) mmap of the whole file and its stat; b"" for an empty file."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if st.st_size == 0:
                return b"", st
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY), st
    except FileNotFoundError:
        raise SourceNotFoundError(name, "no such file") from None
    except IsADirectoryError:
        raise WeightError(name, "is a directory, not a weights file") from None
    except OSError as exc:
        raise WeightError(name, f"cannot read: {exc.strerror or exc}") from None


def _safetensors(buf: Any, size: int, *, name: str, writable: bool, path: Path | None = None) -> SafetensorsReader:
    n = header_length(bytes(buf[:8]), file_size=size, name=name)
    header = parse_header(buf[8 : 8 + n], data_size=size - 8 - n, name=name)
    return SafetensorsReader(buf, header, name=name, writable=writable, path=path)


class _HeaderCache:
    """Validated headers of local files by (device, inode, size, mtime, ctime, name), so that
    get_metadata followed by load_tensors parses a header once. Any change to the file (a write, a
    rename over it) changes its ctime, so a stale header is never used. Thread-safe, bounded."""

    def __init__(self, capacity: int = 256) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[tuple[object, ...], SafetensorsHeader] = OrderedDict()
        self._lock = threading.Lock()

    def reader(self, buf: Any, st: os.stat_result, *, name: str, path: Path) -> SafetensorsReader:
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, name)
        with self._lock:
            header = self._entries.get(key)
            if header is not None:
                self._entries.move_to_end(key)
        if header is not None:
            return SafetensorsReader(buf, header, name=name, writable=True, path=path)
        reader = _safetensors(buf, st.st_size, name=name, writable=True, path=path)
        with self._lock:
            self._entries[key] = reader.header
            while len(self._entries) > self._capacity:
                self._entries.popitem(last=False)
        return reader


_HEADERS = _HeaderCache()


def _head(buf: Any) -> bytes:
    return bytes(buf[:16])


def _zip_names(source: Any) -> list[str]:
    try:
        with zipfile.ZipFile(source) as z:
            return z.namelist()
    except (zipfile.BadZipFile, OSError):
        return []


def open_local(
    path: Path, hint: FormatHint, *, name: str | None = None, filename: str | None = None
) -> OpenedWeights:
    """Open one local weights file. `filename` (default: the path's name) is what the format is detected
    from: a cached download's blob has no extension of its own. An `*.index.json` is not opened here
    (see `index_shards`); a folder is not either (see `model_files.local_weights`)."""
    label = name or str(path)
    filename = filename or path.name
    if is_index_name(filename) and not isinstance(hint, RawLayout) and hint is not WeightFormat.RAW:
        raise UnsupportedError(
            label, "a sharded checkpoint's index is read with index_shards, not opened as weights"
        )
    buf, st = _map_file(path, name=label)
    size = st.st_size
    head = _head(buf)
    fmt, layout = _resolved_format(
        hint, lambda: detect_format(filename, head, zip_names=lambda: _zip_names(path), name=label)
    )
    stem = Path(filename).stem or "tensor"
    if fmt is WeightFormat.SAFETENSORS:
        return _HEADERS.reader(buf, st, name=label, path=path)
    if fmt is WeightFormat.RAW:
        return RawReader(buf, size, layout, name=label, stem=stem, writable=True)
    if fmt is WeightFormat.GGUF:
        return GGUFWeights(buf, gguf_header(path, name=label, stat=st), name=label, path=path)
    _release(buf)
    if fmt is WeightFormat.PYTORCH:
        return _pytorch_reader(_torch_load(path, name=label), name=label, stem=stem)
    if fmt is WeightFormat.NUMPY:
        if head.startswith(b"PK"):
            return NpzReader(_numpy_call(label, lambda: np.load(path, allow_pickle=False)), name=label)
        return _npy_reader(path, name=label, stem=stem)
    raise UnsupportedError(label, "ONNX weights are not supported (convert them to SafeTensors)")


def _release(buf: Any) -> None:
    if isinstance(buf, mmap.mmap):
        buf.close()


def open_bytes(data: bytes, hint: FormatHint, *, name: str) -> OpenedWeights:
    """Open weights held in memory (a Memory source). Tensors are copied out of `data`."""
    fmt, layout = _resolved_format(
        hint, lambda: detect_format("", data[:16], zip_names=lambda: _zip_names(io.BytesIO(data)), name=name)
    )
    if fmt is WeightFormat.SAFETENSORS:
        return _safetensors(memoryview(data), len(data), name=name, writable=False)
    if fmt is WeightFormat.RAW:
        return RawReader(memoryview(data), len(data), layout, name=name, stem="tensor", writable=False)
    if fmt is WeightFormat.PYTORCH:
        return _pytorch_reader(_torch_load(data, name=name), name=name, stem="tensor")
    if fmt is WeightFormat.NUMPY:
        return _numpy_bytes_reader(data, name=name)
    if fmt is WeightFormat.GGUF:
        raise UnsupportedError(name, "a GGUF is read from a file (gguf-py maps it), not from bytes in memory")
    raise UnsupportedError(name, "ONNX weights are not supported (convert them to SafeTensors)")


# ---------------------------------------------------------------- sharded checkpoints


def parse_index(data: bytes, *, name: str) -> dict[str, str]:
    """tensor -> shard file name (relative to the index) from a `*.index.json`, validated."""
    try:
        raw = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptWeightsError(name, f"index is not valid JSON: {exc}") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise CorruptWeightsError(name, 'index has no "weight_map" object of tensor -> shard file')
    for tensor, shard in weight_map.items():
        try:
            check_relative_path(name, f"shard of tensor {tensor!r}", shard)
        except ValueError as exc:
            raise CorruptWeightsError(name, str(exc).removeprefix(f"{name}: ")) from None
    return dict(weight_map)


def index_shards(index_path: Path) -> dict[str, Path]:
    """tensor -> shard file for a local `model.safetensors.index.json` (shards next to the index)."""
    index_path = Path(index_path)
    try:
        data = index_path.read_bytes()
    except FileNotFoundError:
        raise SourceNotFoundError(str(index_path), "no such file") from None
    except OSError as exc:
        raise WeightError(str(index_path), f"cannot read: {exc.strerror or exc}") from None
    folder = index_path.parent
    return {tensor: folder / shard for tensor, shard in parse_index(data, name=str(index_path)).items()}
