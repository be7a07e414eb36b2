"""`PackedStep`: one step's tokens as a runner packs them for every attention backend."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class SequenceRows:
    """One sequence's rows in a packed step."""

    start: int  # its first row
    length: int  # its new tokens this step
    past: int  # its tokens already in the cache
    block_table: Sequence[int]


@dataclass(frozen=True)
class PackedStep:
    """One step's tokens, packed: `num_decode` decoding sequences (a row each) first, then the
    prefilling ones. Rows past the real ones (to `num_rows`) pad the step: token 0 at position 0,
    written to `pad_slot` (a block nobody reads)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]  # where each row's k and v are written
    sequences: tuple[SequenceRows, ...]
    num_decode: int
    num_rows: int  # real rows plus padding
    pad_slot: int
