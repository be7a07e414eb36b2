"""The `RemoteObject` protocol (a file that can be read by byte range: an HTTP URL, an S3 object) and
the retry logic HTTP and S3 share.

Errors a `RemoteObject` raises: `SourceNotFoundError` (404, NoSuchKey: not retried), `WeightError`
for other refusals (403, other 4xx: not retried), `SourceUnavailableError` for transient failures
(5xx, 429/503 throttling, connection resets, time-outs), which `retrying` retries with exponential
backoff and jitter, waiting at least what the server asked for in `Retry-After`.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar, runtime_checkable

from ferrum.weights.errors import SourceNotFoundError, SourceUnavailableError, WeightError

if TYPE_CHECKING:
    from ferrum.weights.spec.loader_config import WeightLoaderConfig

__all__ = [
    "ObjectInfo",
    "RemoteObject",
    "RetryPolicy",
    "check_range",
    "is_transient_status",
    "parse_retry_after",
    "read_range_resuming",
    "refusal",
    "retrying",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class ObjectInfo:
    """What a remote object's metadata says. `sha256`/`md5`: lowercase hex, only when the source
    vouches for them (S3 ChecksumSHA256, a plain-MD5 S3 ETag, a configured sha256).
    `last_modified` (an addition to the design's fields, defaulted): the server's Last-Modified, used
    with `etag` and `size` to tell whether a cached copy is of the same object."""

    size: int
    sha256: str | None
    md5: str | None
    etag: str | None
    accepts_ranges: bool
    last_modified: str | None = None


@runtime_checkable
class RemoteObject(Protocol):
    name: str  # for messages: the URL (without its query string), s3://bucket/key, ...
    cache_key: str  # stable, filesystem-safe key for the cache

    async def info(self) -> ObjectInfo: ...

    async def read_range(self, start: int, end: int) -> bytes:  # bytes [start, end)
        ...


@dataclass(frozen=True)
class RetryPolicy:
    """`max_retries` retries after the first attempt; the n-th waits a random time in
    [delay/2, delay] with delay = min(base_delay_s * 2**n, max_delay_s), or the server's Retry-After
    (capped at `max_retry_after_s`) when that is longer."""

    max_retries: int = 5
    base_delay_s: float = 0.5
    max_delay_s: float = 20.0
    max_retry_after_s: float = 120.0

    @classmethod
    def from_config(cls, config: WeightLoaderConfig) -> RetryPolicy:
        return cls(max_retries=config.max_retries)

    def delay(self, retry: int, retry_after: float | None = None) -> float:
        """Seconds to wait before retry number `retry` (0-based)."""
        ceiling = min(self.base_delay_s * (2**retry), self.max_delay_s)
        backoff = random.uniform(ceiling / 2, ceiling)
        if retry_after is None:
            return backoff
        return max(backoff, min(retry_after, self.max_retry_after_s))


async def retrying(name: str, policy: RetryPolicy, attempt: Callable[[], Awaitable[T]], what: str) -> T:
    """Run `attempt` until it succeeds, retrying `SourceUnavailableError` per `policy`. Other errors
    go through at once. When the retries are spent, the last error is raised again, its message
    saying how many attempts were made. `what` names the operation in log lines."""
    retry = 0
    while True:
        try:
            return await attempt()
        except SourceUnavailableError as exc:
            if retry >= policy.max_retries:
                attempts = retry + 1
                raise SourceUnavailableError(
                    exc.where,
                    f"{exc.message} (gave up after {attempts} attempt{'s' if attempts > 1 else ''})",
                    retry_after=exc.retry_after,
                ) from exc
            wait = policy.delay(retry, exc.retry_after)
            log.warning("%s: %s failed (%s); retry %d/%d in %.1f s",
                        name, what, exc.message, retry + 1, policy.max_retries, wait)
            await asyncio.sleep(wait)
            retry += 1


async def read_range_resuming(
    name: str, policy: RetryPolicy, start: int, end: int, read_into: Callable[[bytearray], Awaitable[None]]
) -> bytes:
    """Read bytes [start, end) with retries, keeping what earlier attempts received: each attempt
    calls `read_into(buf)`, which must append bytes [start + len(buf), end) to `buf` (it may clear
    `buf` to start over, e.g. when the server ignored the Range header). A connection cut after
    N bytes thus costs only the rest of the range, not the whole range again."""
    check_range(name, start, end)
    buf = bytearray()
    if start == end:
        return b""

    async def attempt() -> None:
        before = len(buf)
        await read_into(buf)
        if len(buf) != end - start:
            raise SourceUnavailableError(
                name, f"bytes {start}-{end - 1}: got {len(buf)} bytes of {end - start} (response ended early)"
            )
        if before:
            log.info("%s: bytes %d-%d completed after resuming at byte %d", name, start, end - 1, start + before)

    await retrying(name, policy, attempt, f"reading bytes {start}-{end - 1}")
    return bytes(buf)


def check_range(name: str, start: int, end: int) -> None:
    if isinstance(start, bool) or isinstance(end, bool) or not isinstance(start, int) or not isinstance(end, int):
        raise TypeError(f"{name}: byte range bounds must be ints, got {start!r}, {end!r}")
    if start < 0 or end < start:
        raise ValueError(f"{name}: invalid byte range [{start}, {end})")


def parse_retry_after(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date); None when absent or invalid."""
    if value is None:
        return None
    value = value.strip()
    try:
        return max(float(value), 0.0)
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when is None:
        return None
    return max(when.timestamp() - time.time(), 0.0)


def refusal(name: str, status: int, detail: str = "") -> WeightError:
    """The non-retried error for an HTTP-style status that is neither success nor transient."""
    suffix = f": {detail}" if detail else ""
    if status in (404, 410):
        return SourceNotFoundError(name, f"not found (HTTP {status}){suffix}")
    if status in (401, 403):
        return WeightError(
            name, f"access denied (HTTP {status}){suffix}: check the credentials / authorization headers"
        )
    return WeightError(name, f"request refused (HTTP {status}){suffix}")


def is_transient_status(status: int) -> bool:
    """5xx, 429 Too Many Requests, 408 Request Timeout: worth retrying."""
    return status >= 500 or status in (408, 429)
