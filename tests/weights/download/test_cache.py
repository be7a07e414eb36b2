"""The download cache (keys, commit, LRU eviction), the Downloader's bookkeeping (side file, resume,
cancellation), progress display and retry helpers: over an in-memory RemoteObject, no network."""

from __future__ import annotations

import asyncio
import email.utils
import hashlib
import io
import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest

from ferrum.weights.download.cache import ChunkProgress, DownloadCache, check_key, make_cache_key
from ferrum.weights.download.downloader import Downloader
from ferrum.weights.download.progress import Progress
from ferrum.weights.download.remote import ObjectInfo, RemoteObject, RetryPolicy, parse_retry_after
from ferrum.weights.errors import IntegrityError, SourceUnavailableError, WeightError
from ferrum.weights.spec.loader_config import WeightLoaderConfig
from tests.conftest import weights_config

CHUNK = 16 * 1024
SIZE = 100 * 1024


class MemoryObject:
    """A RemoteObject over bytes in memory: counts reads; reads covering `fail_at` fail (transiently);
    reads from `gate_at` on wait for `gate` to be set."""

    def __init__(self, name: str, data: bytes, *, sha256: str | None = None, md5: str | None = None,
                 etag: str | None = "v1", cache_key: str | None = None, accepts_ranges: bool = True) -> None:
        self.name = name
        self.cache_key = cache_key if cache_key is not None else make_cache_key("mem", name, name)
        self.data = data
        self.sha256, self.md5, self.etag, self.accepts_ranges = sha256, md5, etag, accepts_ranges
        self.reads: list[tuple[int, int]] = []
        self.info_calls = 0
        self.fail_at: int | None = None
        self.gate_at: int | None = None
        self.gate = asyncio.Event()
        self.short_reads = False

    async def info(self) -> ObjectInfo:
        self.info_calls += 1
        return ObjectInfo(len(self.data), self.sha256, self.md5, self.etag, self.accepts_ranges)

    async def read_range(self, start: int, end: int) -> bytes:
        self.reads.append((start, end))
        await asyncio.sleep(0)
        if self.gate_at is not None and end > self.gate_at:
            await self.gate.wait()
        if self.fail_at is not None and start <= self.fail_at < end:
            raise SourceUnavailableError(self.name, f"injected failure at byte {self.fail_at}")
        return self.data[start:end - 1] if self.short_reads else self.data[start:end]

    @property
    def bytes_read(self) -> int:
        return sum(end - start for start, end in self.reads)


def payload(seed: int, size: int = SIZE) -> bytes:
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.sha256(f"{seed}:{counter}".encode()).digest()
        counter += 1
    return bytes(out[:size])


def make_config(tmp_path: Path, **overrides: object) -> WeightLoaderConfig:
    settings: dict[str, object] = {"chunk_size": CHUNK, "max_concurrent_downloads": 3, "max_retries": 0}
    return weights_config(tmp_path, **{**settings, **overrides})


def blob_names(config: WeightLoaderConfig) -> set[str]:
    return {p.name for p in (config.cache_dir / "blobs").iterdir()}


def partial_names(config: WeightLoaderConfig) -> set[str]:
    return {p.name for p in (config.cache_dir / "partial").iterdir()}


def test_memory_object_is_a_remote_object() -> None:
    assert isinstance(MemoryObject("x", b""), RemoteObject)


# -- keys and paths --------------------------------------------------------------------------------


@pytest.mark.parametrize("key", ["../../etc/passwd", "/etc/passwd", "a/b", "..", ".hidden", "", "x" * 201,
                                 "a\0b", "a..b", "-rf", "name with space"])
def test_unsafe_keys_are_refused(key: str, tmp_path: Path) -> None:
    cache = DownloadCache(tmp_path / "cache")
    for get_path in (check_key, cache.blob_path, cache.partial_path, cache.progress_path, cache.lock_path):
        with pytest.raises(WeightError) as failure:
            get_path(key)
        assert "refused as a cache key" in str(failure.value) and repr(key) in str(failure.value)


def test_a_symlink_out_of_the_cache_is_refused(tmp_path: Path) -> None:
    cache = DownloadCache(tmp_path / "cache")
    (tmp_path / "outside").write_bytes(b"secret")
    (cache.blobs_dir / "evil").symlink_to(tmp_path / "outside")
    with pytest.raises(WeightError) as failure:
        cache.blob_path("evil")
    assert "outside the cache directory" in str(failure.value)


