"""What an engine reports while it starts: the phase it is in with its progress (for the server's
readiness answer); how the weights were loaded is the model loader's `WeightLoadReport`."""

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
