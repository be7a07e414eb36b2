"""Download progress: a bar on stderr when it is a terminal, `logging` lines otherwise.

Nothing shows for a download that ends within `quiet_s` (2 s): short fetches stay silent apart from
the final log line. Then the bar is redrawn at most 10 times a second, or a log line is written at
most every `log_interval_s` (5 s). Mode (`WeightLoaderConfig.progress`): "auto" (bar on a TTY, log
lines otherwise), "bar", "log", "off" (no bar and no periodic lines; the final line is still logged
at DEBUG).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Literal, TextIO

from ferrum.terminal import draw_bar, is_tty

__all__ = ["Progress", "format_bytes"]

log = logging.getLogger("ferrum.weights.download.downloader")

_BAR_INTERVAL_S = 0.1
_MiB = 1024 * 1024


def format_bytes(n: float) -> str:
    for unit, size in (("GiB", 1024**3), ("MiB", _MiB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


class Progress:
    """Progress of one download of `total` bytes (`initial` of them already there: a resume)."""

    def __init__(
        self,
        name: str,
        total: int,
        *,
        initial: int = 0,
        mode: Literal["auto", "bar", "log", "off"] = "auto",
        stream: TextIO | None = None,
        quiet_s: float = 2.0,
        log_interval_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.name = name
        self.total = total
        self.done = initial
        self._initial = initial
        self._stream = stream if stream is not None else sys.stderr
        if mode == "auto":
            mode = "bar" if is_tty(self._stream) else "log"
        self._mode = mode
        self._quiet_s = quiet_s
        self._log_interval_s = log_interval_s
        self._clock = clock
        self._started = clock()
        self._last_shown = self._started
        self._bar_drawn = False
        self._closed = False

    def update(self, nbytes: int) -> None:
        self.done += nbytes
        if self._mode == "off" or self._closed:
            return
        now = self._clock()
        if now - self._started < self._quiet_s:
            return
        if self._mode == "bar" and (now - self._last_shown >= _BAR_INTERVAL_S or not self._bar_drawn):
            self._draw_bar(now)
            self._last_shown = now
        elif self._mode == "log" and now - self._last_shown >= self._log_interval_s:
            log.info("%s: %s", self.name, self._status(now))
            self._last_shown = now

    def close(self, ok: bool = True) -> None:
        """End the display; log the outcome (INFO for a success, nothing extra for a failure: the
        error says it)."""
        if self._closed:
            return
        self._closed = True
        now = self._clock()
        if self._bar_drawn:
            self._draw_bar(now)
            self._stream.write("\n")
            self._stream.flush()
        if ok:
            elapsed = max(now - self._started, 1e-9)
            fetched = self.done - self._initial
            resumed = f", resumed with {format_bytes(self._initial)} already there" if self._initial else ""
            level = logging.DEBUG if self._mode == "off" else logging.INFO
            log.log(level, "%s: downloaded %s in %.1f s (%s/s)%s", self.name, format_bytes(fetched), elapsed,
                    format_bytes(fetched / elapsed), resumed)

    def _rate(self, now: float) -> float:
        return (self.done - self._initial) / max(now - self._started, 1e-9)

    def _status(self, now: float) -> str:
        rate = self._rate(now)
        percent = 100.0 * self.done / self.total if self.total else 100.0
        left = f", about {(self.total - self.done) / rate:.0f} s left" if rate > 0 else ""
        return (f"{percent:.0f}% ({format_bytes(self.done)} of {format_bytes(self.total)}) "
                f"at {format_bytes(rate)}/s{left}")

    def _draw_bar(self, now: float) -> None:
        fraction = self.done / self.total if self.total else 1.0
        tail = f" {fraction * 100:5.1f}% {format_bytes(self.done)}/{format_bytes(self.total)} " \
               f"{format_bytes(self._rate(now))}/s"
        label = self.name if len(self.name) <= 40 else "…" + self.name[-39:]
        draw_bar(self._stream, label, fraction, tail)
        self._bar_drawn = True
