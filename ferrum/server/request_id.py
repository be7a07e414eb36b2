"""X-Request-Id: honoured (and echoed) when given and usable, else a fresh uuid4 hex."""

from __future__ import annotations

import uuid

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_MAX_REQUEST_ID_LEN = 128


class RequestIdMiddleware:
    """Puts the request id in scope["state"]["request_id"] and on every response as X-Request-Id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1").strip()
        usable = 0 < len(given) <= _MAX_REQUEST_ID_LEN and given.isprintable()
        request_id = given if usable else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["x-request-id"] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)
