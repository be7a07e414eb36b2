"""Log lines: text or JSON (`logging.format`), and one line per finished request.

The request line (logger `ferrum.request`) holds the request id, route, HTTP status, finish
reason, prompt and completion tokens, queue time, time to first token and duration; the prompt
only with `logging.prompts`. Keys and Authorization headers are never put in a log line.
The inference routes write the line of the work they admit when it ends; `RequestLogMiddleware` writes it
for every other request: refusals and errors of any status (with the error's message and code), and the
other API routes. Health, readiness and metrics probes get none.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ferrum.config.server_settings import LoggingConfig

REQUEST_LOGGER = "ferrum.request"
_TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, the record's `fields` and any
    exception's traceback."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def setup_logging(config: LoggingConfig) -> None:
    """The root logger's one handler (stderr) in the configured format and level; uvicorn's loggers
    go through it too (the server starts uvicorn with log_config=None)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if config.format == "json" else logging.Formatter(_TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(config.level.upper())


def log_request(config: LoggingConfig, **fields: Any) -> None:
    """The line of one finished request. `prompt` is dropped unless prompts are to be logged."""
    if not config.requests:
        return
    if not config.prompts:
        fields.pop("prompt", None)
    shown = " ".join(f"{k}={_short(v)}" for k, v in fields.items() if v is not None and k != "prompt")
    if "prompt" in fields:
        shown += f" prompt={json.dumps(fields['prompt'], ensure_ascii=False)[:2000]}"
    logging.getLogger(REQUEST_LOGGER).info("request %s", shown, extra={"fields": fields})


def _short(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    text = str(value)
    return json.dumps(text, ensure_ascii=False) if isinstance(value, str) and " " in text else text


_PROBES = frozenset({"/health", "/ready", "/metrics"})
_ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completions", "/v1/responses": "responses"}
_MAX_ERROR_BODY = 16 * 1024


def mark_logged(state: Any) -> None:
    """Says that the route writes this request's line itself (`state`: the request's `request.state`)."""
    state.request_logged = True


class RequestLogMiddleware:
    """The request line of each request no route logs itself (see the module docstring). Sits outside the
    API-key and body-size checks, so their refusals are logged too, and inside the request id's middleware."""

    def __init__(self, app: ASGIApp, config: LoggingConfig) -> None:
        self.app = app
        self.config = config

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or not self.config.requests or path in _PROBES:
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = 500
        body = bytearray()

        async def watching_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and status >= 400 and len(body) < _MAX_ERROR_BODY:
                body.extend(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, watching_send)
        finally:
            state = scope.get("state", {})
            api = path.startswith("/v1/") or path in ("/tokenize", "/detokenize")
            if not state.get("request_logged") and (status >= 400 or api):
                message, code = _error_of(bytes(body)) if status >= 400 else (None, None)
                log_request(self.config, id=state.get("request_id"), route=_ROUTES.get(path, path),
                            method=scope.get("method"), status=status, outcome="ok" if status < 400 else "error",
                            error=message, code=code, duration_s=time.monotonic() - started)


def _error_of(body: bytes) -> tuple[str | None, str | None]:
    """The message and code of an OpenAI-style error body."""
    try:
        error = json.loads(body)["error"]
        return str(error.get("message"))[:500], error.get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None, None
