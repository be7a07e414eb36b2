"""S3Object and the Downloader over S3: a moto server, with a fault-injecting proxy in front of it."""

from __future__ import annotations

import asyncio
import hashlib
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ferrum.weights.download.downloader import Downloader
from ferrum.weights.download.remote import RetryPolicy
from ferrum.weights.download.s3 import S3Object
from ferrum.weights.errors import IntegrityError, SourceNotFoundError, SourceUnavailableError, WeightError
from ferrum.weights.formats.safetensors_header import header_length, parse_header
from ferrum.weights.spec.loader_config import WeightLoaderConfig
from ferrum.weights.spec.sources import S3
from tests.conftest import S3Bucket, weights_config
from tests.fault_server import FaultServer
from tests.weights.download.test_http import FILE, SHA256, TENSORS

CHUNK = 128 * 1024
FAST_RETRY = RetryPolicy(max_retries=3, base_delay_s=0.02, max_delay_s=0.1)
KEY = "models/tiny/model.safetensors"
SLOW_DOWN = ("<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
             "<Message>Please reduce your request rate.</Message></Error>")


def make_config(tmp_path: Path, **overrides: object) -> WeightLoaderConfig:
    return weights_config(tmp_path, **{"chunk_size": CHUNK, **overrides})


@pytest.fixture
def bucket(s3_bucket: S3Bucket) -> S3Bucket:
    s3_bucket.put(KEY, FILE, ChecksumAlgorithm="SHA256")
    s3_bucket.put("plain/model.safetensors", FILE)  # no checksum: verified by its MD5 ETag
    return s3_bucket


def s3_object(bucket: S3Bucket, config: WeightLoaderConfig, key: str = KEY, *, endpoint: str | None = None,
              retry: RetryPolicy = FAST_RETRY) -> S3Object:
    return S3Object(S3(bucket.name, key, endpoint=endpoint or bucket.endpoint), config, retry=retry)


def blobs(config: WeightLoaderConfig) -> list[Path]:
    return sorted((config.cache_dir / "blobs").iterdir())


def partials(config: WeightLoaderConfig) -> list[str]:
    return sorted(p.name for p in (config.cache_dir / "partial").iterdir())


async def test_info_reports_sha256_and_md5(bucket: S3Bucket, tmp_path: Path) -> None:
    config = make_config(tmp_path)
    info = await s3_object(bucket, config).info()
    assert info.size == len(FILE) and info.sha256 == SHA256 and info.accepts_ranges
    plain = await s3_object(bucket, config, "plain/model.safetensors").info()
    assert plain.sha256 is None and plain.md5 == hashlib.md5(FILE).hexdigest()


async def test_header_read_reads_only_the_header(bucket: S3Bucket, s3_proxy: FaultServer, tmp_path: Path) -> None:
    obj = s3_object(bucket, make_config(tmp_path), endpoint=s3_proxy.base_url)
    n = header_length(await obj.read_range(0, 8), file_size=None, name=obj.name)
    header = parse_header(await obj.read_range(8, 8 + n), data_size=None, name=obj.name)
    assert set(header.tensors) == set(TENSORS)
    assert s3_proxy.bytes_served == 8 + n < len(FILE) // 50
    assert [r.range for r in s3_proxy.requests] == ["bytes=0-7", f"bytes=8-{8 + n - 1}"]


