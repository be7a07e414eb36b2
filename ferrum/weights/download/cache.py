"""The download cache: verified files under `<root>/blobs/<key>`, downloads in progress under
`<root>/partial/<key>.partial` with a side file `<key>.progress` (which chunks are on disk) and a lock
file `<key>.lock`.

- Keys are plain file names (`[A-Za-z0-9][A-Za-z0-9._-]*`, at most 200 characters, no '..'); any
  other key (`../../etc/passwd`, `/abs/path`) is refused with a `WeightError`, and every path is
  checked to resolve inside its directory. `make_cache_key` builds a valid key from any text.
- A blob appears only by `commit`: the verified partial is fsynced and renamed into `blobs/`
  (atomic on one file system), so `blobs/` never holds a partial or unverified file.
- Last access is a blob's mtime (blobs never change, so mtime is free for this; atime is often off):
  `open_blob` touches it. `make_room` evicts the least recently used blobs and abandoned partials
  until the cache plus an incoming object fits `max_size_bytes`. A blob in use is never evicted:
  users hold a shared `flock` on it (`open_blob`), eviction needs an exclusive one; a partial is in
  use while its download lock is held.
- `download_lock(key)` is an exclusive `flock` on `<key>.lock`, so one process (and one task) at a
  time downloads a given key; the others wait, then find the blob or resume the partial.
"""

from __future__ import annotations

import asyncio
import fcntl
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path

from ferrum.weights.errors import WeightError

__all__ = ["ChunkProgress", "DownloadCache", "check_key", "make_cache_key"]

log = logging.getLogger(__name__)

_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")
_PARTIAL = ".partial"
_PROGRESS = ".progress"
_LOCK = ".lock"
_PROGRESS_VERSION = 1


def make_cache_key(kind: str, label: str, identity: str) -> str:
    """A valid key `<kind>-<label>-<24 hex of sha256(identity)>`: `label` (a file name, for people
    browsing the cache) is reduced to safe characters, `identity` (a URL, bucket/key) makes it unique."""
    safe_label = _UNSAFE.sub("_", label).strip("._-")[:60] or "object"
    digest = hashlib.sha256(identity.encode("utf-8", "surrogatepass")).hexdigest()[:24]
    return check_key(f"{_UNSAFE.sub('_', kind)[:20]}-{safe_label}-{digest}")


def check_key(key: object) -> str:
    """`key` if it is a safe file name, else WeightError saying why it is refused."""
    if not isinstance(key, str) or not _KEY.fullmatch(key) or ".." in key:
        raise WeightError(
            repr(key),
            "refused as a cache key: a key must be a plain file name of letters, digits, '.', '_', '-' "
            "(at most 200, no '..', no '/'), so that it cannot point outside the cache directory",
        )
    return key


@dataclass
class ChunkProgress:
    """The side file of a partial download: which chunks of `chunk_size` bytes of an object of `size`
    bytes (whose `identity` is its ETag/size/...) are on disk."""

    size: int
    chunk_size: int
    identity: str
    done: set[int] = field(default_factory=set)

    def matches(self, size: int, identity: str) -> bool:
        return self.size == size and self.identity == identity

    def to_json(self) -> str:
        runs: list[list[int]] = []
        for index in sorted(self.done):
            if runs and runs[-1][1] == index:
                runs[-1][1] = index + 1
            else:
                runs.append([index, index + 1])
        return json.dumps({"version": _PROGRESS_VERSION, "size": self.size, "chunk_size": self.chunk_size,
                           "identity": self.identity, "done": runs})

    @classmethod
    def from_json(cls, text: str) -> ChunkProgress | None:
        """The record, or None when it is unreadable or of another version (the download restarts)."""
        try:
            data = json.loads(text)
            if data.get("version") != _PROGRESS_VERSION:
                return None
            done = {i for a, b in data["done"] for i in range(int(a), int(b))}
            record = cls(int(data["size"]), int(data["chunk_size"]), str(data["identity"]), done)
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
        if record.size < 0 or record.chunk_size < 1 or any(i < 0 for i in done):
            return None
        return record


@dataclass(frozen=True)
class _Entry:
    last_access: float
    nbytes: int
    key: str
    is_blob: bool


