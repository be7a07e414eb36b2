"""The HTTP server's own settings: who may call it (`api:`), how much work it takes (`limits:`), how
chat output is read (`chat:`), how it stops, and what it logs. Frozen; built and validated by
ferrum.config.loader."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

LogFormat = Literal["text", "json"]


@dataclass(frozen=True)
class ApiConfig:
    """`keys`: accepted `Authorization: Bearer` keys (none: no authentication); `key_file` adds one
    key per line (blank lines and `#` comments skipped). `/health`, `/ready`, `/version` and the API
    docs stay open; `/metrics` too unless `metrics_require_key`. `cors_origins`: origins allowed
    cross-site (`*` for any; none: CORS off). `root_path`: the path prefix a proxy serves this under.
    `ssl_keyfile` / `ssl_certfile`: serve HTTPS (both or neither). `ui`: the chat page at `/` (its files need
    no key; the page asks for one when the API answers 401)."""

    keys: tuple[str, ...] = ()
    key_file: Path | None = None
    metrics_require_key: bool = False
    cors_origins: tuple[str, ...] = ()
    root_path: str = ""
    ssl_keyfile: Path | None = None
    ssl_certfile: Path | None = None
    ui: bool = True  # the chat page at / (and its files under /ui/), served without a key

    def __post_init__(self) -> None:
        if any(not isinstance(k, str) or not k.strip() or k != k.strip() for k in self.keys):
            raise ValueError("api.keys must be non-empty strings without surrounding spaces")
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("api.ssl_keyfile and api.ssl_certfile go together: give both or neither")
        if self.root_path and not self.root_path.startswith("/"):
            raise ValueError(f"api.root_path must start with '/', got {self.root_path!r}")

    def all_keys(self) -> tuple[str, ...]:
        """`keys` and those of `key_file` (read now; ValueError naming the file when unreadable)."""
        if self.key_file is None:
            return self.keys
        try:
            text = Path(self.key_file).expanduser().read_text(encoding="utf-8")
        except OSError as exc:
            raise ValueError(f"api.key_file {self.key_file}: {exc.strerror or exc}") from None
        from_file = tuple(
            line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")
        )
        if not from_file:
            raise ValueError(f"api.key_file {self.key_file} holds no key")
        return self.keys + from_file


@dataclass(frozen=True)
class LimitsConfig:
    """Admission: at most the engine's `max_num_seqs` running and `max_waiting_requests` more
    waiting (default four times `max_num_seqs`), and at most `max_waiting_tokens` prompt tokens
    waiting (None: no limit); past either, `overload_status` (429 or 503) with `Retry-After`.
    Per request: a body of at most `max_body_mb`, `max_tokens` at most `max_tokens` (None: up to
    the context length), `n` at most `max_n`, and a deadline of `request_timeout_s` seconds unless
    the request sends its own `timeout` (None: no deadline). Lower `priority` values are admitted
    first."""

    max_waiting_requests: int | None = None
    max_waiting_tokens: int | None = None
    overload_status: int = 429
    retry_after_s: int = 1
    max_body_mb: float = 4.0
    max_tokens: int | None = None
    max_n: int = 16
    request_timeout_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_waiting_requests", "max_waiting_tokens", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
                raise ValueError(f"limits.{name} must be a whole number >= 0 or null, got {value!r}")
        if self.overload_status not in (429, 503):
            raise ValueError(f"limits.overload_status must be 429 or 503, got {self.overload_status!r}")
        if not isinstance(self.retry_after_s, int) or self.retry_after_s < 0:
            raise ValueError(f"limits.retry_after_s must be a whole number >= 0, got {self.retry_after_s!r}")
        if not self.max_body_mb > 0:
            raise ValueError(f"limits.max_body_mb must be > 0, got {self.max_body_mb!r}")
        if not isinstance(self.max_n, int) or self.max_n < 1:
            raise ValueError(f"limits.max_n must be a whole number >= 1, got {self.max_n!r}")
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"limits.request_timeout_s must be > 0 or null, got {self.request_timeout_s!r}")

    @property
    def max_body_bytes(self) -> int:
        return int(self.max_body_mb * 2**20)

    def waiting_requests(self, max_num_seqs: int) -> int:
        return self.max_waiting_requests if self.max_waiting_requests is not None else 4 * max_num_seqs


@dataclass(frozen=True)
class LoggingConfig:
    """`format`: text lines or one JSON object per line. `requests`: one line per finished request
    (id, status, tokens in and out, queue time, TTFT, duration). `prompts`: add the prompt to it
    (off by default). API keys are never logged."""

    level: str = "info"
    format: LogFormat = "text"
    requests: bool = True
    prompts: bool = False

    def __post_init__(self) -> None:
        if self.format not in ("text", "json"):
            raise ValueError(f"logging.format must be text or json, got {self.format!r}")
        if self.level.lower() not in ("debug", "info", "warning", "error", "critical"):
            raise ValueError(f"logging.level must be debug, info, warning, error or critical, got {self.level!r}")


@dataclass(frozen=True)
class LifecycleConfig:
    """`shutdown_timeout_s`: on SIGTERM / SIGINT, how long in-flight requests may run on before
    they are ended. `failed_start_linger_s`: after a failed start, how long `/ready` keeps saying
    why before the process exits (non-zero)."""

    shutdown_timeout_s: float = 30.0
    failed_start_linger_s: float = 3.0

    def __post_init__(self) -> None:
        if not self.shutdown_timeout_s >= 0:
            raise ValueError(f"shutdown_timeout_s must be >= 0, got {self.shutdown_timeout_s!r}")
        if not self.failed_start_linger_s >= 0:
            raise ValueError(f"failed_start_linger_s must be >= 0, got {self.failed_start_linger_s!r}")


TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "mistral")
REASONING_PARSERS = ("qwen3", "deepseek_r1")


@dataclass(frozen=True)
class ChatConfig:
    """How chat output is read. `tool_call_parser`: the format of the model's tool calls (hermes,
    llama3_json, mistral), or auto (told by the chat template; the default): requests with tools need one.
    `reasoning_parser`: qwen3 or deepseek_r1 to return a reasoning model's thinking as `reasoning_content`
    (ferrum.server.reasoning); none by default."""

    tool_call_parser: str = "auto"
    reasoning_parser: str | None = None

    def __post_init__(self) -> None:
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"chat.reasoning_parser must be one of {', '.join(REASONING_PARSERS)}, "
                             f"got {self.reasoning_parser!r}")
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"chat.tool_call_parser must be one of {', '.join(TOOL_CALL_PARSERS)}, "
                             f"got {self.tool_call_parser!r}")


@dataclass(frozen=True)
class ServerSettings:
    api: ApiConfig = field(default_factory=ApiConfig)
    chat: ChatConfig = field(default_factory=ChatConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    lifecycle: LifecycleConfig = field(default_factory=LifecycleConfig)
