"""A server's life: HTTP before the model (liveness at once, readiness with the start-up phase and its
progress), a port in use found before anything loads, weight-load faults that /ready explains
before a non-zero exit, and the drain on SIGTERM / Ctrl-C that lets work finish, ends the rest
with a stated reason and exits 0."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.fault_server import FaultServer
from tests.live_server import MODEL_DIR, ServerProcess, server_process
from tests.tiny_model import folder_files, make_tiny_llama
from tests.weights.locations.test_model_sources import run_cli

pytestmark = pytest.mark.slow
demo = pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason="demo model not prepared")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("life") / "tiny", max_shard_size="2MB")


def poll_ready(server: ServerProcess, until: Any, timeout_s: float = 60) -> list[dict[str, Any]]:
    """GET /ready bodies (with their status as "_status") until `until(body)`, checking that /health
    answers 200 all along."""
    seen: list[dict[str, Any]] = []
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            r = httpx.get(f"{server.url}/ready", timeout=2)
            assert httpx.get(f"{server.url}/health", timeout=2).status_code == 200
        except httpx.ConnectError:
            time.sleep(0.05)
            continue
        body = {**r.json(), "_status": r.status_code}
        seen.append(body)
        if until(body):
            return seen
        time.sleep(0.05)
    pytest.fail(f"/ready never got there: {seen[-3:]}\n{server.log()[-3000:]}")


def test_http_comes_first_and_ready_reports_the_phases(fault_server: FaultServer, tiny: Path, tmp_path: Path) -> None:
    files = folder_files(tiny)
    fault_server.files.update({f"tiny/{name}": data for name, data in files.items()})
    shard = next(n for n in files if n.startswith("model-00002"))
    fault_server.faults.stall_at_offset = len(files[shard]) // 2  # weights arrive, then stop for a while
    fault_server.faults.stall_s = 3.0
    fault_server.faults.fault_path = f"/tiny/{shard}"
    with server_process("--model", fault_server.url("tiny/"), "--backend", "cpu", "--dtype", "float32",
                        "--cache-dir", str(tmp_path / "cache"), "--max-model-len", "64", ready=False) as server:
        seen = poll_ready(server, lambda body: body["_status"] == 200)
    phases = [b["phase"] for b in seen]
    assert phases[-1] == "ready" and all(b["_status"] == 503 for b in seen[:-1])
    assert "loading" in phases
    partial = [b["progress"] for b in seen if b["phase"] == "loading" and "progress" in b]
    assert any(0 < p["done_bytes"] < p["total_bytes"] for p in partial), partial  # while the shard stalled
    order = {"starting": 0, "fetching": 1, "loading": 2, "warming": 3, "ready": 4}
    assert [order[p] for p in phases] == sorted(order[p] for p in phases)  # never back


def test_a_port_in_use_is_found_before_the_model_loads() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        started = time.monotonic()
        result = run_cli("serve", "--model", str(MODEL_DIR), "--backend", "cpu", "--port", str(port))
    assert result.returncode == 2, result.stderr
    assert f"cannot listen on 127.0.0.1:{port}: the address is already in use" in result.stderr
    assert "Traceback" not in result.stderr and "weights" not in result.stderr  # nothing loaded
    assert time.monotonic() - started < 30


@pytest.mark.parametrize("fault", ["corrupt byte", "server error", "missing file"])
def test_weight_load_faults_are_explained_then_exit_nonzero(
    fault_server: FaultServer, tiny: Path, tmp_path: Path, fault: str
) -> None:
    files = folder_files(tiny)
    fault_server.files.update({f"tiny/{name}": data for name, data in files.items()})
    shard = next(n for n in files if n.startswith("model-00002"))
    pins = {shard: hashlib.sha256(files[shard]).hexdigest()}
    if fault == "corrupt byte":
        fault_server.faults.corrupt_offset, fault_server.faults.fault_path = len(files[shard]) - 10, f"/tiny/{shard}"
    elif fault == "server error":
        fault_server.faults.fail_status, fault_server.faults.fail_count = 500, 10**6
    else:
        fault_server.faults.not_found = {f"tiny/{shard}"}
    cache = tmp_path / "cache"
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"model: {{source: url, url: '{fault_server.url('tiny/')}', sha256: {{{shard}: '{pins[shard]}'}}}}\n"
        f"weights: {{cache_dir: '{cache}', max_retries: 1}}\n"
    )
    expect = {"corrupt byte": ("sha256", shard), "server error": ("500",), "missing file": ("404", shard)}[fault]
    with server_process("--config", str(config), "--backend", "cpu", "--failed-start-linger", "5",
                        ready=False) as server:
        seen = poll_ready(server, lambda body: body["phase"] in ("failed", "ready"), timeout_s=90)
        failed = seen[-1]
        assert failed["_status"] == 503 and failed["status"] == "unavailable"
        assert all(fragment in failed["error"] for fragment in expect), failed
        code = server.wait_exit(60)
        log = server.log()
    assert code == 2, log[-2000:]
    digests = {hashlib.sha256(data).hexdigest() for data in files.values()}
    for blob in (cache / "blobs").glob("*") if (cache / "blobs").exists() else []:
        assert hashlib.sha256(blob.read_bytes()).hexdigest() in digests  # only verified files
    models = list((cache / "models").iterdir()) if (cache / "models").exists() else []
    published = [p for p in models if not p.name.startswith(".")]  # (".…parts" holds the small files)
    assert published == []  # no model folder for the next start to trust


# -- the drain ------------------------------------------------------------------------------------------


async def _stream(client: httpx.AsyncClient, url: str, max_tokens: int, first: asyncio.Event) -> dict[str, Any]:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    # tokens: the final usage chunk's count (a chunk may carry several tokens when the client reads slowly)
    out: dict[str, Any] = {"tokens": None, "finish": None, "error": None, "done": False}
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                out["done"] = True
                continue
            event = json.loads(line[6:])
            if "error" in event:
                out["error"] = event["error"]
                continue
            if event.get("usage"):
                out["tokens"] = event["usage"]["completion_tokens"]
            if not event["choices"]:  # the usage chunk
                continue
            choice = event["choices"][0]
            out["finish"] = choice["finish_reason"] or out["finish"]
            first.set()
    return out


@demo
def test_sigterm_drains_streams_and_exits_zero() -> None:
    with server_process("--model", str(MODEL_DIR), "--backend", "cpu", "--dtype", "float32", "--max-model-len",
                        "2048", "--shutdown-timeout", "3") as server:
        async def run() -> tuple[list[dict[str, Any]], int, int, float]:
            async with httpx.AsyncClient(timeout=120) as client:
                firsts = [asyncio.Event() for _ in range(32)]
                streams = [asyncio.create_task(_stream(client, server.url, 8 if i % 2 else 1500, firsts[i]))
                           for i in range(32)]
                await asyncio.wait_for(asyncio.gather(*(f.wait() for f in firsts)), 120)
                os.kill(server.proc.pid, signal.SIGTERM)
                signalled = time.monotonic()
                await asyncio.sleep(0.5)
                ready = (await client.get(f"{server.url}/ready")).status_code
                refused = (await client.post(f"{server.url}/v1/completions", json={"prompt": "Hi"})).status_code
                results = await asyncio.gather(*streams)
                return results, ready, refused, time.monotonic() - signalled

        results, ready, refused, took = asyncio.run(run())
        code = server.wait_exit(30)
        log = server.log()
    assert (ready, refused) == (503, 503)
    short, long = results[1::2], results[0::2]
    assert all(r["finish"] == "length" and r["error"] is None and r["done"] for r in short), short
    for r in long:  # ended by the shutdown: finish_reason abort, then an error event saying why
        assert r["finish"] == "abort" and r["done"], r
        assert r["error"]["code"] == "server_shutting_down" and "shutting down" in r["error"]["message"]
    assert took < 3 + 10
    assert code == 0, log[-2000:]
    assert "draining: 32 request(s) in flight" in log and "16 ended by the shutdown" in log


@demo
def test_ctrl_c_drains_an_engine_process_too() -> None:
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it: the engine process ignores
    it, the server drains (the request in flight finishes), stops the engine and exits 0."""
    with server_process("--model", str(MODEL_DIR), "--backend", "cpu", "--dtype", "float32", "--max-model-len", "256",
                        "--engine-process", "on") as server:
        async def run() -> dict[str, Any]:
            async with httpx.AsyncClient(timeout=120) as client:
                first = asyncio.Event()
                stream = asyncio.create_task(_stream(client, server.url, 48, first))
                await asyncio.wait_for(first.wait(), 60)
                os.killpg(server.proc.pid, signal.SIGINT)
                return await stream

        result = asyncio.run(run())
        code = server.wait_exit(60)
        log = server.log()
    assert result["finish"] == "length" and result["error"] is None and result["tokens"] == 48
    assert code == 0, log[-2000:]
    assert "drained: 1 finished, 0 ended by the shutdown" in log
