"""What an engine reports while it starts: the phase it is in with its progress, and, once the
weights are in, how they were loaded (for the server's readiness answer and its metrics)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

StartupPhase = Literal["fetching", "loading", "warming"]


@dataclass(frozen=True)
class StartupProgress:
    """`fetching`: the model's small files; `loading`: weights into the device (done / total
    bytes, streamed from a remote source as they arrive); `warming`: memory plan, KV cache, graphs."""

    phase: StartupPhase
    done_bytes: int = 0
    total_bytes: int = 0


StartupObserver = Callable[[StartupProgress], None]


@dataclass(frozen=True)
class WeightLoadReport:
    """The model's weights: where they came from (a source kind: file, url, s3, hf), how many bytes,
    how long from the first read to the last byte on the device."""

    source: str
    nbytes: int
    seconds: float
    bytes_read: int = 0  # of the checkpoint: a tensor-parallel rank reads only its shards where it can
