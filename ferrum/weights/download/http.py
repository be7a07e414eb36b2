"""`HttpObject`: a `RemoteObject` over HTTP(S) with aiohttp.

- `info()`: HEAD (following redirects). When HEAD is refused (405, 501, 403 as on presigned URLs, ...)
  or leaves the size or Range support unknown, a `GET` with `Range: bytes=0-0` tells them instead.
- `read_range(start, end)`: `GET` with `Range: bytes=start-(end-1)`, expecting 206 and a matching
  Content-Range. A cut connection resumes from the last byte received (see `read_range_resuming`).
- `read_range_into(start, end, sink)`: the same request and retries, but each body piece goes to
  `sink(offset, piece)` as it arrives (the Downloader writes it at its offset: no chunk buffer).
- A server that ignores Range answers 200 with the whole object. That is accepted when reading from
  byte 0 (the rest of the body is not read), or when the object is at most `SMALL_OBJECT_BYTES`
  (the body is read and sliced); any other range of a bigger object raises `UnsupportedError` (it
  would cost a full download per range). `info().accepts_ranges` is False for such servers, and the
  Downloader then fetches the object as one piece from byte 0.
- Every request sends `Accept-Encoding: identity` (byte ranges of a compressed body would be
  meaningless) and is bounded by `config.timeout_s`: to connect, and for each wait for data (the
  response's headers or the next piece of its body). A stalled server thus fails with
  `SourceUnavailableError` after the retries instead of hanging; a slow but steady one is not cut.

The aiohttp session is created on first use and closed by `aclose()` (or `async with`); one can be
passed in instead (it is then left open).
"""

from __future__ import annotations

import asyncio
import logging
import re
import ssl
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from types import TracebackType
from typing import TYPE_CHECKING, Self

import aiohttp

from ferrum.weights.download.cache import make_cache_key
from ferrum.weights.download.remote import (
    ObjectInfo,
    RetryPolicy,
    check_range,
    is_transient_status,
    parse_retry_after,
    read_range_resuming,
    refusal,
    retrying,
)
from ferrum.weights.errors import SourceUnavailableError, UnsupportedError, WeightError
from ferrum.weights.spec.sources import Url

if TYPE_CHECKING:
    from ferrum.weights.spec.loader_config import WeightLoaderConfig

__all__ = ["SMALL_OBJECT_BYTES", "HttpObject"]

log = logging.getLogger(__name__)

SMALL_OBJECT_BYTES = 32 * 1024 * 1024
_READ_PIECE = 1024 * 1024
_CONTENT_RANGE = re.compile(r"^\s*bytes\s+(?:(\d+)-(\d+)|\*)/(\d+|\*)\s*$", re.IGNORECASE)


