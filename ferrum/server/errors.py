"""OpenAI-shaped errors: the exception the handlers raise, its JSON body, and the app-wide handlers.

Every error leaves the server as ``{"error": {"message", "type", "param", "code"}}`` with a fitting
status code. Validation problems are 400 (as OpenAI answers), never FastAPI's 422 dump.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ferrum.engine.sampling_params import SamplingParamsError

log = logging.getLogger(__name__)

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "NotFoundError",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "server_error",
    503: "service_unavailable",
}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """Every error's body, as OpenAI sends it."""

    error: ErrorDetail


class APIError(Exception):
    """An error answer for the client; raise it anywhere in a handler."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPE_BY_STATUS.get(status_code, "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code, headers=dict(self.headers or {}))


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_sampling_params_error(exc: SamplingParamsError) -> APIError:
    return bad_request(str(exc), param=exc.param)


def internal_error() -> APIError:
    return APIError(500, "The server had an internal error while processing the request; see the server log.")


# -- validation errors as one line -------------------------------------------------------------------


def _path(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else part
    return out


def from_validation_error(errors: list[dict[str, Any]] | ValidationError) -> APIError:
    """The first problem of a pydantic validation, as one human line naming the field."""
    items = errors.errors(include_url=False) if isinstance(errors, ValidationError) else errors
    if not items:
        return bad_request("The request body is invalid.")
    first = items[0]
    loc = tuple(p for p in first.get("loc", ()) if p != "body")
    kind = str(first.get("type", ""))
    if kind == "json_invalid":
        return bad_request("The request body is not valid JSON.")
    if not loc:
        return bad_request("The request body must be a JSON object.")
    path = _path(loc)
    if kind == "missing":
        message = f"Missing required parameter: '{path}'."
    else:
        detail = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
        message = f"Invalid value for '{path}': {detail}"
    if len(items) > 1:
        message += f" ({len(items) - 1} more problem{'s' if len(items) > 2 else ''} in the request)"
    return bad_request(message, param=path)


# -- handlers ------------------------------------------------------------------------------------------


async def _api_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, APIError)
    return exc.response()


async def _sampling_params_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, SamplingParamsError)
    return from_sampling_params_error(exc).response()


async def _request_validation_error(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return from_validation_error(list(exc.errors())).response()


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    if exc.status_code == 404:
        message = f"Invalid URL ({request.method} {request.url.path})"
    elif exc.status_code == 405:
        message = f"Method {request.method} is not allowed for {request.url.path}"
    else:
        message = str(exc.detail)
    return APIError(exc.status_code, message, headers=exc.headers).response()


class CatchAllMiddleware:
    """Anything unexpected becomes a logged traceback and a 500 in OpenAI shape (when the response
    has not started yet; a started stream handles its own errors)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await internal_error().response()(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(SamplingParamsError, _sampling_params_error)
    app.add_exception_handler(RequestValidationError, _request_validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_middleware(CatchAllMiddleware)
