"""Start a real `ferrum serve` subprocess on a free loopback port for a test, and stop it after."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
MODEL_DIR = ROOT / "models" / "SmolLM2-135M-Instruct"
STARTUP_TIMEOUT_S = 180


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_process_group(proc: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM the process group started with start_new_session=True; SIGKILL it after `grace_s`."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@contextmanager
def live_server(*args: str) -> Iterator[str]:
    """Yields the base URL of a healthy server started with `ferrum serve ARGS --port P`."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile("w+", prefix="ferrum-serve-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "ferrum.cli", "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                log.seek(0)
                pytest.fail(f"server exited with {proc.returncode}:\n{log.read()[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                log.seek(0)
                pytest.fail(f"server not healthy after {STARTUP_TIMEOUT_S}s:\n{log.read()[-4000:]}")
            time.sleep(0.3)
        yield url
    finally:
        stop_process_group(proc, grace_s=20)
        log.close()
        os.unlink(log.name)