def test_made_keys_are_safe_and_distinct() -> None:
    one = make_cache_key("url", "../../etc/passwd", "https://example.com/../../etc/passwd")
    two = make_cache_key("url", "../../etc/passwd", "https://example.com/other")
    assert check_key(one) == one and one != two and "/" not in one and ".." not in one
    assert make_cache_key("s3", "", "b/k").startswith("s3-object-")


async def test_downloader_refuses_an_object_with_an_unsafe_key(tmp_path: Path) -> None:
    config = make_config(tmp_path / "deep" / "down")
    obj = MemoryObject("evil", payload(1), cache_key="../../../../etc/passwd")
    with pytest.raises(WeightError) as failure:
        await Downloader(config).fetch(obj)
    assert "refused as a cache key" in str(failure.value) and "../../../../etc/passwd" in str(failure.value)
    assert obj.info_calls == 0 and obj.reads == []
    assert not (tmp_path / "etc").exists() and blob_names(config) == set()


# -- commit and verification -----------------------------------------------------------------------


async def test_nothing_is_in_blobs_before_verification(tmp_path: Path) -> None:
    data = payload(2)
    config = make_config(tmp_path)
    obj = MemoryObject("obj", data, sha256=hashlib.sha256(data).hexdigest())
    obj.gate_at = SIZE - 1
    async with await Downloader(config).open(obj) as download:
        await download.wait_range(0, CHUNK)
        assert blob_names(config) == set() and download.path.name.endswith(".partial")
        assert not download.complete
        obj.gate.set()
        path = await download.result()
    assert path.read_bytes() == data and partial_names(config) == set()
    assert blob_names(config) == {f"sha256-{hashlib.sha256(data).hexdigest()}"}


