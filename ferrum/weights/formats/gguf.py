"""GGUF, llama.cpp's single-file model format: its header parsed with gguf-py's `GGUFReader`, and the
layout in which Ferrum reads its tensors (readers.GGUFWeights, over a private mmap like SafeTensors).

    float tensors      F32, F16, BF16, F64, I8, I16, I32, I64: real tensors of their dtype
    quantized tensors  Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K and every other ggml type gguf-py knows:
                       their raw blocks, uint8 [rows, bytes_per_row], rows the product of all dims
                       but the innermost, bytes_per_row = innermost / block_size * type_size
                       (gguf's GGML_QUANT_SIZES). Rows are independent in every block format, so
                       slicing or permuting the rows of the raw blocks is exact.

Shapes are in torch order: GGUF lists dims fastest-first, they are reversed ([out, in] for a linear
weight). The typed view of each tensor, its ggml type name and logical shape, travels in the
WeightMetadata: `gguf_tensor_types(metadata)` -> {name: GGUFTensorType(type_name, logical_shape)},
read from the extra entry `GGUF_TENSORS_KEY` (JSON {name: [type name, [dims]]}); the other extra
entries are the file's scalar key/values as strings ("general.architecture": "llama").

`gguf_header(path)` is the parsed header (key/values as Python values, tensor infos checked
against the file's size), cached by file identity (device, inode, size, mtime, ctime), so that
get_metadata, load and the model files made from the metadata (gguf_model) parse a file once.
Errors name the file and the tensor: CorruptWeightsError for a truncated or corrupt file,
UnsupportedError for a big-endian file or a ggml type this gguf-py does not know.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, ReaderField

from ferrum.weights.errors import CorruptWeightsError, SourceNotFoundError, UnsupportedError, WeightError
from ferrum.weights.spec.sources import WeightFormat
from ferrum.weights.spec.tensors import WeightMetadata

__all__ = [
    "GGUF_MAGIC",
    "GGUF_TENSORS_KEY",
    "GGUFHeader",
    "GGUFTensorInfo",
    "GGUFTensorType",
    "gguf_header",
    "gguf_metadata",
    "gguf_tensor_types",
]

GGUF_MAGIC = b"GGUF"
GGUF_TENSORS_KEY = "ferrum.gguf_tensors"  # the WeightMetadata.extra entry gguf_tensor_types reads

# ggml types read as real tensors; every other type is read as its raw blocks
FLOAT_TYPES: Mapping[GGMLQuantizationType, torch.dtype] = MappingProxyType({
    GGMLQuantizationType.F32: torch.float32,
    GGMLQuantizationType.F16: torch.float16,
    GGMLQuantizationType.BF16: torch.bfloat16,
    GGMLQuantizationType.F64: torch.float64,
    GGMLQuantizationType.I8: torch.int8,
    GGMLQuantizationType.I16: torch.int16,
    GGMLQuantizationType.I32: torch.int32,
    GGMLQuantizationType.I64: torch.int64,
})
_FLOAT_NAMES = frozenset(t.name for t in FLOAT_TYPES)


class GGUFTensorType(NamedTuple):
    """A GGUF tensor as its file describes it: the ggml type's name ("Q4_1", "F32") and the logical
    shape in torch order (for a linear weight [out_features, in_features])."""

    type_name: str
    logical_shape: tuple[int, ...]

    @property
    def quantized(self) -> bool:
        """Read as raw blocks (uint8 [rows, bytes_per_row]) rather than as a tensor of its dtype."""
        return self.type_name not in _FLOAT_NAMES


@dataclass(frozen=True)
class GGUFTensorInfo:
    """Where one tensor is in the file and how it is read: `dtype` and `shape` as stored (uint8
    [rows, bytes_per_row] for a quantized type), `offset` from the start of the file."""

    name: str
    ggml_type: GGMLQuantizationType
    logical_shape: tuple[int, ...]
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    @property
    def type(self) -> GGUFTensorType:
        return GGUFTensorType(self.ggml_type.name, self.logical_shape)


@dataclass(frozen=True)
class GGUFHeader:
    """A GGUF file's header: its key/values (gguf-py's values: str, int, float, bool, or lists of
    them; the reader's own GGUF.* entries left out) and its tensors in file order."""

    name: str  # the file, for messages
    version: int
    kv: Mapping[str, Any]
    tensors: Mapping[str, GGUFTensorInfo]
    file_size: int


