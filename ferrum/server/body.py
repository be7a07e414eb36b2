"""Request bodies: JSON, whatever the Content-Type, validated into a request model."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from ferrum.server.errors import bad_request, from_validation_error

RequestT = TypeVar("RequestT", bound=BaseModel)


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def parse_body(request: Request, model: type[RequestT]) -> RequestT:
    """The body as `model`, whatever the Content-Type; any problem is a one-line 400."""
    raw = await request.body()
    if not raw.strip():
        raise bad_request("The request body is empty; expected a JSON object.")
    try:
        data = json.loads(raw, parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.")
    try:  # JSON may escape a lone surrogate (\ud800), which is no text: nothing could encode it
        json.dumps(data, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad_request(
            "The request body holds an unpaired UTF-16 surrogate (e.g. \\ud800): not valid text."
        ) from None
    except RecursionError:
        raise bad_request("The request body is nested too deeply.") from None
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None
