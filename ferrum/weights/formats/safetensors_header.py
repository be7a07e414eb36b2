"""Parse and validate a SafeTensors header, from bytes, as untrusted input.

A SafeTensors file is: 8 bytes little-endian u64 N, N bytes of UTF-8 JSON (the header), then the data
section. The header maps tensor names to {"dtype", "shape", "data_offsets": [begin, end]} (offsets
relative to the data section) and may hold "__metadata__": {str: str}.

Two steps so remote code can read only what it needs (8 bytes, then N bytes):

    n = header_length(first8, file_size=size, name=url)
    header = parse_header(next_n_bytes, data_size=size - 8 - n, name=url)

What is refused (CorruptWeightsError naming the file, and the tensor where there is one):
  - fewer than 8 bytes; N < 2, N > 100,000,000 (the reference implementation's limit) or 8 + N beyond
    the file;
  - a header that is not UTF-8, not JSON (NaN / Infinity included), not an object, or has a key twice;
  - `__metadata__` that is not an object of str -> str;
  - an entry that is not an object, lacks dtype / shape / data_offsets (other keys are ignored, as the
    reference implementation does), or has a dtype this parser does not know;
  - a shape that is not a list of ints >= 0;
  - data_offsets that are not two ints, negative, or end < begin; end - begin != prod(shape) * itemsize;
  - when the data size is known, an end beyond the data section;
  - overlapping tensors, and gaps: sorted by offset, each tensor must start where the previous one ended
    and the last one must end exactly at the end of the file (when its size is known). Gaps are refused,
    like the reference implementation does, so a file that passes here also loads everywhere else and
    no bytes of the file are left unaccounted for.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from ferrum.weights.errors import CorruptWeightsError

__all__ = [
    "DTYPE_BITS",
    "MAX_HEADER_BYTES",
    "SafetensorsHeader",
    "TensorEntry",
    "header_length",
    "parse_header",
    "read_header",
]

MAX_HEADER_BYTES = 100_000_000

# Bits per element of each SafeTensors dtype code.
_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E5M2FNUZ": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E8M0": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
}
DTYPE_BITS: Mapping[str, int] = MappingProxyType(_BITS)


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: str  # SafeTensors code, e.g. "BF16"
    shape: tuple[int, ...]
    begin: int  # offsets in the data section
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    name: str  # the file / URL, for messages
    header_length: int  # N
    tensors: Mapping[str, TensorEntry]  # in data-section order
    metadata: Mapping[str, str]
    data_size: int  # bytes of the data section the tensors cover

    @property
    def data_start(self) -> int:
        """Offset in the file of the data section."""
        return 8 + self.header_length

    @property
    def file_size(self) -> int:
        return self.data_start + self.data_size

    def file_range(self, tensor: str) -> tuple[int, int]:
        """[start, end) of the tensor's bytes in the file."""
        entry = self.tensors[tensor]
        return self.data_start + entry.begin, self.data_start + entry.end


def header_length(first8: bytes, *, file_size: int | None, name: str) -> int:
    """N from the first 8 bytes, checked against the 100 MB limit and the file's size (when known)."""
    if len(first8) < 8:
        raise CorruptWeightsError(
            name, f"not a SafeTensors file: {len(first8)} bytes, fewer than the 8-byte header length"
        )
    n = int.from_bytes(bytes(first8[:8]), "little")
    if n > MAX_HEADER_BYTES:
        raise CorruptWeightsError(
            name,
            f"SafeTensors header length {n} is absurd (more than {MAX_HEADER_BYTES} bytes): not a valid file",
        )
    if n < 2:
        raise CorruptWeightsError(name, f"SafeTensors header length {n} is too small to hold a JSON object")
    if file_size is not None and 8 + n > file_size:
        raise CorruptWeightsError(
            name,
            f"SafeTensors header claims {n} bytes but the file has only {max(file_size - 8, 0)} bytes after "
            "the 8-byte length (truncated or not a SafeTensors file)",
        )
    return n


def _no_duplicates(name: str) -> Any:
    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(pairs)
        if len(out) != len(pairs):
            seen: set[str] = set()
            for key, _ in pairs:
                if key in seen:
                    raise CorruptWeightsError(name, f"SafeTensors header has the key {key!r} twice")
                seen.add(key)
        return out

    return hook


def _refuse_constant(value: str) -> Any:
    raise ValueError(f"{value} is not valid JSON")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _entry(name: str, tensor: str, raw: object) -> TensorEntry:
    """The entry, checked. A fast path accepts the valid case; anything else goes through `_refused`,
    which says precisely what is wrong."""
    if type(raw) is dict:
        dtype, shape, offsets = raw.get("dtype"), raw.get("shape"), raw.get("data_offsets")
        bits = _BITS.get(dtype) if isinstance(dtype, str) else None
        if (
            bits is not None
            and isinstance(dtype, str)
            and type(shape) is list
            and type(offsets) is list
            and len(offsets) == 2
        ):
            begin, end = offsets
            if type(begin) is int and type(end) is int and 0 <= begin <= end:
                count = 1
                for dim in shape:
                    if type(dim) is not int or dim < 0:
                        break
                    count *= dim
                else:
                    if count * bits == (end - begin) * 8:
                        return TensorEntry(tensor, dtype, tuple(shape), begin, end)
    return _refused(name, tensor, raw)