# ---------------------------------------------------------------------------------------------- parsing


class _HeaderReader(GGUFReader):
    """gguf-py's GGUFReader, two hooks changed: its buffer is a plain ndarray view of the memmap (the
    memmap subclass's bookkeeping on each of the ~10^5 small slices of a vocabulary made parsing 3x
    slower), and the tensor infos are kept as read (`tensor_fields`) rather than made into numpy
    views, so that they are checked here against the file's size, each error naming its tensor."""

    tensor_fields: list[ReaderField]
    _plain: npt.NDArray[Any]

    @property  # type: ignore[override]
    def data(self) -> npt.NDArray[Any]:
        return self._plain

    @data.setter
    def data(self, value: npt.NDArray[Any]) -> None:
        self._plain = value.view(np.ndarray)

    def _build_tensors(self, start_offs: int, fields: list[ReaderField]) -> None:
        self.tensor_fields = fields


def _parse(path: Path, *, name: str, size: int) -> GGUFHeader:
    if size == 0:
        raise CorruptWeightsError(name, "not a GGUF file: the file is empty")
    try:
        reader = _HeaderReader(path)
    except FileNotFoundError:
        raise SourceNotFoundError(name, "no such file") from None
    except PermissionError as exc:
        raise WeightError(name, f"cannot read: {exc.strerror or exc}") from None
    except Exception as exc:  # noqa: BLE001 - gguf-py fails on a cut or corrupt header with many error types
        raise _header_error(path, name, exc) from None
    if reader.byte_order != "I":
        raise UnsupportedError(name, "a big-endian GGUF file is not supported (convert it with llama.cpp's tools)")
    try:
        kv = {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}
    except (UnicodeDecodeError, ValueError, IndexError) as exc:
        raise CorruptWeightsError(name, f"not a valid GGUF file: a key/value cannot be read ({exc})") from None
    alignment = int(reader.alignment)
    tensors: dict[str, GGUFTensorInfo] = {}
    for field in reader.tensor_fields:
        info = _tensor_info(field, name=name, data_offset=int(reader.data_offset), alignment=alignment, size=size)
        if info.name in tensors:
            raise CorruptWeightsError(name, f"tensor {info.name!r} is listed twice")
        tensors[info.name] = info
    version = int(reader.fields["GGUF.version"].contents())
    return GGUFHeader(name, version, MappingProxyType(kv), MappingProxyType(tensors), size)


def _header_error(path: Path, name: str, exc: Exception) -> WeightError:
    text = str(exc) or type(exc).__name__
    if "magic" in text.lower():
        with open(path, "rb") as f:
            head = f.read(4)
        return CorruptWeightsError(name, f"not a GGUF file: it starts with {head!r}, not {GGUF_MAGIC!r}")
    if "version" in text.lower():
        return UnsupportedError(name, f"GGUF {text.removeprefix('Sorry, ')}")
    return CorruptWeightsError(
        name, f"not a valid GGUF file: its header is cut short or corrupt ({type(exc).__name__}: {text})"
    )


