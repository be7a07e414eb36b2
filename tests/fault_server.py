"""An HTTP server for download tests: serves bytes with Range support and injects faults on demand.

It runs on 127.0.0.1 on a free port, in a thread with its own event loop, so sync and async tests
(and boto3 threads) can all talk to it. It serves either in-memory files (`server.files`) or, in
proxy mode, whatever an upstream server (moto's S3) answers, with the same faults applied to the
upstream's response.

Faults (`server.faults`, a `Faults`; reset with `server.reset()`):
  fail_status/fail_count/retry_after  answer the first `fail_count` requests with `fail_status`
  fail_body                           ... and this body (e.g. an S3 XML error) instead of plain text
  not_found / forbidden               paths answered 404 / 403
  cut_after_bytes                     drop the connection after N body bytes of a response
  cut_at_offset                       drop it when the body reaches absolute file offset K
  cut_times                           how many responses get cut (None: every one)
  corrupt_offset                      flip the byte at absolute file offset K
  delay_s                             wait before answering
  stall_at_offset/stall_s             stop sending mid-body at offset K for `stall_s` seconds
  fault_path                          the cut, corrupt and stall faults apply to this path only
  ignore_range                        answer 200 with the whole body and no Accept-Ranges
  head_status                         answer HEAD with this status (e.g. 405) instead

Counters: `server.requests` (a `RequestLog` per request) and `server.bytes_served` (body bytes
written to clients, across all responses).
"""

from __future__ import annotations

import asyncio
import re
import threading
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from aiohttp import ClientSession, web

_RANGE_RE = re.compile(r"^bytes=(\d*)-(\d*)$")
_CONTENT_RANGE_RE = re.compile(r"^bytes (\d+)-(\d+)/(\d+|\*)$")
_WRITE_BLOCK = 8192
_HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "host", "content-length"}
)


@dataclass
class Faults:
    fail_status: int = 500
    fail_count: int = 0
    retry_after: str | None = None
    fail_body: str | None = None  # e.g. an S3 XML error document (sent as application/xml)
    not_found: set[str] = field(default_factory=set)
    forbidden: set[str] = field(default_factory=set)
    cut_after_bytes: int | None = None
    cut_at_offset: int | None = None
    cut_times: int | None = 1
    corrupt_offset: int | None = None
    delay_s: float = 0.0
    stall_at_offset: int | None = None
    stall_s: float = 0.0
    ignore_range: bool = False
    head_status: int | None = None
    fault_path: str | None = None  # e.g. "/tiny/model-00002-of-00002.safetensors"; None: every path


@dataclass(frozen=True)
class RequestLog:
    method: str
    path: str
    range: str | None
    status: int


