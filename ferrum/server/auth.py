"""API keys: `Authorization: Bearer KEY` on every route but the open ones.

Open without a key: `/health`, `/ready`, `/version`, the API docs (`/docs`, `/redoc`,
`/openapi.json`) and, unless `api.metrics_require_key`, `/metrics`; CORS preflights (OPTIONS) are
answered by the CORS layer before this one. A missing or wrong key is a 401 in OpenAI's shape. Keys
are compared with `hmac.compare_digest` against every configured key (no early exit), and never
logged or echoed.
"""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Receive, Scope, Send

from ferrum.server.errors import APIError

OPEN_PATHS = frozenset({"/health", "/ready", "/version", "/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"})


def route_path(scope: Scope) -> str:
    """The request's path without the proxy's root path."""
    path: str = scope.get("path", "")
    root = scope.get("root_path", "")
    if root and path.startswith(root):
        path = path[len(root):] or "/"
    return path


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: tuple[str, ...], metrics_open: bool = True, ui_open: bool = False) -> None:
        self.app = app
        self._keys = tuple(k.encode() for k in keys)
        self._open = OPEN_PATHS | ({"/metrics"} if metrics_open else set()) | ({"/"} if ui_open else set())
        self._open_prefixes = ("/ui/",) if ui_open else ()

    def _is_open(self, path: str) -> bool:
        return path in self._open or path.startswith(self._open_prefixes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._is_open(route_path(scope)) or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization")
        message = ("Missing API key: send it as `Authorization: Bearer YOUR_KEY`." if given is None
                   else "Incorrect API key provided.")
        error = APIError(401, message, code="invalid_api_key", type="invalid_request_error",
                         headers={"WWW-Authenticate": "Bearer"})
        await error.response()(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        matched = False
        for key in self._keys:  # every key compared: the time does not tell which one matched
            matched |= hmac.compare_digest(token, key)
        return matched
