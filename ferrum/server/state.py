"""Where the server is in its life, for `/health`, `/ready` and the request gate.

    starting -> fetching -> loading -> warming -> ready -> draining -> stopped
                          \\___________________________/
                                     failed

HTTP comes up first, so `/health` (liveness) answers 200 from the start, while `/ready`
(readiness) answers 503 with the phase and its progress until the model is loaded and warmed up,
200 while ready, and 503 again once draining. A failed start keeps its reason for `/ready`.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Literal

from ferrum.engine.startup import StartupProgress

Phase = Literal["starting", "fetching", "loading", "warming", "ready", "draining", "failed", "stopped"]


@dataclass
class ServerState:
    phase: Phase = "starting"
    done_bytes: int = 0
    total_bytes: int = 0
    error: str | None = None
    since: float = field(default_factory=time.monotonic)

    @property
    def ready(self) -> bool:
        return self.phase == "ready"

    @property
    def draining(self) -> bool:
        return self.phase in ("draining", "stopped")

    def progress(self, update: StartupProgress) -> None:
        """A start-up phase and its progress (ignored once the start is over)."""
        if self.phase in ("starting", "fetching", "loading", "warming"):
            self._enter(update.phase)
            self.done_bytes, self.total_bytes = update.done_bytes, update.total_bytes

    def set_ready(self) -> None:
        if self.phase in ("starting", "fetching", "loading", "warming"):
            self._enter("ready")

    def fail(self, reason: str) -> None:
        if not self.draining:
            self.error = reason
            self._enter("failed")

    def begin_drain(self) -> None:
        if self.phase != "stopped":
            self._enter("draining")

    def stopped(self) -> None:
        self._enter("stopped")

    def readiness(self) -> tuple[int, dict[str, Any]]:
        """The status code and body of `GET /ready`."""
        body: dict[str, Any] = {"status": "ready" if self.ready else "unavailable", "phase": self.phase,
                                "seconds_in_phase": round(time.monotonic() - self.since, 3)}
        if self.phase == "loading" and self.total_bytes:
            body["progress"] = {"done_bytes": self.done_bytes, "total_bytes": self.total_bytes,
                                "fraction": round(self.done_bytes / self.total_bytes, 4)}
        if self.error is not None:
            body["error"] = self.error
        return (200 if self.ready else 503), body

    def _enter(self, phase: Phase) -> None:
        if phase != self.phase:
            self.phase = phase
            self.since = time.monotonic()
