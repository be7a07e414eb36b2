"""HttpObject and the Downloader over HTTP, against the fault-injecting test server."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save

from ferrum.weights.download.downloader import Downloader
from ferrum.weights.download.http import HttpObject
from ferrum.weights.download.remote import RetryPolicy
from ferrum.weights.errors import (
    IntegrityError,
    SourceNotFoundError,
    SourceUnavailableError,
    UnsupportedError,
    WeightError,
)
from ferrum.weights.formats.safetensors_header import header_length, parse_header
from ferrum.weights.spec.loader_config import WeightLoaderConfig
from ferrum.weights.spec.sources import Url
from tests.conftest import weights_config
from tests.fault_server import FaultServer

CHUNK = 64 * 1024
FAST_RETRY = RetryPolicy(max_retries=3, base_delay_s=0.02, max_delay_s=0.1)


def make_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed.weight": torch.randn(256, 512, generator=g),  # 512 KiB
        "layer.0.weight": torch.randn(128, 256, generator=g).to(torch.float16),
        "layer.0.bias": torch.randn(128, generator=g),
    }


TENSORS = make_tensors()
FILE = save(TENSORS)
SHA256 = hashlib.sha256(FILE).hexdigest()


def make_config(tmp_path: Path, **overrides: object) -> WeightLoaderConfig:
    return weights_config(tmp_path, **{"chunk_size": CHUNK, **overrides})


@pytest.fixture
def server(fault_server: FaultServer) -> FaultServer:
    fault_server.files["model.safetensors"] = FILE
    return fault_server


def http_object(server: FaultServer, config: WeightLoaderConfig, path: str = "model.safetensors",
                retry: RetryPolicy = FAST_RETRY) -> HttpObject:
    return HttpObject(server.url(path), None, config, retry=retry)


def blobs(config: WeightLoaderConfig) -> list[Path]:
    return sorted((config.cache_dir / "blobs").iterdir())


def partials(config: WeightLoaderConfig) -> list[str]:
    return sorted(p.name for p in (config.cache_dir / "partial").iterdir())


async def test_header_read_reads_only_the_header(server: FaultServer, tmp_path: Path) -> None:
    async with http_object(server, make_config(tmp_path)) as obj:
        first8 = await obj.read_range(0, 8)
        n = header_length(first8, file_size=None, name=obj.name)
        header = parse_header(await obj.read_range(8, 8 + n), data_size=None, name=obj.name)
    assert set(header.tensors) == set(TENSORS)
    assert server.bytes_served == 8 + n
    assert server.bytes_served < len(FILE) // 50
    assert [r.range for r in server.requests] == ["bytes=0-7", f"bytes=8-{8 + n - 1}"]


async def test_info_from_head(server: FaultServer, tmp_path: Path) -> None:
    async with http_object(server, make_config(tmp_path)) as obj:
        info = await obj.info()
    assert info.size == len(FILE) and info.accepts_ranges and info.etag is not None
    assert info.sha256 is None and info.md5 is None
    assert server.bytes_served == 0 and [r.method for r in server.requests] == ["HEAD"]


async def test_info_falls_back_to_a_ranged_get_when_head_is_refused(server: FaultServer, tmp_path: Path) -> None:
    server.faults.head_status = 405
    async with http_object(server, make_config(tmp_path)) as obj:
        info = await obj.info()
    assert info.size == len(FILE) and info.accepts_ranges
    assert [(r.method, r.range) for r in server.requests] == [("HEAD", None), ("GET", "bytes=0-0")]
    assert server.bytes_served == 1


async def test_full_download_equals_the_original(server: FaultServer, tmp_path: Path) -> None:
    config = make_config(tmp_path)
    async with http_object(server, config) as obj:
        path = await Downloader(config).fetch(obj)
    assert path.read_bytes() == FILE
    loaded = load_file(path)
    assert loaded.keys() == TENSORS.keys()
    for name, tensor in TENSORS.items():
        assert torch.equal(loaded[name], tensor)
    gets = [r for r in server.requests if r.method == "GET"]
    assert len(gets) == -(-len(FILE) // CHUNK) and all(r.status == 206 for r in gets)
    assert server.bytes_served == len(FILE)
    assert path.parent == config.cache_dir / "blobs" and partials(config) == []


async def test_cache_hit_makes_no_download(server: FaultServer, tmp_path: Path) -> None:
    config = make_config(tmp_path)
    async with http_object(server, config) as obj:
        first = await Downloader(config).fetch(obj)
        server.reset()
        again = await Downloader(config).fetch(obj)
    assert again == first
    assert [r.method for r in server.requests] == ["HEAD"], "without a sha256: one HEAD, no GET"


async def test_cache_hit_by_sha256_makes_no_request(server: FaultServer, tmp_path: Path) -> None:
    config = make_config(tmp_path)
    async with http_object(server, config) as obj:
        first = await Downloader(config).fetch(obj, expected_sha256=SHA256)
        assert first.name == f"sha256-{SHA256}"
        server.reset()
        again = await Downloader(config).fetch(obj, expected_sha256=SHA256.upper())
    assert again == first and server.requests == []


async def test_download_resumes_within_the_call_after_cuts(server: FaultServer, tmp_path: Path) -> None:
    server.faults.cut_after_bytes = 20_000
    server.faults.cut_times = 3
    config = make_config(tmp_path)
    async with http_object(server, config) as obj:
        path = await Downloader(config).fetch(obj, expected_sha256=SHA256)
    assert path.read_bytes() == FILE
    assert server.bytes_served < 2 * len(FILE)
    assert server.bytes_served == len(FILE), "a cut range continues from its last byte"
    assert sum(1 for r in server.requests if r.status == 206) == -(-len(FILE) // CHUNK) + 3


async def test_download_resumes_across_calls_from_completed_chunks(server: FaultServer, tmp_path: Path) -> None:
    config = make_config(tmp_path, max_retries=1)
    cut_at = len(FILE) * 3 // 4
    server.faults.cut_at_offset = cut_at
    server.faults.cut_times = None  # the connection always dies there
    async with http_object(server, config, retry=RetryPolicy(max_retries=1, base_delay_s=0.01)) as obj:
        with pytest.raises(SourceUnavailableError) as failure:
            await Downloader(config).fetch(obj, expected_sha256=SHA256)
        assert obj.name in str(failure.value) and "gave up after 2 attempts" in str(failure.value)
        assert blobs(config) == []
        key = f"sha256-{SHA256}"
        assert partials(config) == [f"{key}.lock", f"{key}.partial", f"{key}.progress"]
        first_served = server.bytes_served
        server.reset()
        path = await Downloader(config).fetch(obj, expected_sha256=SHA256)  # a new downloader: as a new process
    assert path.read_bytes() == FILE
    assert first_served + server.bytes_served < 2 * len(FILE)
    assert server.bytes_served <= len(FILE) // 2, "only the chunks missing after the cut are fetched again"
    assert partials(config) == []


async def test_checksum_mismatch_leaves_no_cache_entry(server: FaultServer, tmp_path: Path) -> None:
    server.faults.corrupt_offset = 100_000
    config = make_config(tmp_path)
    async with http_object(server, config) as obj:
        with pytest.raises(IntegrityError) as failure:
            await Downloader(config).fetch(obj, expected_sha256=SHA256)
    message = str(failure.value)
    assert obj.name in message and SHA256 in message and "sha256 mismatch" in message
    actual = bytearray(FILE)
    actual[100_000] ^= 0xFF
    assert hashlib.sha256(actual).hexdigest() in message
    assert blobs(config) == [] and partials(config) == []


async def test_sha256_from_the_config_is_verified(server: FaultServer, tmp_path: Path) -> None:
    server.faults.corrupt_offset = 7
    url = server.url("model.safetensors")
    config = make_config(tmp_path, expected_sha256={url: SHA256})
    async with http_object(server, config) as obj:
        assert (await obj.info()).sha256 == SHA256
        with pytest.raises(IntegrityError):
            await Downloader(config).fetch(obj)
        assert blobs(config) == []
        server.reset()
        path = await Downloader(config).fetch(obj)
    assert path.name == f"sha256-{SHA256}" and path.read_bytes() == FILE


async def test_retries_on_500_then_succeeds(server: FaultServer, tmp_path: Path) -> None:
    server.faults.fail_status, server.faults.fail_count = 500, 2
    config = make_config(tmp_path)
    async with http_object(server, config) as obj:
        path = await Downloader(config).fetch(obj)
    assert path.read_bytes() == FILE
    assert sum(1 for r in server.requests if r.status == 500) == 2


async def test_retries_on_429_honouring_retry_after(server: FaultServer, tmp_path: Path) -> None:
    server.faults.fail_status, server.faults.fail_count, server.faults.retry_after = 429, 1, "1"
    async with http_object(server, make_config(tmp_path)) as obj:
        started = time.monotonic()
        info = await obj.info()
        elapsed = time.monotonic() - started
    assert info.size == len(FILE)
    assert elapsed >= 0.95, "Retry-After: 1 is waited for, although the backoff alone is ~0.02 s"
    assert [r.status for r in server.requests] == [429, 200]


async def test_gives_up_after_max_retries(server: FaultServer, tmp_path: Path) -> None:
    server.faults.fail_status, server.faults.fail_count = 503, 100
    async with http_object(server, make_config(tmp_path)) as obj:
        with pytest.raises(SourceUnavailableError) as failure:
            await obj.read_range(0, 8)
    assert "HTTP 503" in str(failure.value) and "gave up after 4 attempts" in str(failure.value)
    assert len(server.requests) == 4


async def test_no_retry_on_404(server: FaultServer, tmp_path: Path) -> None:
    async with http_object(server, make_config(tmp_path), "missing.safetensors") as obj:
        with pytest.raises(SourceNotFoundError) as failure:
            await obj.info()
        assert "missing.safetensors" in str(failure.value) and "404" in str(failure.value)
        assert len(server.requests) == 1
        server.reset()
        with pytest.raises(SourceNotFoundError):
            await obj.read_range(0, 8)
        assert len(server.requests) == 1


async def test_no_retry_on_403(server: FaultServer, tmp_path: Path) -> None:
    server.faults.forbidden.add("model.safetensors")
    async with http_object(server, make_config(tmp_path)) as obj:
        with pytest.raises(WeightError) as failure:
            await obj.read_range(0, 8)
    assert not isinstance(failure.value, SourceUnavailableError)
    assert "403" in str(failure.value) and "model.safetensors" in str(failure.value)
    assert len(server.requests) == 1


async def test_server_that_never_answers_times_out(server: FaultServer, tmp_path: Path) -> None:
    server.faults.delay_s = 30
    config = make_config(tmp_path, timeout_s=0.3, max_retries=1)
    async with http_object(server, config, retry=RetryPolicy(max_retries=1, base_delay_s=0.05)) as obj:
        started = time.monotonic()
        with pytest.raises(SourceUnavailableError) as failure:
            await obj.info()
        elapsed = time.monotonic() - started
    assert "timed out" in str(failure.value) and "0.3 s" in str(failure.value)
    assert 0.6 <= elapsed < 2.0, elapsed


async def test_server_that_stalls_mid_body_times_out(server: FaultServer, tmp_path: Path) -> None:
    server.faults.stall_at_offset, server.faults.stall_s = 40_000, 30
    config = make_config(tmp_path, timeout_s=0.3, max_retries=1)
    async with http_object(server, config, retry=RetryPolicy(max_retries=1, base_delay_s=0.05)) as obj:
        started = time.monotonic()
        with pytest.raises(SourceUnavailableError) as failure:
            await obj.read_range(0, 100_000)
        elapsed = time.monotonic() - started
    assert "stalled" in str(failure.value) and "no data for 0.3 s" in str(failure.value)
    assert 0.6 <= elapsed < 2.0, elapsed


async def test_server_ignoring_range_small_object(server: FaultServer, tmp_path: Path) -> None:
    server.faults.ignore_range = True
    config = make_config(tmp_path)
    async with http_object(server, config) as obj:
        info = await obj.info()
        assert info.size == len(FILE) and not info.accepts_ranges
        assert await obj.read_range(1000, 1010) == FILE[1000:1010]  # read and sliced (a small object)
        server.reset()
        server.faults.ignore_range = True
        path = await Downloader(config).fetch(obj)
    assert path.read_bytes() == FILE
    assert [(r.method, r.status) for r in server.requests] == [("HEAD", 200), ("GET", 200), ("GET", 200)], (
        "the probe, then one whole-object GET")


async def test_server_ignoring_range_big_object_is_refused_for_inner_ranges(
    server: FaultServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ferrum.weights.download.http as http_module

    monkeypatch.setattr(http_module, "SMALL_OBJECT_BYTES", 10_000)
    server.faults.ignore_range = True
    async with http_object(server, make_config(tmp_path)) as obj:
        assert await obj.read_range(0, 100) == FILE[:100]  # from byte 0: the body's start is read
        with pytest.raises(UnsupportedError) as failure:
            await obj.read_range(5000, 5100)
    assert "ignores Range" in str(failure.value)


@pytest.mark.parametrize("url", ["ftp://example.com/model.safetensors", "file:///etc/passwd",
                                 "s3://bucket/key", "model.safetensors"])
def test_non_http_scheme_is_refused(url: str, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedError) as failure:
        HttpObject(url, None, make_config(tmp_path))
    assert "http:// or https://" in str(failure.value)
    with pytest.raises(UnsupportedError):
        Url(url)


async def test_concurrent_fetches_share_one_download(server: FaultServer, tmp_path: Path) -> None:
    config = make_config(tmp_path)
    downloader = Downloader(config)
    async with http_object(server, config) as obj:
        paths = await asyncio.gather(downloader.fetch(obj, SHA256), downloader.fetch(obj, SHA256))
    assert paths[0] == paths[1] and paths[0].read_bytes() == FILE
    assert server.bytes_served == len(FILE)


async def test_concurrent_fetches_from_two_downloaders(server: FaultServer, tmp_path: Path) -> None:
    config = make_config(tmp_path)
    async with http_object(server, config) as one, http_object(server, config) as two:
        paths = await asyncio.gather(Downloader(config).fetch(one), Downloader(config).fetch(two))
    assert paths[0] == paths[1] and paths[0].read_bytes() == FILE
    assert server.bytes_served == len(FILE), "the second waits for the first's lock, then finds the blob"


async def test_bytes_can_be_used_before_the_download_ends(server: FaultServer, tmp_path: Path) -> None:
    server.faults.stall_at_offset, server.faults.stall_s = len(FILE) // 2, 1.0  # a slow middle
    config = make_config(tmp_path, max_concurrent_downloads=1)
    async with http_object(server, config) as obj, await Downloader(config).open(obj, SHA256) as download:
        header = await download.read(0, 8)
        assert not download.complete, "the head of the file is usable while the rest is on its way"
        last = await download.read(len(FILE) - 100, len(FILE))  # jumps the queue
        assert header == FILE[:8] and last == FILE[-100:]
        path = await download.result()
        assert download.complete and download.path == path
    assert path.read_bytes() == FILE
