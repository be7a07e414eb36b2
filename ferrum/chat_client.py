"""`ferrum chat`: a terminal conversation with any OpenAI-compatible server, and `ferrum run MODEL`: the same
with a Ferrum server started in the background of this process (Ollama's `run`).

The client speaks only the public API (`/v1/models`, streamed `/v1/chat/completions`) with the standard
library. At the prompt: a line is a message; `\"\"\"` on a line of its own starts and ends a multi-line
message (so does a line ending in `\\`); `/system TEXT` sets the system prompt, `/clear` forgets the
conversation, `/save FILE` writes it as JSON, `/help`, `/exit` (or Ctrl-D).
"""

from __future__ import annotations

import asyncio
import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

HELP = ('Commands: /system TEXT (set the system prompt), /clear (forget the conversation), /save FILE, /help, '
        '/exit. """ on its own line starts and ends a multi-line message; so does a line ending in \\.')


class ChatError(RuntimeError):
    """The server refused or could not be reached; the message is for the user."""


@dataclass
class ChatClient:
    url: str  # the server's base URL, without /v1
    api_key: str | None = None
    model: str | None = None
    temperature: float | None = None
    max_tokens: int | None = None
    system: str = ""
    messages: list[dict[str, str]] = field(default_factory=list)

    def _request(self, path: str, body: dict[str, Any] | None = None) -> Any:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(self.url.rstrip("/") + path, data=data, headers=headers)
        try:
            return urllib.request.urlopen(request, timeout=600)
        except urllib.error.HTTPError as exc:
            try:
                message = json.loads(exc.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                message = exc.reason
            hint = " (give --api-key or set OPENAI_API_KEY)" if exc.code == 401 else ""
            raise ChatError(f"{exc.code}: {message}{hint}") from None
        except (urllib.error.URLError, OSError) as exc:
            raise ChatError(f"cannot reach {self.url}: {getattr(exc, 'reason', exc)}") from None

    def resolve_model(self) -> str:
        if self.model is None:
            with self._request("/v1/models") as r:
                models = json.load(r).get("data") or []
            if not models:
                raise ChatError(f"{self.url} serves no model")
            self.model = str(models[0]["id"])
        return self.model

    def ask(self, text: str) -> Iterator[str]:
        """Streams the answer to `text`, then keeps both in the conversation."""
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + self.messages
        body: dict[str, Any] = {"model": self.resolve_model(), "stream": True,
                                "messages": [*messages, {"role": "user", "content": text}]}
        if self.temperature is not None:
            body["temperature"] = self.temperature
        if self.max_tokens is not None:
            body["max_tokens"] = self.max_tokens
        answer = ""
        with self._request("/v1/chat/completions", body) as r:
            for raw in r:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise ChatError(chunk["error"].get("message", "the server ended the answer"))
                for choice in chunk.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content") or ""
                    if piece:
                        answer += piece
                        yield piece
        self.messages += [{"role": "user", "content": text}, {"role": "assistant", "content": answer}]


def _read_message(stdin: TextIO, stdout: TextIO) -> str | None:
    """One message from the prompt (None at end of input)."""
    stdout.write(">>> ")
    stdout.flush()
    line = stdin.readline()
    if not line:
        return None
    line = line.rstrip("\n")
    if line.strip() == '"""':
        lines = []
        while (more := stdin.readline()) and more.rstrip("\n").strip() != '"""':
            lines.append(more.rstrip("\n"))
        return "\n".join(lines)
    lines = [line]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        stdout.write("... ")
        stdout.flush()
        more = stdin.readline()
        if not more:
            break
        lines.append(more.rstrip("\n"))
    return "\n".join(lines)


def repl(client: ChatClient, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    try:
        model = client.resolve_model()
    except ChatError as exc:
        print(f"ferrum chat: {exc}", file=sys.stderr)
        return 1
    stdout.write(f"Chatting with {model} at {client.url}. /help for commands, /exit or Ctrl-D to leave.\n")
    while True:
        text = _read_message(stdin, stdout)
        if text is None or text.strip() in ("/exit", "/quit", "/bye"):
            stdout.write("\n")
            return 0
        command, _, rest = text.strip().partition(" ")
        if command == "/help":
            stdout.write(HELP + "\n")
        elif command == "/clear":
            client.messages.clear()
            stdout.write("(conversation cleared)\n")
        elif command == "/system":
            if rest:
                client.system = rest
            stdout.write(f"(system prompt: {client.system or 'none'})\n")
        elif command == "/save":
            if not rest:
                stdout.write("(usage: /save FILE)\n")
                continue
            conversation = ([{"role": "system", "content": client.system}] if client.system else []) + client.messages
            Path(rest).expanduser().write_text(json.dumps({"model": model, "messages": conversation}, indent=2))
            stdout.write(f"(saved {len(conversation)} messages to {rest})\n")
        elif text.strip().startswith("/"):
            stdout.write(f"(unknown command {command}; /help lists them)\n")
        elif text.strip():
            try:
                for piece in client.ask(text):
                    stdout.write(piece)
                    stdout.flush()
                stdout.write("\n")
            except ChatError as exc:
                stdout.write(f"\n(error: {exc})\n")
            except KeyboardInterrupt:
                stdout.write("\n(stopped)\n")


# -- ferrum run -----------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_model(config: Any, temperature: float | None, stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout) -> int:
    """Serves `config` (a ServerConfig) on a free loopback port from a thread of this process, chats with
    it, then drains and stops it."""
    from ferrum.server.serve import serve

    ready = threading.Event()
    box: dict[str, Any] = {}

    def server_thread() -> None:
        loop = asyncio.new_event_loop()
        box["loop"] = loop
        box["stop"] = asyncio.Event()
        ready.set()
        try:
            loop.run_until_complete(serve(config, stop=box["stop"]))
        except BaseException as exc:  # reported by the main thread
            box["error"] = exc
        finally:
            loop.close()

    thread = threading.Thread(target=server_thread, name="ferrum-server", daemon=True)
    thread.start()
    ready.wait()
    url = f"http://127.0.0.1:{config.port}"
    client = ChatClient(url, temperature=temperature)
    stdout.write(f"Loading {config.model} ...\n")
    stdout.flush()
    while True:
        if not thread.is_alive():
            print(f"ferrum run: the server stopped: {box.get('error')}", file=sys.stderr)
            return 2
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as r:
                if r.status == 200:
                    break
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.2)
    try:
        return repl(client, stdin, stdout)
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(timeout=60)


def run_config(model: str, config_path: str | None, overrides: dict[str, Any]) -> Any:
    """The ServerConfig for `ferrum run`: loopback, a free port, quiet logs unless asked for."""
    from ferrum.config.loader import load_config

    values = {**{k: v for k, v in overrides.items() if v is not None}, "model": model, "host": "127.0.0.1",
              "port": overrides.get("port") or _free_port()}
    values.setdefault("log_level", "warning")
    values.setdefault("log_requests", False)
    return load_config(config_path, values)