async def test_full_download_verified_by_sha256(bucket: S3Bucket, s3_proxy: FaultServer, tmp_path: Path) -> None:
    config = make_config(tmp_path)
    path = await Downloader(config).fetch(s3_object(bucket, config, endpoint=s3_proxy.base_url))
    assert path.name == f"sha256-{SHA256}" and path.read_bytes() == FILE
    loaded = load_file(path)
    assert all(torch.equal(loaded[name], tensor) for name, tensor in TENSORS.items())
    assert s3_proxy.bytes_served == len(FILE)
    assert s3_proxy.count("GET") == -(-len(FILE) // CHUNK) and s3_proxy.count("HEAD") == 1


async def test_full_download_verified_by_md5_etag(bucket: S3Bucket, tmp_path: Path) -> None:
    config = make_config(tmp_path)
    path = await Downloader(config).fetch(s3_object(bucket, config, "plain/model.safetensors"))
    assert path.name.startswith("s3-model.safetensors-") and path.read_bytes() == FILE


async def test_download_resumes_after_cuts(bucket: S3Bucket, s3_proxy: FaultServer, tmp_path: Path) -> None:
    s3_proxy.faults.cut_after_bytes, s3_proxy.faults.cut_times = 50_000, 2
    config = make_config(tmp_path)
    path = await Downloader(config).fetch(s3_object(bucket, config, endpoint=s3_proxy.base_url))
    assert path.read_bytes() == FILE
    assert s3_proxy.bytes_served < 2 * len(FILE)


async def test_download_resumes_across_calls(bucket: S3Bucket, s3_proxy: FaultServer, tmp_path: Path) -> None:
    config = make_config(tmp_path, max_retries=1)
    s3_proxy.faults.cut_at_offset, s3_proxy.faults.cut_times = len(FILE) * 3 // 4, None
    retry = RetryPolicy(max_retries=1, base_delay_s=0.01)
    with pytest.raises(SourceUnavailableError) as failure:
        await Downloader(config).fetch(s3_object(bucket, config, endpoint=s3_proxy.base_url, retry=retry))
    assert f"s3://{bucket.name}/{KEY}" in str(failure.value)
    assert blobs(config) == [] and f"sha256-{SHA256}.progress" in partials(config)
    first_served = s3_proxy.bytes_served
    s3_proxy.reset()
    path = await Downloader(config).fetch(s3_object(bucket, config, endpoint=s3_proxy.base_url))
    assert path.read_bytes() == FILE
    assert first_served + s3_proxy.bytes_served < 2 * len(FILE)
    assert s3_proxy.bytes_served <= len(FILE) // 2


@pytest.mark.parametrize("key, algorithm", [(KEY, "sha256"), ("plain/model.safetensors", "md5")])
async def test_corruption_in_transit_leaves_no_cache_entry(
    bucket: S3Bucket, s3_proxy: FaultServer, tmp_path: Path, key: str, algorithm: str
) -> None:
    s3_proxy.faults.corrupt_offset = 300_000
    config = make_config(tmp_path)
    with pytest.raises(IntegrityError) as failure:
        await Downloader(config).fetch(s3_object(bucket, config, key, endpoint=s3_proxy.base_url))
    message = str(failure.value)
    expected = hashlib.new(algorithm, FILE).hexdigest()
    corrupt = bytearray(FILE)
    corrupt[300_000] ^= 0xFF
    assert f"s3://{bucket.name}/{key}" in message and f"{algorithm} mismatch" in message
    assert expected in message and hashlib.new(algorithm, corrupt).hexdigest() in message
    assert blobs(config) == [] and partials(config) == []


async def test_object_replaced_mid_download_is_an_integrity_error(bucket: S3Bucket, tmp_path: Path) -> None:
    config = make_config(tmp_path)
    obj = s3_object(bucket, config, "plain/model.safetensors")
    await obj.info()
    bucket.put("plain/model.safetensors", FILE[::-1])
    with pytest.raises(IntegrityError) as failure:
        await obj.read_range(0, 8)
    assert "changed while being downloaded" in str(failure.value)


async def test_retries_on_slow_down_then_succeeds(bucket: S3Bucket, s3_proxy: FaultServer, tmp_path: Path) -> None:
    s3_proxy.faults.fail_status, s3_proxy.faults.fail_count, s3_proxy.faults.fail_body = 503, 2, SLOW_DOWN
    config = make_config(tmp_path)
    path = await Downloader(config).fetch(s3_object(bucket, config, endpoint=s3_proxy.base_url))
    assert path.read_bytes() == FILE
    assert sum(1 for r in s3_proxy.requests if r.status == 503) == 2


async def test_retries_on_500_and_429_with_retry_after(
    bucket: S3Bucket, s3_proxy: FaultServer, tmp_path: Path
) -> None:
    obj = s3_object(bucket, make_config(tmp_path), endpoint=s3_proxy.base_url)
    s3_proxy.faults.fail_status, s3_proxy.faults.fail_count = 500, 2
    assert await obj.read_range(0, 8) == FILE[:8]
    assert [r.status for r in s3_proxy.requests] == [500, 500, 206]
    s3_proxy.reset()
    s3_proxy.faults.fail_status, s3_proxy.faults.fail_count, s3_proxy.faults.retry_after = 429, 1, "1"
    started = time.monotonic()
    assert (await obj.info()).size == len(FILE)
    assert time.monotonic() - started >= 0.95
    assert [r.status for r in s3_proxy.requests] == [429, 200]


async def test_no_retry_on_missing_key_or_bucket(bucket: S3Bucket, s3_proxy: FaultServer, tmp_path: Path) -> None:
    config = make_config(tmp_path)
    with pytest.raises(SourceNotFoundError) as failure:
        await s3_object(bucket, config, "models/none.safetensors", endpoint=s3_proxy.base_url).info()
    assert f"s3://{bucket.name}/models/none.safetensors" in str(failure.value)
    assert len(s3_proxy.requests) == 1
    s3_proxy.reset()
    missing_bucket = S3Object(S3("no-such-bucket-here", KEY, endpoint=s3_proxy.base_url), config, retry=FAST_RETRY)
    with pytest.raises(SourceNotFoundError) as failure:
        await missing_bucket.read_range(0, 8)
    assert "no such bucket" in str(failure.value) and f"s3://no-such-bucket-here/{KEY}" in str(failure.value)
    assert len(s3_proxy.requests) == 1


async def test_no_retry_on_403(bucket: S3Bucket, s3_proxy: FaultServer, tmp_path: Path) -> None:
    s3_proxy.faults.forbidden.add(f"{bucket.name}/{KEY}")
    with pytest.raises(WeightError) as failure:
        await s3_object(bucket, make_config(tmp_path), endpoint=s3_proxy.base_url).info()
    assert not isinstance(failure.value, SourceUnavailableError)
    assert "access denied" in str(failure.value) and "credentials" in str(failure.value)
    assert f"s3://{bucket.name}/{KEY}" in str(failure.value)
    assert len(s3_proxy.requests) == 1


async def test_stalled_server_times_out(bucket: S3Bucket, s3_proxy: FaultServer, tmp_path: Path) -> None:
    s3_proxy.faults.delay_s = 30
    config = make_config(tmp_path, timeout_s=0.3, max_retries=1)
    obj = s3_object(bucket, config, endpoint=s3_proxy.base_url, retry=RetryPolicy(max_retries=1, base_delay_s=0.05))
    started = time.monotonic()
    with pytest.raises(SourceUnavailableError) as failure:
        await obj.read_range(0, 8)
    elapsed = time.monotonic() - started
    assert "timed out" in str(failure.value) and len(s3_proxy.requests) == 0  # the proxy never got to answer
    assert 0.6 <= elapsed < 5.0, elapsed  # two 0.3 s timeouts, not the 30 s stall (2.7 s seen on a loaded CI machine)


async def test_endpoint_from_the_standard_chain(bucket: S3Bucket, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", bucket.endpoint)
    config = make_config(tmp_path)
    obj = S3Object(S3(bucket.name, KEY), config, retry=FAST_RETRY)  # no endpoint in the source
    assert (await obj.info()).sha256 == SHA256


async def test_concurrent_fetches_share_one_download(
    bucket: S3Bucket, s3_proxy: FaultServer, tmp_path: Path
) -> None:
    config = make_config(tmp_path)
    downloader = Downloader(config)
    objects = [s3_object(bucket, config, endpoint=s3_proxy.base_url) for _ in range(2)]
    paths = await asyncio.gather(*(downloader.fetch(obj) for obj in objects))
    assert paths[0] == paths[1] and paths[0].read_bytes() == FILE
    assert s3_proxy.bytes_served == len(FILE)


async def test_body_stalling_mid_range_times_out(bucket: S3Bucket, s3_proxy: FaultServer, tmp_path: Path) -> None:
    s3_proxy.faults.stall_at_offset, s3_proxy.faults.stall_s = 40_000, 30
    config = make_config(tmp_path, timeout_s=0.3, max_retries=1)
    obj = s3_object(bucket, config, endpoint=s3_proxy.base_url, retry=RetryPolicy(max_retries=1, base_delay_s=0.05))
    started = time.monotonic()
    with pytest.raises(SourceUnavailableError) as failure:
        await obj.read_range(0, 100_000)
    elapsed = time.monotonic() - started
    assert "timed out" in str(failure.value)
    assert 0.6 <= elapsed < 5.0, elapsed  # two 0.3 s timeouts, not the 30 s stall (2.7 s seen on a loaded CI machine)
    first, second = (r.range or "" for r in s3_proxy.requests)
    resumed_at = int(second.removeprefix("bytes=").split("-")[0])
    assert first == "bytes=0-99999" and 0 < resumed_at <= 40_000, "the retry resumes near the stall"
