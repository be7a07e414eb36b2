"""Shared fixtures: a fault-injecting HTTP server, a moto S3 server (with a bucket per test) and a
fault-injecting proxy in front of it."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

if not torch.cuda.is_available():
    # The GPU path's Triton kernels run in Triton's interpreter here; it must be chosen before
    # anything imports triton (see tests/triton_interpreter.py).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.fault_server import FaultServer

S3_REGION = "us-east-1"


@pytest.fixture
def fault_server() -> Iterator[FaultServer]:
    """A FaultServer on 127.0.0.1 serving `fault_server.files` (empty at first)."""
    server = FaultServer()
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """The URL of a moto S3 server on 127.0.0.1, started once per session."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake credentials and a region in the environment; nothing from the user's AWS setup."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN", "AWS_ENDPOINT_URL",
                 "AWS_ENDPOINT_URL_S3", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", S3_REGION)
    monkeypatch.setenv("AWS_REGION", S3_REGION)
    monkeypatch.setenv("AWS_CONFIG_FILE", "/dev/null")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", "/dev/null")


@dataclass
class S3Bucket:
    """A fresh bucket on the moto server: `client` (boto3, talking to moto directly) puts objects."""

    name: str
    endpoint: str
    client: Any

    def put(self, key: str, data: bytes, **kwargs: Any) -> None:
        self.client.put_object(Bucket=self.name, Key=key, Body=data, **kwargs)


@pytest.fixture
def s3_bucket(moto_endpoint: str, aws_env: None) -> S3Bucket:
    import boto3

    client = boto3.session.Session().client("s3", region_name=S3_REGION, endpoint_url=moto_endpoint)
    name = f"test-{uuid.uuid4().hex[:12]}"
    client.create_bucket(Bucket=name)
    return S3Bucket(name, moto_endpoint, client)


@pytest.fixture
def s3_proxy(moto_endpoint: str) -> Iterator[FaultServer]:
    """A FaultServer forwarding to moto: point an S3 source's endpoint at `s3_proxy.base_url` to
    inject faults into what moto answers."""
    server = FaultServer(upstream=moto_endpoint)
    server.start()
    try:
        yield server
    finally:
        server.stop()


# -- the demo model, offline ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for the module: on 2 shared cores, 2 threads make each matmul wait on a
    descheduled thread (about 10x slower); 1 thread is fast and steady."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def engine() -> Any:
    """The demo model in float32 (exact against HF), with a small KV cache and 1024-token context."""
    from tests.engines import local_engine
    from tests.live_server import MODEL_DIR

    return local_engine(MODEL_DIR, dtype="float32", kv_cache_memory_gb=0.1, max_model_len=1024)


def weights_config(tmp_path: Any, **overrides: object) -> Any:
    """A WeightLoaderConfig for download tests: cache under tmp_path, small chunks, short time-outs,
    no progress output."""
    from ferrum.weights.spec.loader_config import WeightLoaderConfig

    settings: dict[str, object] = {
        "cache_dir": tmp_path / "cache", "chunk_size": 64 * 1024, "max_concurrent_downloads": 4,
        "timeout_s": 2.0, "max_retries": 3, "progress": "off",
    }
    settings.update(overrides)
    return WeightLoaderConfig(**settings)  # type: ignore[arg-type]
