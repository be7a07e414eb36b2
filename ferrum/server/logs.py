"""Log lines: text or JSON (`logging.format`), and one line per finished request.

The request line (logger `ferrum.request`) holds the request id, route, HTTP status, finish
reason, prompt and completion tokens, queue time, time to first token and duration; the prompt
only with `logging.prompts`. Keys and Authorization headers are never put in a log line.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from ferrum.server.settings import LoggingConfig

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
    return f"{value:.4f}" if isinstance(value, float) else str(value)
