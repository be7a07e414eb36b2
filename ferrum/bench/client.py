"""One streaming request to /v1/completions or /v1/chat/completions, timed: the HTTP side of
`ferrum bench serve`."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal, get_args

import aiohttp

from ferrum.bench.metrics import RequestRecord, TokenSource
from ferrum.bench.workload import BenchRequest

Endpoint = Literal["completions", "chat"]
ENDPOINTS: tuple[str, ...] = get_args(Endpoint)

_DATA = "data:"
_PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass(frozen=True)
class Target:
    """Where requests go and how they are asked: `endpoint` "completions" sends the prompt's token
    ids (or its text when it has no ids); "chat" sends the prompt's text as one user message."""

    base_url: str  # http://host:port, no trailing slash
    model: str
    ignore_eos: bool = True
    endpoint: Endpoint = "completions"

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")

    @property
    def url(self) -> str:
        return self.base_url + _PATHS[self.endpoint]

    @property
    def chat(self) -> bool:
        return self.endpoint == "chat"

    def body(self, request: BenchRequest) -> dict[str, Any]:
        return self._chat_body(request) if self.chat else self._completions_body(request)

    def _completions_body(self, request: BenchRequest) -> dict[str, Any]:
        ids = request.prompt_token_ids
        prompt: list[int] | str | None = list(ids) if ids else request.text
        if not prompt:
            raise ValueError("a request needs prompt token ids or a prompt text")
        return {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": request.output_len,
            "temperature": 0.0,
            "ignore_eos": self.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }

    def _chat_body(self, request: BenchRequest) -> dict[str, Any]:
        if request.text is None:
            raise ValueError("the chat endpoint needs each request's text (see workload.with_text)")
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": request.text}],
            "max_tokens": request.output_len,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        return body


def _error_text(payload: Any) -> str | None:
    if isinstance(payload, dict) and "error" in payload:
        error = payload["error"]
        return str(error.get("message", error)) if isinstance(error, dict) else str(error)
    return None


def _piece(choice: dict[str, Any], chat: bool) -> str:
    """The text a streamed choice adds: a chat delta's content, or a completion's text."""
    if chat:
        return str((choice.get("delta") or {}).get("content") or "")
    return str(choice.get("text") or "")


@dataclass
class ResponseStream:
    """What a response stream has shown so far. `token_times` holds the arrival of each chunk that
    carried output: any chunk with a choice on /v1/completions (each carries at least one generated
    token, though maybe no text), a chunk with non-empty delta content on chat."""

    chat: bool
    first_choice: float | None = None
    token_times: list[float] = field(default_factory=list)
    content_chunks: int = 0  # choices with non-empty text or content
    pieces: list[str] = field(default_factory=list)
    usage: dict[str, Any] | None = None
    finish_reason: str | None = None

    def take(self, chunk: dict[str, Any], now: float) -> None:
        choices: list[dict[str, Any]] = chunk.get("choices") or []
        if choices and self.first_choice is None:
            self.first_choice = now
        carried = bool(choices) and not self.chat
        for choice in choices:
            piece = _piece(choice, self.chat)
            if piece:
                self.content_chunks += 1
                self.pieces.append(piece)
                carried = True
            if choice.get("finish_reason"):
                self.finish_reason = str(choice["finish_reason"])
        if carried:
            self.token_times.append(now)
        if chunk.get("usage"):
            self.usage = chunk["usage"]

    def _usage_count(self, key: str) -> int | None:
        value = (self.usage or {}).get(key)
        return None if value is None else int(value)

    def output_tokens(self) -> tuple[int, TokenSource]:
        """From the usage chunk, else the number of content chunks."""
        counted = self._usage_count("completion_tokens")
        return (counted, "usage") if counted is not None else (self.content_chunks, "chunks")

    def record(self, request: BenchRequest, started: float, ended: float) -> RequestRecord:
        """The finished request; TTFT runs to the first chunk that carried output, or, when none did
        (a chat answer without content), to the first chunk with a choice."""
        if self.first_choice is None:
            return _failed(request, ended - started, "the stream ended without a generated token")
        first = self.token_times[0] if self.token_times else self.first_choice
        gaps = tuple(b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False))
        tokens, source = self.output_tokens()
        prompt_len = self._usage_count("prompt_tokens")
        return RequestRecord(
            request.prompt_len if prompt_len is None else prompt_len, request.output_len, tokens, first - started,
            gaps, ended - started, None, source, self.finish_reason, "".join(self.pieces),
        )


def _failed(request: BenchRequest, latency_s: float, message: str) -> RequestRecord:
    return RequestRecord(request.prompt_len, request.output_len, 0, 0.0, (), latency_s, message)


async def _http_error(response: aiohttp.ClientResponse) -> str:
    text = await response.text()
    try:
        message = _error_text(json.loads(text)) or text
    except json.JSONDecodeError:
        message = text
    return f"HTTP {response.status}: {message.strip()[:500]}"


async def send(session: aiohttp.ClientSession, target: Target, request: BenchRequest) -> RequestRecord:
    """Sends `request` and reads its event stream into a record: TTFT, the gaps between chunks that
    carried output, and the output token count (from the usage chunk, else the content chunks)."""
    started = time.perf_counter()
    stream = ResponseStream(target.chat)
    try:
        async with session.post(target.url, json=target.body(request)) as response:
            if response.status != 200:
                return _failed(request, time.perf_counter() - started, await _http_error(response))
            async for raw in response.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith(_DATA):
                    continue
                data = line[len(_DATA):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                error = _error_text(chunk)
                if error is not None:
                    return _failed(request, time.perf_counter() - started, f"stream error: {error}")
                stream.take(chunk, time.perf_counter())
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        return _failed(request, time.perf_counter() - started, f"{type(exc).__name__}: {exc}")
    return stream.record(request, started, time.perf_counter())