class FaultServer:
    def __init__(self, files: Mapping[str, bytes] | None = None, upstream: str | None = None) -> None:
        self.files: dict[str, bytes] = dict(files or {})
        self.upstream = upstream
        self.faults = Faults()
        self.requests: list[RequestLog] = []
        self.bytes_served = 0
        self._lock = threading.Lock()
        self._cuts_done = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._client: ClientSession | None = None
        self.port = 0

    # -- life cycle ------------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def url(self, path: str) -> str:
        return f"{self.base_url}/{path.lstrip('/')}"

    def start(self) -> None:
        ready = threading.Event()
        self._loop = asyncio.new_event_loop()

        def run() -> None:
            assert self._loop is not None
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(self._start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="fault-server", daemon=True)
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("fault server did not start within 10 s")

    def stop(self) -> None:
        if self._loop is None or self._thread is None:
            return
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
        self._loop = None

    def reset(self) -> None:
        """Clear faults and counters (files stay)."""
        with self._lock:
            self.faults = Faults()
            self.requests = []
            self.bytes_served = 0
            self._cuts_done = 0

    @property
    def cuts_done(self) -> int:
        """Responses cut so far."""
        with self._lock:
            return self._cuts_done

    def count(self, method: str = "GET") -> int:
        with self._lock:
            return sum(1 for r in self.requests if r.method == method)

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_route("*", "/{path:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=0.2)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.Server) and server.sockets
        self.port = int(server.sockets[0].getsockname()[1])
        if self.upstream is not None:
            self._client = ClientSession(auto_decompress=False)

    async def _stop(self) -> None:
        if self._client is not None:
            await self._client.close()
        if self._runner is not None:
            await self._runner.cleanup()
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in others:  # handlers still sleeping in a delay or stall fault
            task.cancel()
        await asyncio.gather(*others, return_exceptions=True)

    # -- request handling ------------------------------------------------------------------------

    def _log(self, request: web.Request, status: int) -> None:
        with self._lock:
            self.requests.append(
                RequestLog(request.method, request.path, request.headers.get("Range"), status)
            )

    def _take_failure(self) -> bool:
        with self._lock:
            failures_so_far = sum(1 for r in self.requests if r.status == self.faults.fail_status)
            return failures_so_far < self.faults.fail_count

    def _take_cut(self) -> bool:
        with self._lock:
            if self.faults.cut_times is not None and self._cuts_done >= self.faults.cut_times:
                return False
            self._cuts_done += 1
            return True

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        faults = self.faults
        path = request.path.lstrip("/")
        if faults.delay_s:
            await asyncio.sleep(faults.delay_s)
        if faults.fail_count and self._take_failure():
            self._log(request, faults.fail_status)
            headers = {"Retry-After": faults.retry_after} if faults.retry_after is not None else {}
            if faults.fail_body is not None:
                headers["Content-Type"] = "application/xml"
                return web.Response(status=faults.fail_status, headers=headers, body=faults.fail_body.encode())
            return web.Response(status=faults.fail_status, headers=headers, text="injected failure")
        for paths, status in ((faults.not_found, 404), (faults.forbidden, 403)):
            if path in paths:
                self._log(request, status)
                return web.Response(status=status, text="injected status")
        if request.method == "HEAD" and faults.head_status is not None:
            self._log(request, faults.head_status)
            return web.Response(status=faults.head_status)
        if self.upstream is not None:
            return await self._proxy(request)
        return await self._serve_file(request, path)

    async def _serve_file(self, request: web.Request, path: str) -> web.StreamResponse:
        data = self.files.get(path)
        if data is None or request.method not in ("GET", "HEAD"):
            status = 404 if data is None else 405
            self._log(request, status)
            return web.Response(status=status)
        size = len(data)
        headers = {"ETag": f'"{zlib.crc32(data):08x}{size:x}"'}
        if not self.faults.ignore_range:
            headers["Accept-Ranges"] = "bytes"
        status, start, end = 200, 0, size
        range_header = request.headers.get("Range")
        if range_header is not None and not self.faults.ignore_range:
            parsed = _parse_range(range_header, size)
            if parsed is None:
                self._log(request, 416)
                return web.Response(status=416, headers={"Content-Range": f"bytes */{size}"})
            status, (start, end) = 206, parsed
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{size}"
        self._log(request, status)
        response = web.StreamResponse(status=status, headers=headers)
        response.content_length = end - start
        await response.prepare(request)
        if request.method == "GET":
            await self._write_body(request, response, data[start:end], start)
        return response

    async def _proxy(self, request: web.Request) -> web.StreamResponse:
        assert self._client is not None and self.upstream is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        body = await request.read()
        async with self._client.request(
            request.method, self.upstream + request.path_qs, headers=headers, data=body or None,
            allow_redirects=False,
        ) as upstream:
            payload = await upstream.read()
            out_headers = {k: v for k, v in upstream.headers.items() if k.lower() not in _HOP_BY_HOP}
            for name, value in out_headers.items():  # keep redirects to the upstream on the proxy
                if name.lower() == "location" and value.startswith(self.upstream):
                    out_headers[name] = self.base_url + value[len(self.upstream):]
            self._log(request, upstream.status)
            response = web.StreamResponse(status=upstream.status, headers=out_headers)
            if request.method == "HEAD":
                length = upstream.headers.get("Content-Length")
                if length is not None:
                    response.content_length = int(length)
                await response.prepare(request)
                return response
            response.content_length = len(payload)
            await response.prepare(request)
            offset = 0
            match = _CONTENT_RANGE_RE.match(upstream.headers.get("Content-Range", ""))
            if match is not None:
                offset = int(match.group(1))
            await self._write_body(request, response, payload, offset)
            return response

    async def _write_body(
        self, request: web.Request, response: web.StreamResponse, body: bytes, offset: int
    ) -> None:
        """Write `body` (file bytes from absolute `offset`) with the corrupt/stall/cut faults."""
        faults = self.faults
        if faults.fault_path is not None and request.path != faults.fault_path:
            faults = Faults()
        data = bytearray(body)
        if faults.corrupt_offset is not None and offset <= faults.corrupt_offset < offset + len(data):
            data[faults.corrupt_offset - offset] ^= 0xFF
        cut_at = _cut_point(faults, offset, len(data))
        if cut_at is not None and not self._take_cut():
            cut_at = None
        stall_at = None
        if faults.stall_at_offset is not None and offset <= faults.stall_at_offset < offset + len(data):
            stall_at = faults.stall_at_offset - offset
        limit = len(data) if cut_at is None else cut_at
        pos = 0
        while pos < limit:
            step = min(_WRITE_BLOCK, limit - pos)
            if stall_at is not None and pos <= stall_at < pos + step:
                step = max(stall_at - pos, 0)
                if step == 0:
                    await asyncio.sleep(faults.stall_s)
                    stall_at = None
                    continue
            with self._lock:  # counted before writing, so a client never sees bytes not yet counted
                self.bytes_served += step
            try:
                await response.write(bytes(data[pos : pos + step]))
            except ConnectionError:  # the client hung up (it had what it wanted, or timed out)
                return
            pos += step
        if cut_at is not None:
            transport = request.transport
            if transport is not None:
                transport.abort()
            return
        await response.write_eof()


def _cut_point(faults: Faults, offset: int, length: int) -> int | None:
    """Where in a body of `length` bytes starting at file `offset` the connection is cut, if at all."""
    points = []
    if faults.cut_after_bytes is not None and faults.cut_after_bytes < length:
        points.append(faults.cut_after_bytes)
    if faults.cut_at_offset is not None and offset <= faults.cut_at_offset < offset + length:
        points.append(faults.cut_at_offset - offset)
    return min(points) if points else None


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """`bytes=a-b` / `bytes=a-` / `bytes=-n` -> [start, end), or None when unsatisfiable."""
    match = _RANGE_RE.match(header.strip())
    if match is None:
        return None
    first, last = match.groups()
    if first == "" and last == "":
        return None
    if first == "":
        n = int(last)
        return (max(size - n, 0), size) if n > 0 and size > 0 else None
    start = int(first)
    end = size if last == "" else min(int(last) + 1, size)
    if start >= size or end <= start:
        return None
    return start, end