class DownloadCache:
    """The cache under `root` (created if missing). `max_size_bytes`: None for no limit."""

    def __init__(self, root: Path, max_size_bytes: int | None = None) -> None:
        self.root = Path(root)
        self.max_size_bytes = max_size_bytes
        self.blobs_dir = self.root / "blobs"
        self.partial_dir = self.root / "partial"
        try:
            self.blobs_dir.mkdir(parents=True, exist_ok=True)
            self.partial_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise WeightError(str(self.root), f"cannot create the download cache here: {exc.strerror or exc}") from exc

    def __repr__(self) -> str:
        return f"DownloadCache({str(self.root)!r}, max_size_bytes={self.max_size_bytes})"

    # -- paths -------------------------------------------------------------------------------------

    def blob_path(self, key: str) -> Path:
        return self._inside(self.blobs_dir, check_key(key))

    def partial_path(self, key: str) -> Path:
        return self._inside(self.partial_dir, check_key(key) + _PARTIAL)

    def progress_path(self, key: str) -> Path:
        return self._inside(self.partial_dir, check_key(key) + _PROGRESS)

    def lock_path(self, key: str) -> Path:
        return self._inside(self.partial_dir, check_key(key) + _LOCK)

    def _inside(self, directory: Path, name: str) -> Path:
        path = directory / name
        resolved, base = path.resolve(), directory.resolve()
        if resolved.parent != base:
            raise WeightError(str(path), f"resolves to {resolved}, outside the cache directory {base}: refused")
        return path

    # -- blobs -------------------------------------------------------------------------------------

    def open_blob(self, key: str) -> int | None:
        """A read-only fd of blob `key` holding a shared lock (so it is not evicted while the fd is
        open), with its last access set to now; None when there is no such blob."""
        path = self.blob_path(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            if os.fstat(fd).st_nlink == 0:  # evicted between open and lock
                os.close(fd)
                return None
            with suppress(OSError):
                os.utime(fd)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def commit(self, key: str, fd: int) -> Path:
        """Make the verified partial of `key` (open as `fd`) the blob `key`: fsync, rename into
        `blobs/`, fsync the directory, drop the side file. `fd` then refers to the blob; it gets the
        shared lock that marks the blob as in use."""
        partial, blob = self.partial_path(key), self.blob_path(key)
        os.fsync(fd)
        fcntl.flock(fd, fcntl.LOCK_SH)
        os.replace(partial, blob)
        _fsync_dir(self.blobs_dir)
        with suppress(FileNotFoundError):
            self.progress_path(key).unlink()
        with suppress(OSError):
            os.utime(fd)
        return blob

    # -- partials ----------------------------------------------------------------------------------

    def load_progress(self, key: str) -> ChunkProgress | None:
        """The side file of `key`'s partial, or None when there is none or no partial to go with it."""
        if not self.partial_path(key).exists():
            return None
        try:
            text = self.progress_path(key).read_text(encoding="utf-8")
        except FileNotFoundError:
            return None
        return ChunkProgress.from_json(text)

    def save_progress(self, key: str, progress: ChunkProgress) -> None:
        """Replace the side file atomically (write a temporary file, rename it)."""
        path = self.progress_path(key)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(progress.to_json(), encoding="utf-8")
        os.replace(tmp, path)

    def discard_partial(self, key: str) -> None:
        for path in (self.partial_path(key), self.progress_path(key)):
            with suppress(FileNotFoundError):
                path.unlink()

    @asynccontextmanager
    async def download_lock(self, key: str, name: str) -> AsyncIterator[None]:
        """Hold the exclusive download lock of `key` (waiting, without blocking the event loop, while
        another task or process holds it; `name` is for the log line that says so)."""
        path = self.lock_path(key)
        delay, waited_since = 0.01, time.monotonic()
        logged = False
        while True:
            fd = _try_lock(path)
            if fd is not None:
                break
            if not logged and time.monotonic() - waited_since > 1.0:
                log.info("%s: waiting for another download of it (lock %s)", name, path)
                logged = True
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.25)
        try:
            yield
        finally:
            if not self.partial_path(key).exists():  # nothing left to resume: the lock file can go
                with suppress(FileNotFoundError):
                    path.unlink()
            os.close(fd)

    # -- size and eviction -------------------------------------------------------------------------

    def usage_bytes(self) -> int:
        return sum(entry.nbytes for entry in self._entries())

    def make_room(self, key: str, incoming_bytes: int) -> int:
        """Evict least recently used blobs and abandoned partials (never `key`'s, never one in use)
        until the rest of the cache plus `incoming_bytes` fits `max_size_bytes`. Returns bytes freed."""
        if self.max_size_bytes is None:
            return 0
        entries = [e for e in self._entries() if e.key != key]
        excess = sum(e.nbytes for e in entries) + incoming_bytes - self.max_size_bytes
        freed = 0
        for entry in sorted(entries, key=lambda e: e.last_access):
            if freed >= excess:
                break
            if self._evict(entry):
                freed += entry.nbytes
                log.info("cache %s: evicted %s %s (%d bytes, least recently used)",
                         self.root, "blob" if entry.is_blob else "partial download", entry.key, entry.nbytes)
        if freed < excess:
            log.warning("cache %s: over its limit of %d bytes by %d bytes (the rest is in use)",
                        self.root, self.max_size_bytes, excess - freed)
        return freed

    def _entries(self) -> list[_Entry]:
        entries = []
        for path in self.blobs_dir.iterdir():
            if _KEY.fullmatch(path.name):
                with suppress(FileNotFoundError):
                    st = path.stat()
                    entries.append(_Entry(st.st_mtime, st.st_size, path.name, True))
        for path in self.partial_dir.iterdir():
            if path.name.endswith(_PARTIAL):
                with suppress(FileNotFoundError):
                    st = path.stat()
                    entries.append(_Entry(st.st_mtime, st.st_size, path.name[: -len(_PARTIAL)], False))
        return entries

    def abandon_partial(self, key: str) -> bool:
        """Delete `key`'s partial download and its side files unless a download holds its lock.
        True when nothing of it is left."""
        return self._evict(_Entry(0.0, 0, check_key(key), False))

    def _evict(self, entry: _Entry) -> bool:
        """Remove `entry` unless it is in use. True when removed."""
        path = self.blob_path(entry.key) if entry.is_blob else self.lock_path(entry.key)
        fd = _try_lock(path, create=not entry.is_blob)
        if fd is None:
            return False
        try:
            if entry.is_blob:
                path.unlink()
            else:
                self.discard_partial(entry.key)
                path.unlink()
        except FileNotFoundError:
            return False
        finally:
            os.close(fd)
        return True


def _try_lock(path: Path, *, create: bool = True) -> int | None:
    """An fd of `path` holding an exclusive flock, or None when someone else holds a lock on it (or,
    with create=False, it does not exist). Checks that `path` still names the locked file afterwards
    (a lock file may be unlinked by its previous holder)."""
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    try:
        fd = os.open(path, flags if create else os.O_RDONLY | os.O_CLOEXEC, 0o644)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    try:
        same = os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        same = False
    if not same:
        os.close(fd)
        return None
    return fd


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

