"""`Downloader`: a `RemoteObject` into the cache, in concurrent ranged chunks, resumable, verified.

    downloader = Downloader(config)
    path = await downloader.fetch(obj, expected_sha256=None)      # a verified file in the cache
    async with await downloader.open(obj) as download:             # or: use the bytes as they arrive
        await download.wait_range(start, end)
        data = await download.read(start, end)
        path = await download.result()

Which cached file is "the same object" (no download):
- with a sha256 (`expected_sha256`, or reported by `info()`), the blob key is `sha256-<hex>`: content
  addressed, verified when it was committed. Given `expected_sha256`, a blob of that key is used with
  no network request at all.
- otherwise the key is the object's `cache_key` plus a digest of its size, ETag and Last-Modified
  from `info()` (one HEAD): a changed object gets a new key (the old blob ages out of the LRU).
  A server that sends neither ETag nor Last-Modified is thus identified by URL and size only.

Downloading: chunks of `config.chunk_size` (one chunk from byte 0 when the object does not accept
Range requests), at most `config.max_concurrent_downloads` in flight, in order, except that chunks a
`wait_range` caller needs jump the queue. Each chunk is written at its offset into
`partial/<key>.partial`: piece by piece as the body arrives when the source has `read_range_into`
(HTTP), else whole from `read_range`; a chunk counts as arrived once all its bytes are written. A
background fdatasync every `_FLUSH_BYTES` written keeps the syncs below short; the side file lists the
chunks on disk (after an fdatasync), so a new call or process resumes from them (same size and
identity required, else it starts over). Within one call, a cut connection is retried from the last
byte received.

Verification when all chunks are in: sha256 when known, else the MD5 of a plain S3 ETag, else the
size only (logged); the digest is computed while the download runs, reading the file back in order.
A mismatch deletes the partial and raises `IntegrityError` naming the source, expected and actual;
nothing reaches `blobs/`. `config.verify_integrity=False` skips the digest (size only).
With `config.cache_enabled=False` the files go to a private temporary directory, removed by
`Downloader.close()`.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import shutil
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, TypeVar

from ferrum.weights.download.cache import ChunkProgress, DownloadCache, check_key
from ferrum.weights.download.progress import Progress
from ferrum.weights.download.remote import ObjectInfo, RemoteObject, check_range
from ferrum.weights.errors import IntegrityError, SourceUnavailableError, WeightError
from ferrum.weights.spec.sources import normalize_sha256

if TYPE_CHECKING:
    from ferrum.weights.spec.loader_config import WeightLoaderConfig

__all__ = ["Download", "Downloader"]

log = logging.getLogger(__name__)

_HASH_BLOCK = 4 * 1024 * 1024
_FLUSH_BYTES = 32 * 1024 * 1024  # written bytes that start a background fdatasync

T = TypeVar("T")


class Downloader:
    """Downloads `RemoteObject`s into the cache of `config` (see the module docstring)."""

    def __init__(self, config: WeightLoaderConfig) -> None:
        self.config = config
        self._tmp_root: Path | None = None
        if config.cache_enabled:
            root = config.cache_dir
        else:
            root = self._tmp_root = Path(tempfile.mkdtemp(prefix="ferrum-downloads-"))
        self.cache = DownloadCache(root, config.max_cache_size_bytes)
        self._transfers: dict[str, _Transfer] = {}
        self._cancelled: set[str] = set()  # keys whose unfinished download was cancelled (partial kept)

    def __repr__(self) -> str:
        return f"Downloader({self.cache!r})"

    async def fetch(self, obj: RemoteObject, expected_sha256: str | None = None) -> Path:
        """The verified file of `obj` in the cache (downloading or resuming it if needed). The file is
        not pinned once this returns: open it promptly (eviction only removes least recently used
        blobs, and an open or mapped file stays readable even then)."""
        download = await self.open(obj, expected_sha256)
        async with download:
            return await download.result()

    async def open(self, obj: RemoteObject, expected_sha256: str | None = None) -> Download:
        """A handle on `obj`'s download, started (or resumed, or joined when this downloader is already
        fetching the same object, or complete at once on a cache hit). Close it (`aclose`, `async
        with`) when done: the file stays pinned in the cache while a handle is open, and the download
        is cancelled (its partial kept) when every handle of an unfinished one is closed."""
        check_key(obj.cache_key)
        expected = normalize_sha256(obj.name, expected_sha256) if expected_sha256 is not None else None
        verify = self.config.verify_integrity
        if expected is not None and verify:
            transfer = self._existing(f"sha256-{expected}") or await self._cached(f"sha256-{expected}", obj)
            if transfer is not None:
                return transfer.handle()
        info = await obj.info()
        if expected is not None and info.sha256 is not None and info.sha256 != expected:
            raise IntegrityError(
                obj.name, f"the source reports sha256 {info.sha256}, expected {expected}: not downloading it"
            )
        sha256 = expected or info.sha256
        key = _blob_key(obj, info, sha256 if verify else None)
        transfer = self._existing(key) or await self._cached(key, obj, info)
        if transfer is None:
            check = _expected_digest(info, sha256) if verify else None
            transfer = _Transfer(self, key, obj, info, check)
            self._transfers[key] = transfer
            transfer.start()
        return transfer.handle()

    def close(self) -> None:
        """Remove the temporary directory used when the cache is disabled (nothing otherwise)."""
        if self._tmp_root is not None:
            shutil.rmtree(self._tmp_root, ignore_errors=True)
            self._tmp_root = None

    def discard_cancelled(self) -> None:
        """Delete the partials kept by downloads this downloader cancelled (for a load given up for
        good, e.g. because another file of the model failed verification); a partial another
        download is resuming right now stays."""
        for key in sorted(self._cancelled):
            if key not in self._transfers and self.cache.abandon_partial(key):
                log.info("%s: discarded the partial download of a load given up", key)
        self._cancelled.clear()

    def _existing(self, key: str) -> _Transfer | None:
        transfer = self._transfers.get(key)
        return transfer if transfer is not None and transfer.error is None else None

    async def _cached(self, key: str, obj: RemoteObject, info: ObjectInfo | None = None) -> _Transfer | None:
        fd = self.cache.open_blob(key)  # local and quick; sync so a cancellation cannot leak the fd
        if fd is None:
            return None
        if info is not None and os.fstat(fd).st_size != info.size:  # damaged from outside: fetch again
            log.warning("%s: cached %s has %d bytes, the object %d: discarding it", obj.name, key,
                        os.fstat(fd).st_size, info.size)
            os.close(fd)
            self.cache.blob_path(key).unlink(missing_ok=True)
            return None
        log.debug("%s: cache hit %s", obj.name, key)
        transfer = _Transfer(self, key, obj, info, None)
        transfer.adopt_blob(fd)
        self._transfers[key] = transfer
        return transfer

    def _forget(self, transfer: _Transfer) -> None:
        if self._transfers.get(transfer.key) is transfer:
            del self._transfers[transfer.key]


class Download:
    """One caller's handle on a download (several handles may share one download)."""

    def __init__(self, transfer: _Transfer) -> None:
        self._transfer = transfer
        self._closed = False

    def __repr__(self) -> str:
        return f"Download({self.name!r}, key={self.key!r}, complete={self.complete})"

    @property
    def name(self) -> str:
        return self._transfer.name

    @property
    def key(self) -> str:
        return self._transfer.key

    @property
    def size(self) -> int:
        return self._transfer.size

    @property
    def info(self) -> ObjectInfo | None:
        """The object's metadata; None on a cache hit found by sha256 (no request was made)."""
        return self._transfer.info

    @property
    def path(self) -> Path:
        """The partial file while downloading, the blob once verified and committed."""
        return self._transfer.path

    @property
    def blob_path(self) -> Path:
        """Where the file lies once committed. The commit renames the partial there in a worker thread, and
        `path` names the blob only once that thread has returned: a reader that finds no partial looks here."""
        return self._transfer.cache.blob_path(self._transfer.key)

    @property
    def complete(self) -> bool:
        return self._transfer.committed

    async def wait_range(self, start: int, end: int) -> None:
        """Return once bytes [start, end) are on disk (raise the download's error if it failed)."""
        self._check_open()
        check_range(self.name, start, end)
        if end > self.size:
            raise ValueError(f"{self.name}: byte range [{start}, {end}) is past the end ({self.size} bytes)")
        await self._transfer.wait_range(start, end)

    async def read(self, start: int, end: int) -> bytes:
        """Bytes [start, end), waiting for them to arrive."""
        await self.wait_range(start, end)
        return await self._transfer.read(start, end)

    async def result(self) -> Path:
        """The verified file in `blobs/`, once the whole download is done (or its error)."""
        self._check_open()
        return await self._transfer.result()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self._transfer.release()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"{self.name}: this Download handle is closed")


