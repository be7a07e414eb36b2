"""Request bodies of at most `limits.max_body_mb`: a larger one is refused with 413 before any
handler runs (by its Content-Length when it sends one, else as it arrives), so a handler never
holds more than the limit in memory.

The refused body is read and dropped (up to `DRAIN_BYTES`) before the answer goes out: a server that
closes a socket with unread bytes in it makes the kernel reset the connection, and the client then
loses the 413 it was sent."""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ferrum.server.errors import APIError

DRAIN_BYTES = 256 << 20


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and not length.isdigit():
            await self._refuse(scope, receive, send, drained=False)
            return
        if length is not None and int(length) > self.max_bytes:
            await self._refuse(scope, receive, send, drained=await self._drain(receive, 0))
            return
        chunks: list[bytes] = []
        size = 0
        while True:  # read the whole body (at most the limit) before the app sees it
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                drained = not message.get("more_body", False) or await self._drain(receive, size)
                await self._refuse(scope, receive, send, drained=drained)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # then: the disconnect, when the client leaves

        await self.app(scope, replay, send)

    @staticmethod
    async def _drain(receive: Receive, size: int) -> bool:
        """Reads and drops the rest of the body; False when it ran past DRAIN_BYTES (or the client left)."""
        while size <= DRAIN_BYTES:
            message = await receive()
            if message["type"] == "http.disconnect":
                return False
            size += len(message.get("body", b""))
            if not message.get("more_body", False):
                return True
        return False

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, drained: bool) -> None:
        mib = self.max_bytes / 2**20
        error = APIError(413, f"The request body is larger than the server's limit of {mib:g} MiB.",
                         code="request_too_large", headers={} if drained else {"Connection": "close"})
        await error.response()(scope, receive, send)
