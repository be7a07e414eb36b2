"""Server-sent events: the streaming response and the event stream of a chunk generator."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing
from typing import Any

import anyio
from fastapi.responses import StreamingResponse
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from ferrum.server.errors import APIError
from ferrum.server.jobs import engine_error


class SSEResponse(StreamingResponse):
    """A stream whose body generator is always closed, however the response ends, and which runs
    `on_close` last. Starlette cancels the body on disconnect; closing it makes sure."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncGenerator[str, None], on_close: Callable[[], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                with anyio.CancelScope(shield=True):
                    await self._content.aclose()
            finally:
                self._on_close()


async def _events(items: AsyncGenerator[Any, None], error_param: str, encode: Callable[[Any], str],
                  encode_error: Callable[[APIError], str], tail: str) -> AsyncGenerator[str, None]:
    try:
        async with aclosing(items):
            async for item in items:
                yield encode(item)
    except Exception as exc:
        error = exc if isinstance(exc, APIError) else engine_error(exc, error_param)
        yield encode_error(error)
    if tail:
        yield tail


def sse_events(chunks: AsyncGenerator[BaseModel, None], error_param: str) -> AsyncGenerator[str, None]:
    """Chat and completion chunks: `data:` lines, an error as an error object, then `data: [DONE]`."""
    return _events(chunks, error_param, lambda chunk: f"data: {chunk.model_dump_json()}\n\n",
                   lambda error: f"data: {json.dumps(error.body())}\n\n", "data: [DONE]\n\n")


def named_sse_events(events: AsyncGenerator[dict[str, Any], None], error_param: str) -> AsyncGenerator[str, None]:
    """Events that carry their name in `type` (the Responses API): an `event:` line each; an error ends the
    stream with an `error` event; no [DONE]."""
    return _events(events, error_param, lambda event: f"event: {event['type']}\ndata: {json.dumps(event)}\n\n",
                   lambda error: f"event: error\ndata: {json.dumps({'type': 'error', **error.body()['error']})}\n\n",
                   "")