async def test_a_reader_opening_the_file_while_the_commit_renames_it_finds_the_blob(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit renames the partial to the blob in a worker thread, and the download's path names the
    blob only once that thread returns. The loader's reader (the streamed load's file) opening the file in
    that window opens the blob (it reported the file gone, seen in CI under load)."""
    from ferrum.weights.loader import _GrowingFile

    data = payload(4)
    config = make_config(tmp_path)
    obj = MemoryObject("obj", data, sha256=hashlib.sha256(data).hexdigest())
    renamed, release = threading.Event(), threading.Event()
    commit = DownloadCache.commit

    def held_commit(self: DownloadCache, key: str, fd: int) -> Path:
        blob = commit(self, key, fd)
        renamed.set()
        release.wait(30)
        return blob

    monkeypatch.setattr(DownloadCache, "commit", held_commit)
    async with await Downloader(config).open(obj) as download:
        assert await asyncio.to_thread(renamed.wait, 30)
        assert download.path.name.endswith(".partial") and not download.path.exists()  # the window
        async with _GrowingFile(download) as file:
            assert os.pread(file.fd(), 64, 1000) == data[1000:1064]
        release.set()
        assert (await download.result()) == download.blob_path


async def test_a_wrong_md5_leaves_nothing(tmp_path: Path) -> None:
    data = payload(3)
    config = make_config(tmp_path)
    wrong = hashlib.md5(b"something else").hexdigest()
    with pytest.raises(IntegrityError) as failure:
        await Downloader(config).fetch(MemoryObject("mem://obj", data, md5=wrong))
    assert "mem://obj" in str(failure.value) and f"md5 mismatch: expected {wrong}" in str(failure.value)
    assert hashlib.md5(data).hexdigest() in str(failure.value)
    assert blob_names(config) == set() and partial_names(config) == set()


async def test_expected_sha256_differing_from_the_reported_one_fails_before_downloading(tmp_path: Path) -> None:
    data = payload(4)
    obj = MemoryObject("obj", data, sha256=hashlib.sha256(data).hexdigest())
    with pytest.raises(IntegrityError) as failure:
        await Downloader(make_config(tmp_path)).fetch(obj, expected_sha256="0" * 64)
    assert "0" * 64 in str(failure.value) and obj.reads == []


async def test_size_only_verification_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    data = payload(5)
    with caplog.at_level(logging.INFO, logger="ferrum.weights.download.downloader"):
        path = await Downloader(make_config(tmp_path)).fetch(MemoryObject("mem://plain", data))
    assert path.read_bytes() == data
    assert any("mem://plain" in r.message and "size" in r.message and "only" in r.message for r in caplog.records)


async def test_a_short_read_is_an_error(tmp_path: Path) -> None:
    obj = MemoryObject("obj", payload(6))
    obj.short_reads = True
    with pytest.raises(WeightError) as failure:
        await Downloader(make_config(tmp_path)).fetch(obj)
    assert "returned" in str(failure.value) and "bytes" in str(failure.value)


async def test_an_empty_object(tmp_path: Path) -> None:
    obj = MemoryObject("empty", b"", sha256=hashlib.sha256(b"").hexdigest())
    path = await Downloader(make_config(tmp_path)).fetch(obj)
    assert path.read_bytes() == b"" and obj.reads == []


async def test_an_object_without_range_support_is_one_read(tmp_path: Path) -> None:
    data = payload(7)
    obj = MemoryObject("obj", data, accepts_ranges=False)
    path = await Downloader(make_config(tmp_path)).fetch(obj)
    assert path.read_bytes() == data and obj.reads == [(0, SIZE)]


# -- resume ------------------------------------------------------------------------------------------


async def test_the_side_file_records_completed_chunks_and_a_new_call_resumes(tmp_path: Path) -> None:
    data = payload(8)
    config = make_config(tmp_path)
    obj = MemoryObject("obj", data)
    obj.fail_at = 3 * CHUNK + 5
    with pytest.raises(SourceUnavailableError) as failure:
        await Downloader(config).fetch(obj)
    assert "injected failure" in str(failure.value)
    (progress_file,) = (config.cache_dir / "partial").glob("*.progress")
    record = ChunkProgress.from_json(progress_file.read_text())
    assert record is not None and record.size == SIZE and record.chunk_size == CHUNK and 3 not in record.done
    assert record.done, "chunks before the failure are recorded"
    assert json.loads(progress_file.read_text())["done"][0][0] == 0
    done_before = set(record.done)
    obj.fail_at, obj.reads = None, []
    path = await Downloader(config).fetch(obj)
    assert path.read_bytes() == data
    fetched = {start // CHUNK for start, _ in obj.reads}
    assert fetched.isdisjoint(done_before) and fetched | done_before == set(range(-(-SIZE // CHUNK)))


async def test_resume_keeps_the_recorded_chunk_size(tmp_path: Path) -> None:
    data = payload(9)
    obj = MemoryObject("obj", data)
    obj.fail_at = SIZE - 10
    with pytest.raises(SourceUnavailableError):
        await Downloader(make_config(tmp_path)).fetch(obj)
    obj.fail_at, obj.reads = None, []
    path = await Downloader(make_config(tmp_path, chunk_size=64 * 1024)).fetch(obj)
    assert path.read_bytes() == data
    assert all(end - start <= CHUNK for start, end in obj.reads) and obj.bytes_read < SIZE


async def test_an_unreadable_side_file_restarts_the_download(tmp_path: Path) -> None:
    data = payload(10)
    config = make_config(tmp_path)
    obj = MemoryObject("obj", data)
    obj.fail_at = SIZE - 10
    with pytest.raises(SourceUnavailableError):
        await Downloader(config).fetch(obj)
    (progress_file,) = (config.cache_dir / "partial").glob("*.progress")
    progress_file.write_text("{not json")
    obj.fail_at, obj.reads = None, []
    path = await Downloader(config).fetch(obj)
    assert path.read_bytes() == data and obj.bytes_read == SIZE


async def test_a_changed_object_is_not_resumed_into(tmp_path: Path) -> None:
    config = make_config(tmp_path)
    obj = MemoryObject("obj", payload(11))
    obj.fail_at = SIZE - 10
    with pytest.raises(SourceUnavailableError):
        await Downloader(config).fetch(obj)
    new = payload(12)
    obj.data, obj.etag, obj.fail_at, obj.reads = new, "v2", None, []
    path = await Downloader(config).fetch(obj)
    assert path.read_bytes() == new and obj.bytes_read == SIZE


async def test_closing_the_last_handle_cancels_and_keeps_the_partial(tmp_path: Path) -> None:
    data = payload(13)
    config = make_config(tmp_path)
    obj = MemoryObject("obj", data)
    obj.gate_at = SIZE // 2
    download = await Downloader(config).open(obj)
    await download.wait_range(0, CHUNK)
    await download.aclose()
    assert blob_names(config) == set() and any(n.endswith(".partial") for n in partial_names(config))
    obj.gate.set()
    read_before, obj.reads = obj.bytes_read, []
    path = await Downloader(config).fetch(obj)
    assert path.read_bytes() == data and obj.bytes_read < SIZE and read_before < SIZE
    with pytest.raises(RuntimeError):
        await download.read(0, 1)


async def test_waiters_get_the_download_error(tmp_path: Path) -> None:
    obj = MemoryObject("mem://failing", payload(14))
    obj.fail_at = 2 * CHUNK
    async with await Downloader(make_config(tmp_path)).open(obj) as download:
        with pytest.raises(SourceUnavailableError) as failure:
            await download.wait_range(0, SIZE)
        assert "mem://failing" in str(failure.value)
        with pytest.raises(SourceUnavailableError):
            await download.result()


# -- eviction ----------------------------------------------------------------------------------------


async def test_lru_eviction_keeps_the_cache_under_its_limit(tmp_path: Path) -> None:
    limit = int(2.5 * SIZE)
    config = make_config(tmp_path, max_cache_size_bytes=limit)
    downloader = Downloader(config)
    a, b, c = (MemoryObject(name, payload(20 + i)) for i, name in enumerate("abc"))
    tick = 0.02  # file times come from the kernel's coarse clock (a few ms): let each step have its own
    path_a = await downloader.fetch(a)
    await asyncio.sleep(tick)
    path_b = await downloader.fetch(b)
    await asyncio.sleep(tick)
    assert await downloader.fetch(a) == path_a  # a is now used more recently than b
    await asyncio.sleep(tick)
    path_c = await downloader.fetch(c)
    assert path_a.exists() and path_c.exists() and not path_b.exists()
    assert downloader.cache.usage_bytes() <= limit
    assert len(a.reads) == -(-SIZE // CHUNK), "a was downloaded once, then a cache hit"


async def test_a_blob_in_use_is_not_evicted(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    config = make_config(tmp_path, max_cache_size_bytes=int(1.5 * SIZE))
    downloader = Downloader(config)
    a, b, c = (MemoryObject(name, payload(30 + i)) for i, name in enumerate("abc"))
    async with await downloader.open(a) as in_use:
        path_a = await in_use.result()
        await asyncio.sleep(0.02)  # b's file times are later than a's (coarse kernel clock)
        with caplog.at_level(logging.WARNING, logger="ferrum.weights.download.cache"):
            path_b = await downloader.fetch(b)
        assert path_a.exists() and path_b.exists(), "a is in use: kept, over the limit"
        assert any("over its limit" in r.message for r in caplog.records)
        assert await in_use.read(0, 100) == a.data[:100]
    path_c = await downloader.fetch(c)
    assert not path_a.exists() and path_c.exists()
    assert downloader.cache.usage_bytes() <= int(1.5 * SIZE)


async def test_an_abandoned_partial_is_evicted(tmp_path: Path) -> None:
    config = make_config(tmp_path, max_cache_size_bytes=int(1.5 * SIZE))
    stale = MemoryObject("stale", payload(40))
    stale.fail_at = SIZE - 10
    with pytest.raises(SourceUnavailableError):
        await Downloader(config).fetch(stale)
    assert any(n.endswith(".partial") for n in partial_names(config))
    old = time.time() - 3600
    for path in (config.cache_dir / "partial").iterdir():
        os.utime(path, (old, old))
    await Downloader(config).fetch(MemoryObject("fresh", payload(41)))
    assert partial_names(config) == set()


def test_eviction_order_is_by_last_access(tmp_path: Path) -> None:
    cache = DownloadCache(tmp_path / "cache", max_size_bytes=300)
    now = time.time()
    for key in ["old", "older", "newest"]:
        path = cache.blob_path(key)
        path.write_bytes(b"x" * 100)
        stamp = now - {"old": 100, "older": 200, "newest": 0}[key]
        os.utime(path, (stamp, stamp))
    fd = cache.open_blob("older")  # an access makes it the most recent; it is pinned while open
    assert fd is not None
    os.close(fd)
    assert cache.make_room("incoming", 150) == 200
    assert sorted(p.name for p in cache.blobs_dir.iterdir()) == ["older"]


# -- concurrency and cache modes -----------------------------------------------------------------------


async def test_concurrent_opens_share_one_download(tmp_path: Path) -> None:
    data = payload(50)
    downloader = Downloader(make_config(tmp_path))
    obj = MemoryObject("obj", data, sha256=hashlib.sha256(data).hexdigest())
    paths = await asyncio.gather(*(downloader.fetch(obj) for _ in range(5)))
    assert len(set(paths)) == 1 and paths[0].read_bytes() == data and obj.bytes_read == SIZE


async def test_cache_disabled_uses_a_temporary_directory(tmp_path: Path) -> None:
    config = make_config(tmp_path, cache_enabled=False)
    downloader = Downloader(config)
    data = payload(51)
    path = await downloader.fetch(MemoryObject("obj", data))
    assert path.read_bytes() == data and not path.is_relative_to(config.cache_dir)
    assert not config.cache_dir.exists()
    downloader.close()
    assert not path.exists()


# -- progress and retry helpers ----------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_progress_logs_at_most_every_few_seconds(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    progress = Progress("mem://big", 100 * 2**20, mode="log", quiet_s=2.0, log_interval_s=5.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="ferrum.weights.download.downloader"):
        for _ in range(100):  # 1 MiB every 0.2 s: 20 s
            clock.now += 0.2
            progress.update(2**20)
        progress.close()
    lines = [r.message for r in caplog.records]
    assert 3 <= len(lines) <= 5, lines  # ~every 5 s after the quiet start, then the final line
    assert "mem://big" in lines[0] and "%" in lines[0] and "MiB" in lines[0]
    assert "downloaded 100.0 MiB" in lines[-1]


def test_progress_draws_a_bar_on_a_tty() -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    clock, stream = FakeClock(), Tty()
    progress = Progress("mem://big", 1000, mode="auto", stream=stream, quiet_s=0.0, clock=clock)
    clock.now += 1
    progress.update(500)
    progress.close()
    text = stream.getvalue()
    assert text.startswith("\rmem://big |") and "50.0%" in text and "100.0%" not in text.split("\r")[1]
    assert text.endswith("\n")


def test_progress_stays_quiet_for_short_downloads(caplog: pytest.LogCaptureFixture) -> None:
    stream = io.StringIO()
    progress = Progress("x", 1000, mode="bar", stream=stream, quiet_s=2.0, clock=FakeClock())
    progress.update(1000)
    progress.close()
    assert stream.getvalue() == ""


def test_retry_after_parsing() -> None:
    assert parse_retry_after("3") == 3.0
    assert parse_retry_after(None) is None and parse_retry_after("soon") is None
    later = email.utils.formatdate(time.time() + 30, usegmt=True)
    assert 25 <= (parse_retry_after(later) or 0) <= 31


def test_retry_delay_backs_off_with_jitter_and_honours_retry_after() -> None:
    policy = RetryPolicy(max_retries=5, base_delay_s=1.0, max_delay_s=8.0, max_retry_after_s=60)
    for retry, ceiling in [(0, 1.0), (1, 2.0), (2, 4.0), (3, 8.0), (6, 8.0)]:
        delays = {policy.delay(retry) for _ in range(20)}
        assert all(ceiling / 2 <= d <= ceiling for d in delays) and len(delays) > 1
    assert policy.delay(0, retry_after=30) == 30
    assert policy.delay(0, retry_after=3600) == 60


async def test_a_truncated_blob_is_fetched_again(tmp_path: Path) -> None:
    data = payload(52)
    config = make_config(tmp_path)
    obj = MemoryObject("obj", data)
    path = await Downloader(config).fetch(obj)
    with path.open("r+b") as f:
        f.truncate(SIZE // 2)
    obj.reads = []
    assert (await Downloader(config).fetch(obj)).read_bytes() == data and obj.bytes_read == SIZE