def _tensor_info(field: ReaderField, *, name: str, data_offset: int, alignment: int, size: int) -> GGUFTensorInfo:
    _len, name_data, _ndims, dims_part, raw_type, offset_part = field.parts
    try:
        tensor = bytes(name_data).decode("utf-8")
    except UnicodeDecodeError:
        raise CorruptWeightsError(name, f"a tensor name is not UTF-8 ({bytes(name_data)[:40]!r})") from None
    dims = [int(d) for d in dims_part]
    raw = int(raw_type[0])
    try:
        ggml_type = GGMLQuantizationType(raw)
        block, type_size = GGML_QUANT_SIZES[ggml_type]
    except (ValueError, KeyError):
        raise UnsupportedError(
            name, f"tensor {tensor!r}: ggml type {raw} is not one this gguf library knows (a newer llama.cpp type?)"
        ) from None
    logical = tuple(reversed(dims))
    inner = dims[0] if dims else 1
    if inner % block:
        raise CorruptWeightsError(
            name, f"tensor {tensor!r}: its innermost dim {inner} is not a multiple of the {ggml_type.name} "
            f"block of {block} values"
        )
    rows = math.prod(dims[1:])
    nbytes = rows * (inner // block) * type_size
    dtype = FLOAT_TYPES.get(ggml_type)
    shape = logical if dtype is not None else (rows, inner // block * type_size)
    relative = int(offset_part[0])
    offset = data_offset + relative
    if relative % alignment:
        raise CorruptWeightsError(name, f"tensor {tensor!r}: its data offset {relative} is not aligned to {alignment}")
    if offset + nbytes > size:
        raise CorruptWeightsError(
            name, f"tensor {tensor!r}: its data [{offset}, {offset + nbytes}) lies past the end of the file "
            f"({size} bytes): the file is truncated"
        )
    return GGUFTensorInfo(tensor, ggml_type, logical, dtype or torch.uint8, shape, offset, nbytes)


class _HeaderCache:
    """Parsed headers by file identity (device, inode, size, mtime, ctime): a changed file is parsed
    again. Few entries: a header holds the vocabulary."""

    def __init__(self, capacity: int = 4) -> None:
        self._capacity = capacity
        self._entries: OrderedDict[tuple[object, ...], GGUFHeader] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, path: Path, name: str, st: os.stat_result) -> GGUFHeader:
        key = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns, name)
        with self._lock:
            header = self._entries.get(key)
            if header is not None:
                self._entries.move_to_end(key)
                return header
        header = _parse(path, name=name, size=st.st_size)
        with self._lock:
            self._entries[key] = header
            while len(self._entries) > self._capacity:
                self._entries.popitem(last=False)
        return header


_HEADERS = _HeaderCache()


def gguf_header(path: Path, *, name: str | None = None, stat: os.stat_result | None = None) -> GGUFHeader:
    """The parsed header of the GGUF file at `path` (`name` for messages; `stat`: the file's, when the
    caller has it). Cached by file identity; raises the errors of the module docstring."""
    label = name or str(path)
    if stat is None:
        try:
            stat = os.stat(path)
        except FileNotFoundError:
            raise SourceNotFoundError(label, "no such file") from None
        except OSError as exc:
            raise WeightError(label, f"cannot read: {exc.strerror or exc}") from None
    return _HEADERS.get(path, label, stat)


# --------------------------------------------------------------------------------------------- metadata


def gguf_metadata(header: GGUFHeader) -> WeightMetadata:
    """The WeightMetadata of a GGUF file: tensors as stored (see the module docstring); extra: the
    scalar key/values as strings and GGUF_TENSORS_KEY."""
    extra = {key: str(value) for key, value in header.kv.items() if not isinstance(value, list)}
    extra[GGUF_TENSORS_KEY] = json.dumps(
        {t.name: [t.ggml_type.name, list(t.logical_shape)] for t in header.tensors.values()}, separators=(",", ":")
    )
    tensors = {t.name: (t.shape, t.dtype) for t in header.tensors.values()}
    return WeightMetadata.of(tensors, WeightFormat.GGUF, extra)


def gguf_tensor_types(metadata: WeightMetadata) -> dict[str, GGUFTensorType]:
    """{tensor name: GGUFTensorType(type_name, logical_shape)} of a GGUF file's metadata (ValueError
    for the metadata of another format)."""
    raw = metadata.extra.get(GGUF_TENSORS_KEY)
    if metadata.format is not WeightFormat.GGUF or raw is None:
        raise ValueError(f"gguf_tensor_types: the metadata is of {metadata.format.value}, not of a GGUF file")
    entries = json.loads(raw).items()
    return {name: GGUFTensorType(str(kind), tuple(int(d) for d in dims)) for name, (kind, dims) in entries}