class _Transfer:
    """The shared state of one key's download: chunks done / pending, the file, the task."""

    def __init__(
        self,
        downloader: Downloader,
        key: str,
        obj: RemoteObject,
        info: ObjectInfo | None,
        check: tuple[str, str] | None,
    ) -> None:
        self.downloader = downloader
        self.cache = downloader.cache
        self.config = downloader.config
        self.key = key
        self.obj = obj
        self.name = obj.name
        self.info = info
        self.size = info.size if info is not None else 0
        self.check = check  # (algorithm, expected hex digest) or None: size only
        self.path = self.cache.partial_path(key)
        self.error: BaseException | None = None
        self.committed = False
        self.fd: int | None = None
        self.refs = 0
        self.task: asyncio.Task[None] | None = None
        self.changed = asyncio.Condition()
        self.chunk_size = 0  # 0 until the layout is known (after the lock and the side file)
        self.done: set[int] = set()
        self.pending: deque[int] = deque()
        self.draining = False  # a chunk failed for good: no worker takes another
        self.progress: ChunkProgress | None = None
        self._save_lock = asyncio.Lock()
        self._dirty = False
        self._io: set[asyncio.Future[Any]] = set()
        self._unsynced = 0  # bytes written since the last background flush started
        self._flusher: asyncio.Future[Any] | None = None
        self._flush_error: BaseException | None = None
        self._sync_lock = threading.Lock()  # one fdatasync at a time, its error recorded under it

    # -- handles -------------------------------------------------------------------------------------

    def handle(self) -> Download:
        self.refs += 1
        return Download(self)

    async def release(self) -> None:
        self.refs -= 1
        if self.refs > 0:
            return
        self.downloader._forget(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()
            await asyncio.wait({self.task})
            if not self.committed:
                self.downloader._cancelled.add(self.key)
        await self._close_fd()

    async def _close_fd(self) -> None:
        """Close the file once no thread uses it any more (a cancelled await leaves its thread running:
        closing under it could make it write into whatever file reuses the descriptor number)."""
        while self._io:
            await asyncio.wait(set(self._io))
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None

    async def _in_thread(self, fn: Callable[..., T], *args: object) -> T:
        """`fn(*args)` in a thread, tracked so that `_close_fd` waits for it."""
        future = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        self._io.add(future)
        future.add_done_callback(self._io.discard)
        return await asyncio.shield(future)

    # -- waiting -------------------------------------------------------------------------------------

    async def wait_range(self, start: int, end: int) -> None:
        if start == end and (self.committed or self.chunk_size):
            return
        async with self.changed:
            while not self._covered(start, end):
                self._prioritize(start, end)
                await self.changed.wait()

    def _covered(self, start: int, end: int) -> bool:
        if self.committed:
            return True
        if self.error is not None:
            raise self.error
        if not self.chunk_size:
            return False
        return all(i in self.done for i in self._chunks(start, end))

    def _chunks(self, start: int, end: int) -> range:
        if end <= start:
            return range(0)
        return range(start // self.chunk_size, (end - 1) // self.chunk_size + 1)

    def _prioritize(self, start: int, end: int) -> None:
        if not self.chunk_size:
            return
        wanted = [i for i in self._chunks(start, end) if i in self.pending]
        for index in reversed(wanted):
            self.pending.remove(index)
            self.pending.appendleft(index)

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def read(self, start: int, end: int) -> bytes:
        fd = self.fd
        if fd is None:
            raise self.error or WeightError(self.name, "the download's file is closed")
        return await self._in_thread(_pread_all, fd, start, end - start, self.name)

    async def result(self) -> Path:
        if self.task is not None:
            await asyncio.wait({self.task})  # not cancelled if the caller is: others may share it
        if self.error is not None:
            raise self.error
        if not self.committed:
            raise WeightError(self.name, "the download was cancelled")
        return self.path

    # -- the download ----------------------------------------------------------------------------------

    def adopt_blob(self, fd: int) -> None:
        """Become a complete transfer over the pinned blob `fd`."""
        self.fd = fd
        self.size = os.fstat(fd).st_size
        self.path = self.cache.blob_path(self.key)
        self.committed = True

    def start(self) -> None:
        self.task = asyncio.create_task(self._run(), name=f"download {self.name}")

    async def _run(self) -> None:
        try:
            async with self.cache.download_lock(self.key, self.name):
                fd = self.cache.open_blob(self.key)
                if fd is not None:  # another process finished it while we waited for the lock
                    self.adopt_blob(fd)
                else:
                    await asyncio.to_thread(self.cache.make_room, self.key, self.size)
                    try:
                        await self._download()
                    except IntegrityError as exc:  # bad or changed bytes: nothing worth resuming
                        self.error = exc  # before the file closes: readers then see the real cause
                        await self._close_fd()
                        await asyncio.to_thread(self.cache.discard_partial, self.key)
                        raise
        except asyncio.CancelledError:
            self.error = SourceUnavailableError(self.name, "download cancelled (partial kept for resume)")
            await self._close_fd()
            raise
        except Exception as exc:  # noqa: BLE001 - handed to every waiter instead of left in the task
            self.error = exc if not isinstance(exc, OSError) else WeightError(
                self.name, f"download cache I/O under {self.cache.root} failed: {exc}")
            await self._close_fd()
        finally:
            if self.error is not None:
                self.downloader._forget(self)
            await asyncio.shield(self._notify())

    async def _download(self) -> None:
        assert self.info is not None
        identity = _identity(self.info)
        chunk_size = self.config.chunk_size if self.info.accepts_ranges else max(self.size, 1)
        record = await asyncio.to_thread(self.cache.load_progress, self.key)
        if record is None or not record.matches(self.size, identity) or (
            not self.info.accepts_ranges and record.chunk_size < self.size
        ):
            if record is not None:
                log.info("%s: partial download does not match the object any more; starting over", self.name)
            await asyncio.to_thread(self.cache.discard_partial, self.key)
            record = ChunkProgress(self.size, chunk_size, identity)
        count = -(-self.size // record.chunk_size)
        record.done &= set(range(count))
        self.progress = record
        self.fd = _open_partial(self.cache.partial_path(self.key), self.size)  # sync: see _cached
        self.done = set(record.done)
        self.pending = deque(i for i in range(count) if i not in self.done)
        self.chunk_size = record.chunk_size
        await self._notify()
        resumed = sum(self._length(i) for i in self.done)
        if resumed:
            log.info("%s: resuming download, %d of %d bytes already there", self.name, resumed, self.size)
        if self.check is None:
            why = "integrity verification is off" if not self.config.verify_integrity else (
                "no sha256 known (configured or reported) and no plain MD5 ETag")
            log.info("%s: %s: verifying its size (%d bytes) only", self.name, why, self.size)
        progress = Progress(self.name, self.size, initial=resumed, mode=self.config.progress)
        hasher = asyncio.create_task(self._digest()) if self.check is not None else None
        workers = [asyncio.create_task(self._worker(progress))
                   for _ in range(min(self.config.max_concurrent_downloads, len(self.pending)))]
        try:
            if workers:
                await asyncio.wait(workers, return_when=asyncio.FIRST_EXCEPTION)
            failed = next((t.exception() for t in workers if t.done() and t.exception() is not None), None)
            if failed is not None:
                self.draining = True  # the others finish the chunk in hand (kept for a resume), then stop
                await asyncio.wait(workers)
                raise failed
            self._verify(await hasher if hasher is not None else None)
        except BaseException:
            for task in (*workers, hasher):
                if task is not None:
                    task.cancel()
            await asyncio.gather(*workers, *([hasher] if hasher else []), return_exceptions=True)
            progress.close(ok=False)
            raise
        progress.close(ok=True)
        assert self.fd is not None
        while self._flusher is not None:
            await asyncio.wait({self._flusher})
        self._check_flushed()
        self.path = await self._in_thread(self.cache.commit, self.key, self.fd)
        self.committed = True
        await asyncio.to_thread(self.cache.make_room, self.key, 0)

    def _verify(self, actual: str | None) -> None:
        if self.check is None or actual is None:
            return
        algorithm, expected = self.check
        if actual == expected:
            return
        raise IntegrityError(
            self.name,
            f"{algorithm} mismatch: expected {expected}, got {actual} ({self.size} bytes downloaded); "
            f"the download was deleted",
        )

    def _length(self, index: int) -> int:
        start = index * self.chunk_size
        return min(start + self.chunk_size, self.size) - start

    def _write_piece(self, offset: int, data: bytes) -> None:
        """Write one piece of the body at its offset, at once (a page-cache write: quicker than a hop
        to a thread). Raises `WeightError`, not `OSError`, so that the source does not retry it."""
        fd = self.fd
        if fd is None:
            raise self.error or WeightError(self.name, "the download's file is closed")
        self._check_flushed()
        try:
            _pwrite_all(fd, data, offset)
        except OSError as exc:
            raise WeightError(self.name, f"cannot write {self.path}: {exc.strerror or exc}") from exc
        self._unsynced += len(data)
        if self._unsynced >= _FLUSH_BYTES and self._flusher is None:
            self._start_flush(fd)

    def _start_flush(self, fd: int) -> None:
        """Start writing the file's dirty pages to disk in a thread, so that the fsync before the side
        file and before commit finds little left to do."""
        self._unsynced = 0
        flusher = asyncio.ensure_future(asyncio.to_thread(self._sync, fd))
        self._flusher = flusher
        self._io.add(flusher)
        flusher.add_done_callback(self._flushed)

    def _sync(self, fd: int) -> None:
        """fdatasync in a thread; a failure is kept (a later fdatasync of the same file would not
        report it again) and raised by the next write, side file save or commit."""
        with self._sync_lock:
            try:
                os.fdatasync(fd)
            except OSError as exc:
                if self._flush_error is None:
                    self._flush_error = exc

    def _flushed(self, flusher: asyncio.Future[Any]) -> None:
        self._io.discard(flusher)
        self._flusher = None
        if not flusher.cancelled():
            flusher.exception()  # retrieved (errors are kept by _sync)

    def _check_flushed(self) -> None:
        exc = self._flush_error
        if exc is not None:
            detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise WeightError(self.name, f"cannot write {self.path}: {detail}") from exc

    async def _fetch_chunk(self, start: int, end: int) -> None:
        data = await self.obj.read_range(start, end)
        if len(data) != end - start:
            raise WeightError(self.name, f"read_range({start}, {end}) returned {len(data)} bytes")
        assert self.fd is not None
        try:
            await self._in_thread(_pwrite_all, self.fd, data, start)
        except OSError as exc:
            raise WeightError(self.name, f"cannot write {self.path}: {exc.strerror or exc}") from exc

    async def _worker(self, progress: Progress) -> None:
        # Sources that can stream a range (`read_range_into`) have each piece written at its offset as
        # it arrives; others return the whole chunk from `read_range`.
        stream = getattr(self.obj, "read_range_into", None)
        while self.pending and not self.draining:
            index = self.pending.popleft()
            start = index * self.chunk_size
            end = start + self._length(index)
            try:
                if stream is not None:
                    await stream(start, end, self._write_piece)
                else:
                    await self._fetch_chunk(start, end)
            except BaseException:
                self.pending.appendleft(index)
                raise
            self.done.add(index)
            progress.update(end - start)
            await self._notify()
            await self._record()

    async def _record(self) -> None:
        """Write the side file (coalesced: one write covers every chunk done before it starts)."""
        self._dirty = True
        async with self._save_lock:
            if not self._dirty or self.progress is None or self.fd is None:
                return
            self._dirty = False
            snapshot = ChunkProgress(self.size, self.chunk_size, self.progress.identity, set(self.done))
            fd = self.fd

            def save() -> None:
                self._sync(fd)  # the chunks' bytes are on disk before the side file says so
                self._check_flushed()
                self.cache.save_progress(self.key, snapshot)

            await self._in_thread(save)

    async def _digest(self) -> str:
        """The checksum of the file, read back in order as the chunks arrive."""
        assert self.check is not None
        algorithm = self.check[0]
        hasher = hashlib.new(algorithm, usedforsecurity=False) if algorithm == "md5" else hashlib.new(algorithm)
        for index in range(-(-self.size // self.chunk_size)):
            start = index * self.chunk_size
            await self.wait_range(start, start + self._length(index))
            assert self.fd is not None
            await self._in_thread(_hash_range, hasher, self.fd, start, self._length(index), self.name)
        return hasher.hexdigest()


# -- helpers -----------------------------------------------------------------------------------------


def _identity(info: ObjectInfo) -> str:
    if info.sha256 is not None:
        return f"sha256={info.sha256}"
    return f"size={info.size};etag={info.etag};last-modified={info.last_modified}"


def _blob_key(obj: RemoteObject, info: ObjectInfo, sha256: str | None) -> str:
    if sha256 is not None:
        return f"sha256-{sha256}"
    digest = hashlib.sha256(f"{obj.cache_key}\0{_identity(info)}".encode()).hexdigest()[:24]
    return check_key(f"{obj.cache_key[:170]}-{digest}")


def _expected_digest(info: ObjectInfo, sha256: str | None) -> tuple[str, str] | None:
    if sha256 is not None:
        return ("sha256", sha256)
    if info.md5 is not None:
        return ("md5", info.md5)
    return None


def _open_partial(path: Path, size: int) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)  # sparse: blocks are allocated as chunks are written
    except BaseException:
        os.close(fd)
        raise
    return fd


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view, offset = view[written:], offset + written


def _pread_all(fd: int, start: int, length: int, name: str) -> bytes:
    parts, pos, left = [], start, length
    while left > 0:
        piece = os.pread(fd, left, pos)
        if not piece:
            raise WeightError(name, f"file ended at byte {pos}, expected {start + length} bytes")
        parts.append(piece)
        pos, left = pos + len(piece), left - len(piece)
    return b"".join(parts)


def _hash_range(hasher: hashlib._Hash, fd: int, start: int, length: int, name: str) -> None:
    pos, end = start, start + length
    while pos < end:
        piece = _pread_all(fd, pos, min(_HASH_BLOCK, end - pos), name)
        hasher.update(piece)
        pos += len(piece)