class HttpObject:
    """An object at an http(s) URL. `headers` (e.g. Authorization) are sent with every request, over
    `config.default_headers`. `name` is the URL without its query string (which may hold a
    signature); `cache_key` is derived from the full URL."""

    def __init__(
        self,
        url: str,
        headers: Mapping[str, str] | None,
        config: WeightLoaderConfig,
        *,
        session: aiohttp.ClientSession | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        source = Url(url, dict(headers or {}))  # checks the scheme (http/https only) and the headers
        self.url = url
        self.name = source.display
        self.cache_key = make_cache_key("url", source.filename or "object", url)
        self._headers = {**config.default_headers, **source.headers}
        self._sha256 = config.expected_sha256.get(url)
        self._timeout = aiohttp.ClientTimeout(
            total=None, connect=None, sock_connect=config.timeout_s, sock_read=config.timeout_s
        )
        self._timeout_s = config.timeout_s
        self._retry = retry or RetryPolicy.from_config(config)
        self._session = session
        self._own_session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._size: int | None = None  # from the last info(), to notice a changed object

    def __repr__(self) -> str:
        return f"HttpObject({self.name!r})"

    # -- RemoteObject ------------------------------------------------------------------------------

    async def info(self) -> ObjectInfo:
        info = await retrying(self.name, self._retry, self._info_once, "HEAD")
        self._size = info.size
        return info

    async def read_range(self, start: int, end: int) -> bytes:
        if self._size is not None and end > self._size:
            raise ValueError(f"{self.name}: byte range [{start}, {end}) is past the end ({self._size} bytes)")

        async def read_into(buf: bytearray) -> None:
            await self._read_into(start, end, buf)

        return await read_range_resuming(self.name, self._retry, start, end, read_into)

    async def read_range_into(self, start: int, end: int, sink: Callable[[int, bytes], None]) -> None:
        """Stream bytes [start, end) to `sink(offset, piece)` as they arrive (no buffering), with the
        retries of `read_range`: a cut connection resumes from the last byte handed to `sink`. A
        server ignoring Range makes the pieces start again from `start` (same offsets rewritten).
        Errors raised by `sink` go through unchanged (not retried)."""
        if self._size is not None and end > self._size:
            raise ValueError(f"{self.name}: byte range [{start}, {end}) is past the end ({self._size} bytes)")
        check_range(self.name, start, end)
        if start == end:
            return
        received = [0]

        async def attempt() -> None:
            before = received[0]
            await self._stream_into(start, end, received, sink)
            if received[0] != end - start:
                raise SourceUnavailableError(
                    self.name,
                    f"bytes {start}-{end - 1}: got {received[0]} bytes of {end - start} (response ended early)",
                )
            if before:
                log.info("%s: bytes %d-%d completed after resuming at byte %d",
                         self.name, start, end - 1, start + before)

        await retrying(self.name, self._retry, attempt, f"reading bytes {start}-{end - 1}")

    # -- session -------------------------------------------------------------------------------------

    async def aclose(self) -> None:
        if self._own_session is not None:
            await self._own_session.close()
            self._own_session = None

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    def _client(self) -> aiohttp.ClientSession:
        if self._session is not None:
            return self._session
        session, loop = self._own_session, asyncio.get_running_loop()
        if session is None or session.closed or self._session_loop is not loop:  # a session is bound to its loop
            session = aiohttp.ClientSession(auto_decompress=False, trust_env=True, timeout=self._timeout)
            self._own_session, self._session_loop = session, loop
        return session

    @asynccontextmanager
    async def _request(self, method: str, extra: Mapping[str, str]) -> AsyncIterator[aiohttp.ClientResponse]:
        """One request, its transport failures turned into `SourceUnavailableError` (retried) or
        `WeightError` (TLS, redirects: not retried)."""
        headers = {**self._headers, "Accept-Encoding": "identity", **extra}
        try:
            async with self._client().request(
                method, self.url, headers=headers, allow_redirects=True, timeout=self._timeout
            ) as response:
                yield response
        except (aiohttp.ClientConnectorCertificateError, aiohttp.ClientSSLError, ssl.SSLError) as exc:
            raise WeightError(self.name, f"TLS failure: {exc}") from exc
        except aiohttp.TooManyRedirects as exc:
            raise WeightError(self.name, f"too many redirects ({len(exc.history)})") from exc
        except aiohttp.InvalidURL as exc:
            raise WeightError(self.name, f"invalid URL (after redirects?): {exc}") from exc
        except TimeoutError as exc:  # aiohttp's ServerTimeoutError / SocketTimeoutError are TimeoutErrors
            raise SourceUnavailableError(
                self.name, f"{method} timed out: no data for {self._timeout_s:g} s"
            ) from exc
        except (aiohttp.ClientError, OSError) as exc:
            detail = str(exc) or type(exc).__name__
            raise SourceUnavailableError(self.name, f"{method} failed: {detail}") from exc

    # -- info ------------------------------------------------------------------------------------------

    async def _info_once(self) -> ObjectInfo:
        async with self._request("HEAD", {}) as response:
            status = response.status
            if status in (404, 410):
                raise refusal(self.name, status)
            if is_transient_status(status) and status != 501:
                raise self._transient(response)
            if status == 200:
                self._check_encoding(response)
                length = response.content_length
                accepts = response.headers.get("Accept-Ranges", "").strip().lower() == "bytes"
                if length is not None and accepts:
                    return self._object_info(response, length, accepts_ranges=True)
        # HEAD refused, or size / Range support unknown: ask with a one-byte ranged GET.
        return await self._probe()

    async def _probe(self) -> ObjectInfo:
        async with self._request("GET", {"Range": "bytes=0-0"}) as response:
            status = response.status
            if status == 206:
                self._check_encoding(response)
                _, _, total = self._content_range(response)
                await response.read()
                return self._object_info(response, total, accepts_ranges=True)
            if status == 416:  # an empty object: "bytes */0"
                _, _, total = self._content_range(response)
                return self._object_info(response, total, accepts_ranges=True)
            if status == 200:
                self._check_encoding(response)
                length = response.content_length
                response.close()  # do not read the whole object
                if length is None:
                    raise UnsupportedError(
                        self.name, "the server gives no size (no Content-Length) and ignores Range requests"
                    )
                return self._object_info(response, length, accepts_ranges=False)
            raise self._status_error(response)

    def _object_info(self, response: aiohttp.ClientResponse, size: int, *, accepts_ranges: bool) -> ObjectInfo:
        return ObjectInfo(
            size=size,
            sha256=self._sha256,
            md5=None,
            etag=response.headers.get("ETag"),
            accepts_ranges=accepts_ranges,
            last_modified=response.headers.get("Last-Modified"),
        )

    # -- ranges ------------------------------------------------------------------------------------------

    def _check_partial(self, response: aiohttp.ClientResponse, pos: int) -> None:
        first, _, total = self._content_range(response)
        if first != pos:
            raise WeightError(self.name, f"asked for bytes from {pos}, the server answered from byte {first}")
        if self._size is not None and total != self._size:
            raise WeightError(self.name, f"the object changed while being read: size {total}, was {self._size}")

    def _check_whole(self, response: aiohttp.ClientResponse, start: int, pos: int, end: int) -> None:
        length = response.content_length
        if start != 0 and (length is None or length > SMALL_OBJECT_BYTES):
            raise UnsupportedError(
                self.name,
                f"the server ignores Range requests (answered 200 to bytes {pos}-{end - 1}) and the "
                f"object is {'of unknown size' if length is None else f'{length} bytes'}: reading a "
                f"range other than from byte 0 would mean downloading it all each time",
            )

    async def _stream_into(
        self, start: int, end: int, received: list[int], sink: Callable[[int, bytes], None]
    ) -> None:
        """One GET of bytes [start + received[0], end), each body piece handed to `sink` at its offset
        as it arrives; `received[0]` counts the bytes handed over from `start`."""
        pos = start + received[0]
        async with self._request("GET", {"Range": f"bytes={pos}-{end - 1}"}) as response:
            self._check_encoding(response)
            if response.status == 206:
                self._check_partial(response, pos)
                skip = 0
            elif response.status == 200:
                self._check_whole(response, start, pos, end)
                received[0] = 0  # the body starts at byte 0: from `start` again
                skip = start
            else:
                raise self._status_error(response)
            content = response.content
            want = end - start
            while received[0] < want:
                try:
                    piece = await content.readany()
                except TimeoutError as exc:
                    raise SourceUnavailableError(
                        self.name, f"body stalled: no data for {self._timeout_s:g} s after {received[0]} bytes"
                    ) from exc
                except (aiohttp.ClientError, OSError) as exc:
                    detail = str(exc) or type(exc).__name__
                    raise SourceUnavailableError(
                        self.name, f"connection lost after {received[0]} bytes: {detail}"
                    ) from exc
                if not piece:
                    return
                if skip:
                    if len(piece) <= skip:
                        skip -= len(piece)
                        continue
                    piece, skip = piece[skip:], 0
                left = want - received[0]
                if len(piece) > left:
                    piece = piece[:left]
                sink(start + received[0], piece)
                received[0] += len(piece)
            if response.status == 200:
                response.close()  # the rest of the body is not needed

    async def _read_into(self, start: int, end: int, buf: bytearray) -> None:
        pos = start + len(buf)
        async with self._request("GET", {"Range": f"bytes={pos}-{end - 1}"}) as response:
            self._check_encoding(response)
            if response.status == 206:
                self._check_partial(response, pos)
                await self._stream(response, buf, end - start, skip=0)
            elif response.status == 200:
                self._check_whole(response, start, pos, end)
                buf.clear()  # the body starts at byte 0: read it from `start` again
                await self._stream(response, buf, end - start, skip=start)
                response.close()  # the rest of the body is not needed
            else:
                raise self._status_error(response)

    async def _stream(self, response: aiohttp.ClientResponse, buf: bytearray, want: int, *, skip: int) -> None:
        """Append body bytes to `buf` until it holds `want`, after discarding `skip` bytes."""
        try:
            while skip > 0:
                piece = await response.content.read(min(skip, _READ_PIECE))
                if not piece:
                    return
                skip -= len(piece)
            while len(buf) < want:
                piece = await response.content.read(min(want - len(buf), _READ_PIECE))
                if not piece:
                    return
                buf += piece
        except TimeoutError as exc:
            raise SourceUnavailableError(
                self.name, f"body stalled: no data for {self._timeout_s:g} s after {len(buf)} bytes"
            ) from exc
        except (aiohttp.ClientError, OSError) as exc:
            detail = str(exc) or type(exc).__name__
            raise SourceUnavailableError(self.name, f"connection lost after {len(buf)} bytes: {detail}") from exc

    # -- responses ---------------------------------------------------------------------------------------

    def _content_range(self, response: aiohttp.ClientResponse) -> tuple[int, int, int]:
        """(first, last, total) from Content-Range (first = last = -1 for 'bytes */total')."""
        header = response.headers.get("Content-Range", "")
        match = _CONTENT_RANGE.match(header)
        if match is None or match.group(3) == "*":
            raise WeightError(
                self.name, f"HTTP {response.status} with an unusable Content-Range header {header!r}"
            )
        first, last, total = match.groups()
        return (int(first) if first else -1), (int(last) if last else -1), int(total)

    def _check_encoding(self, response: aiohttp.ClientResponse) -> None:
        encoding = response.headers.get("Content-Encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise UnsupportedError(
                self.name,
                f"the server compresses the body (Content-Encoding: {encoding}) although asked for "
                f"identity: sizes and byte ranges would be those of the compressed stream",
            )

    def _transient(self, response: aiohttp.ClientResponse) -> SourceUnavailableError:
        retry_after = parse_retry_after(response.headers.get("Retry-After"))
        hint = f", Retry-After {retry_after:g} s" if retry_after is not None else ""
        return SourceUnavailableError(
            self.name, f"HTTP {response.status} {response.reason or ''}".rstrip() + hint, retry_after=retry_after
        )

    def _status_error(self, response: aiohttp.ClientResponse) -> WeightError:
        if is_transient_status(response.status):
            return self._transient(response)
        return refusal(self.name, response.status, response.reason or "")
