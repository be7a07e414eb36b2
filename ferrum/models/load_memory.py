"""`PeakHostMemory`: the process's highest resident set size over a block of work (loading the
weights), sampled by a small thread of its own."""

from __future__ import annotations

import threading
from types import TracebackType

from ferrum.backends.cpu import process_resident_bytes


class PeakHostMemory:
    """with PeakHostMemory() as host: ...; host.peak is the highest RSS seen (bytes), sampled every
    `interval` seconds, at the start and at the end."""

    def __init__(self, interval: float = 0.01) -> None:
        self.interval = interval
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="ferrum-rss", daemon=True)

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, process_resident_bytes())
            if self._stop.wait(self.interval):
                return

    def __enter__(self) -> PeakHostMemory:
        self.peak = process_resident_bytes()
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, process_resident_bytes())