def _refused(name: str, tensor: str, raw: object) -> TensorEntry:
    where = f"tensor {tensor!r}"
    if not isinstance(raw, dict):
        raise CorruptWeightsError(name, f"{where}: header entry must be an object, got {type(raw).__name__}")
    missing = [k for k in ("dtype", "shape", "data_offsets") if k not in raw]
    if missing:
        raise CorruptWeightsError(name, f"{where}: header entry lacks {', '.join(missing)}")
    dtype = raw["dtype"]
    if not isinstance(dtype, str) or dtype not in DTYPE_BITS:
        raise CorruptWeightsError(name, f"{where}: unknown dtype {dtype!r}")
    shape = raw["shape"]
    if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
        raise CorruptWeightsError(name, f"{where}: shape must be a list of ints, got {shape!r}")
    if any(d < 0 for d in shape):
        raise CorruptWeightsError(name, f"{where}: shape {shape} has a negative dimension")
    offsets = raw["data_offsets"]
    if not isinstance(offsets, list) or len(offsets) != 2 or not all(_is_int(o) for o in offsets):
        raise CorruptWeightsError(name, f"{where}: data_offsets must be [begin, end] ints, got {offsets!r}")
    begin, end = offsets
    if begin < 0 or end < begin:
        raise CorruptWeightsError(name, f"{where}: data_offsets {offsets} are not 0 <= begin <= end")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits % 8:
        raise CorruptWeightsError(name, f"{where}: shape {shape} of {dtype} is not a whole number of bytes")
    if end - begin != bits // 8:
        raise CorruptWeightsError(
            name,
            f"{where}: data_offsets {offsets} span {end - begin} bytes but shape {shape} of {dtype} "
            f"needs {bits // 8}",
        )
    return TensorEntry(tensor, dtype, tuple(shape), begin, end)


def _metadata(name: str, raw: object) -> Mapping[str, str]:
    if not isinstance(raw, dict):
        raise CorruptWeightsError(name, f"__metadata__ must be an object, got {type(raw).__name__}")
    for key, value in raw.items():
        if not isinstance(value, str):
            raise CorruptWeightsError(
                name, f"__metadata__[{key!r}] must be a string, got {type(value).__name__}"
            )
    return MappingProxyType(dict(raw))


def parse_header(header_bytes: bytes, *, data_size: int | None, name: str) -> SafetensorsHeader:
    """Validate the N header bytes (without the 8-byte length). `data_size`: bytes after the header
    (file size - 8 - N), or None when unknown (then range checks against the end are skipped)."""
    try:
        text = bytes(header_bytes).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptWeightsError(
            name, f"SafeTensors header is not UTF-8 ({exc.reason} at byte {exc.start})"
        ) from None
    try:
        raw = json.loads(text, object_pairs_hook=_no_duplicates(name), parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:
        if isinstance(exc, CorruptWeightsError):
            raise
        raise CorruptWeightsError(name, f"SafeTensors header is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise CorruptWeightsError(name, f"SafeTensors header must be a JSON object, got {type(raw).__name__}")
    metadata: Mapping[str, str] = MappingProxyType({})
    entries: list[TensorEntry] = []
    for tensor, value in raw.items():
        if tensor == "__metadata__":
            metadata = _metadata(name, value)
        else:
            entries.append(_entry(name, tensor, value))
    if data_size is not None:
        for e in entries:
            if e.end > data_size:
                raise CorruptWeightsError(
                    name,
                    f"tensor {e.name!r}: data_offsets [{e.begin}, {e.end}] go beyond the data section, which has "
                    f"{data_size} bytes (truncated file?)",
                )
    entries.sort(key=lambda e: (e.begin, e.end))
    cursor = 0
    previous: TensorEntry | None = None
    for e in entries:
        if e.begin < cursor and previous is not None:
            raise CorruptWeightsError(
                name,
                f"tensor {e.name!r}: data_offsets [{e.begin}, {e.end}] overlap tensor {previous.name!r} "
                f"[{previous.begin}, {previous.end}]",
            )
        if e.begin > cursor:
            raise CorruptWeightsError(
                name, f"tensor {e.name!r}: {e.begin - cursor} unaccounted bytes before it (gap at {cursor})"
            )
        cursor = e.end
        if e.nbytes:
            previous = e
    if data_size is not None and cursor != data_size:
        raise CorruptWeightsError(
            name, f"{data_size - cursor} bytes after the last tensor's end ({cursor}) belong to no tensor"
        )
    return SafetensorsHeader(
        name, len(header_bytes), MappingProxyType({e.name: e for e in entries}), metadata, cursor
    )


def read_header(path: Path, *, name: str | None = None) -> SafetensorsHeader:
    """Read and validate the header of a local file (two reads: 8 bytes, then N)."""
    label = name or str(path)
    with open(path, "rb") as f:
        size = _file_size(f)
        n = header_length(f.read(8), file_size=size, name=label)
        data = f.read(n)
    if len(data) != n:
        raise CorruptWeightsError(label, f"file shrank while reading its header ({len(data)} of {n} bytes)")
    return parse_header(data, data_size=size - 8 - n, name=label)


def _file_size(f: Any) -> int:
    import os

    return os.fstat(f.fileno()).st_size
