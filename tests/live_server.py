"""Start a real `ferrum serve` subprocess on a free loopback port for a test, and stop it after."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
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


@dataclass
class ServerProcess:
    """A `ferrum serve` child: its base URL, process (in a session of its own) and log file."""

    url: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/ready", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"server not ready after {timeout_s}s:\n{self.log()[-4000:]}")
            time.sleep(0.2)

    def wait_exit(self, timeout_s: float) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"server still running after {timeout_s}s:\n{self.log()[-4000:]}")


@contextmanager
def server_process(*args: str, env: Mapping[str, str] | None = None, ready: bool = True,
                   scheme: str = "http") -> Iterator[ServerProcess]:
    """`ferrum serve ARGS --host 127.0.0.1 --port P` started (and waited for until GET /ready is 200
    when `ready`); SIGTERM'd (then SIGKILL'd) at the end if still running."""
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+b", prefix="ferrum-serve-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "ferrum.cli", "serve", *args, "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                            env=None if env is None else {**os.environ, **env})
    handle = ServerProcess(f"{scheme}://127.0.0.1:{port}", proc, Path(log.name))
    try:
        if ready:
            handle.wait_ready()
        yield handle
    finally:
        stop_process_group(proc, grace_s=20)
        log.close()
        os.unlink(log.name)


@contextmanager
def live_server(*args: str) -> Iterator[str]:
    """Yields the base URL of a ready server (GET /ready 200) started with `ferrum serve ARGS --port P`."""
    with server_process(*args) as server:
        yield server.url
