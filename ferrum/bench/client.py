"""One streaming /v1/completions request, timed: the HTTP side of `ferrum bench serve`."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import aiohttp

from ferrum.bench.metrics import RequestRecord
from ferrum.bench.workload import BenchRequest

_DATA = "data:"


@dataclass(frozen=True)
class Target:
    base_url: str  # http://host:port, no trailing slash
    model: str
    ignore_eos: bool = True

    @property
    def completions_url(self) -> str:
        return f"{self.base_url}/v1/completions"

    def body(self, request: BenchRequest) -> dict[str, Any]:
        return {
            "model": self.model,
            "prompt": list(request.prompt_token_ids),
            "max_tokens": request.output_len,
            "temperature": 0.0,
            "ignore_eos": self.ignore_eos,
            "stream": True,
            "stream_options": {"include_usage": True},
        }


def _error_text(payload: Any) -> str | None:
    if isinstance(payload, dict) and "error" in payload:
        error = payload["error"]
        return str(error.get("message", error)) if isinstance(error, dict) else str(error)
    return None


async def send(session: aiohttp.ClientSession, target: Target, request: BenchRequest) -> RequestRecord:
    """Sends `request` and reads its event stream. TTFT runs to the first chunk with a choice (every
    such chunk carries at least one generated token, though maybe no text); the usage chunk gives
    the token count."""
    started = time.perf_counter()
    first: float | None = None
    last = started
    gaps: list[float] = []
    output_tokens: int | None = None

    def failed(message: str) -> RequestRecord:
        return RequestRecord(request.prompt_len, request.output_len, 0, 0.0, (),
                             time.perf_counter() - started, message)

    try:
        async with session.post(target.completions_url, json=target.body(request)) as response:
            if response.status != 200:
                text = await response.text()
                try:
                    message = _error_text(json.loads(text)) or text
                except json.JSONDecodeError:
                    message = text
                return failed(f"HTTP {response.status}: {message.strip()[:500]}")
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
                    return failed(f"stream error: {error}")
                now = time.perf_counter()
                if chunk.get("choices"):
                    if first is None:
                        first = now
                    else:
                        gaps.append(now - last)
                    last = now
                usage = chunk.get("usage")
                if usage:
                    output_tokens = int(usage["completion_tokens"])
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        return failed(f"{type(exc).__name__}: {exc}")
    latency = time.perf_counter() - started
    if first is None:
        return failed("the stream ended without a generated token")
    if output_tokens is None:
        return failed("the stream ended without a usage chunk (stream_options.include_usage)")
    return RequestRecord(request.prompt_len, request.output_len, output_tokens, first - started,
                         tuple(gaps), latency)
