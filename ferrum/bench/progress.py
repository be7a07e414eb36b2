"""A bar of finished requests on stderr: redrawn in place on a terminal, a line per tenth otherwise."""

from __future__ import annotations

import sys
import time
from typing import Self, TextIO

from ferrum.terminal import draw_bar, is_tty

_REDRAW_S = 0.1


class RequestProgress:
    def __init__(self, total: int, label: str, stream: TextIO | None = None) -> None:
        self.total = total
        self.done = 0
        self.label = label
        self._stream = stream if stream is not None else sys.stderr
        self._tty = is_tty(self._stream)
        self._started = time.monotonic()
        self._last_drawn = 0.0
        self._last_tenth = 0
        self._closed = False

    def advance(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if self._tty:
            if now - self._last_drawn >= _REDRAW_S or self.done >= self.total:
                self._draw(now)
        else:
            tenth = self.done * 10 // max(self.total, 1)
            if tenth > self._last_tenth:
                self._last_tenth = tenth
                self._stream.write(f"{self.label}: {self._counts(now)}\n")
                self._stream.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._tty:
            self._draw(time.monotonic())
            self._stream.write("\n")
            self._stream.flush()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _counts(self, now: float) -> str:
        return f"{self.done}/{self.total} requests, {now - self._started:.1f} s"

    def _draw(self, now: float) -> None:
        draw_bar(self._stream, self.label, self.done / max(self.total, 1), f" {self._counts(now)}")
        self._last_drawn = now
