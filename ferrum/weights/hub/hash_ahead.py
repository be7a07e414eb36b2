"""Hashing Hub downloads while huggingface_hub writes them, so the check after a download has only the
last bytes left to hash instead of the whole file.

huggingface_hub writes a download to `<repo cache>/blobs/<etag>[.<random>].incomplete` from the first
byte to the last, then renames it to `blobs/<etag>`. `HashAhead` watches that folder from a thread: it
opens each `.incomplete` file it sees and feeds a sha256 with the bytes written so far, again and
again. When the download returns, `digest(blob)` finds the file it watched by its inode (a rename
keeps it), reads the rest through the same open file, and gives the sha256 of the whole blob.

This is only a shortcut: a file rewritten behind the reader (a download restarted from zero) gives a
wrong digest, so a mismatch is never reported from here; the caller hashes the blob again from
scratch (`verify`) before calling it corrupt.
"""

from __future__ import annotations

import hashlib
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

__all__ = ["HashAhead"]

_SUFFIX = ".incomplete"
_PIECE = 8 * 1024 * 1024
_POLL_S = 0.05


@dataclass
class _Tail:
    fd: int
    hasher: hashlib._Hash = field(default_factory=hashlib.sha256)
    offset: int = 0

    def read_available(self, limit: int | None = None) -> int:
        """Hashes what is there now (at most `limit` bytes); the number of bytes read."""
        total = 0
        while limit is None or total < limit:
            want = _PIECE if limit is None else min(_PIECE, limit - total)
            data = os.pread(self.fd, want, self.offset)
            if not data:
                break
            self.hasher.update(data)
            self.offset += len(data)
            total += len(data)
        return total


class HashAhead:
    """Watches `blobs_dir` for `*.incomplete` files and hashes them as they grow (a daemon thread).
    Use as a context manager around the download; call `digest(etag)` after it."""

    def __init__(self, blobs_dir: Path) -> None:
        self.blobs_dir = blobs_dir
        self._tails: dict[str, _Tail] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ferrum-hub-hash", daemon=True)

    def __enter__(self) -> Self:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _scan(self) -> None:
        try:
            names = [e.name for e in os.scandir(self.blobs_dir) if e.name.endswith(_SUFFIX)]
        except OSError:
            return
        for name in names:
            with self._lock:
                if name in self._tails:
                    continue
                try:
                    self._tails[name] = _Tail(os.open(self.blobs_dir / name, os.O_RDONLY))
                except OSError:
                    continue

    def _run(self) -> None:
        while not self._stop.is_set():
            self._scan()
            busy = False
            with self._lock:
                tails = list(self._tails.values())
            for tail in tails:
                with self._lock:
                    if self._stop.is_set():
                        return
                    busy |= tail.read_available(limit=4 * _PIECE) > 0
            if not busy:
                self._stop.wait(_POLL_S)

    def digest(self, blob: Path) -> str | None:
        """The sha256 of `blob` (hashing what is left), or None when it was not watched."""
        self._stop.set()
        try:
            inode = os.stat(blob).st_ino
        except OSError:
            return None
        with self._lock:
            name = next((n for n, t in self._tails.items() if os.fstat(t.fd).st_ino == inode), None)
            tail = self._tails.pop(name) if name is not None else None
        if tail is None:
            return None
        try:
            tail.read_available()
            return tail.hasher.hexdigest()
        finally:
            os.close(tail.fd)

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        with self._lock:
            for tail in self._tails.values():
                os.close(tail.fd)
            self._tails.clear()
