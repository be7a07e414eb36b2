"""`ferrum chat` and `ferrum run`, driven through a pseudo-terminal as a person would type: a question in, the
streamed answer out, a multi-line message, /system, /clear, /save, and a clean exit."""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.live_server import MODEL_DIR, live_server

pytestmark = pytest.mark.slow
FERRUM = [sys.executable, "-m", "ferrum.cli"]


class Terminal:
    """A program on the slave side of a pty; `type` sends a line, `until` reads up to a text."""

    def __init__(self, args: list[str]) -> None:
        self.master, slave = pty.openpty()
        env = {**os.environ, "OPENAI_API_KEY": "", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(args, stdin=slave, stdout=slave, stderr=slave, env=env, close_fds=True)
        os.close(slave)
        self.seen = ""

    def until(self, text: str, timeout_s: float = 120) -> str:
        deadline = time.monotonic() + timeout_s
        start = len(self.seen)
        while text not in self.seen[start:]:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(f"no {text!r} in the terminal after {timeout_s} s:\n{self.seen[-2000:]}")
            ready, _, _ = select.select([self.master], [], [], min(remaining, 1))
            if ready:
                try:
                    self.seen += os.read(self.master, 4096).decode("utf-8", "replace")
                except OSError:  # the program closed its side
                    break
        out = self.seen[start:]
        return out[: out.index(text)] if text in out else out

    def type(self, line: str) -> None:
        os.write(self.master, (line + "\n").encode())

    def close(self, timeout_s: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout_s)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            os.close(self.master)


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip(f"demo model not prepared at {MODEL_DIR}")
    with live_server("--model", str(MODEL_DIR), "--backend", "cpu") as url:
        yield url


def test_ferrum_chat_in_a_terminal(server: str, tmp_path: Path) -> None:
    term = Terminal([*FERRUM, "chat", "--url", server, "--temperature", "0", "--max-tokens", "40"])
    assert "Chatting with" in term.until(">>> ")
    term.type("What is the capital of France?")
    assert "Paris" in term.until(">>> ")
    term.type('"""')
    term.type("Say the word")
    term.type("hello.")
    term.type('"""')
    assert term.until(">>> ").strip()
    term.type("/system You answer in one word.")
    assert "system prompt: You answer in one word." in term.until(">>> ")
    saved = tmp_path / "chat.json"
    term.type(f"/save {saved}")
    assert "saved 5 messages" in term.until(">>> ")
    conversation = json.loads(saved.read_text())["messages"]
    assert conversation[0]["role"] == "system" and conversation[1]["content"] == "What is the capital of France?"
    assert conversation[3]["content"] == "Say the word\nhello."
    term.type("/clear")
    assert "conversation cleared" in term.until(">>> ")
    term.type(f"/save {saved}")
    assert "saved 1 messages" in term.until(">>> ")  # the system prompt alone
    term.type("/exit")
    assert term.close() == 0


def test_ferrum_chat_says_when_the_server_is_not_there() -> None:
    term = Terminal([*FERRUM, "chat", "--url", "http://127.0.0.1:9"])
    term.until("cannot reach", timeout_s=30)
    assert term.close() == 1


def test_ferrum_run_serves_and_chats_in_one_process() -> None:
    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip(f"demo model not prepared at {MODEL_DIR}")
    term = Terminal([*FERRUM, "run", str(MODEL_DIR), "--backend", "cpu", "--temperature", "0"])
    term.until(">>> ", timeout_s=180)
    term.type("What is the capital of France?")
    assert "Paris" in term.until(">>> ")
    os.write(term.master, b"\x04")  # Ctrl-D
    assert term.close() == 0
