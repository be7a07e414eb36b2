"""Rendering a model's Jinja chat template, the way HF transformers renders it.

Templates come from model folders, so they are untrusted code: they run in Jinja's immutable
sandbox. The environment mirrors HF's: `trim_blocks`, `lstrip_blocks`, loop controls, a
`tojson` filter that does not escape HTML, and the globals `raise_exception` and `strftime_now`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """The model has no usable chat template, or its template refused the conversation.

    When the template calls `raise_exception(msg)`, `str(error)` is exactly `msg`.
    """


def render_chat_template(
    source: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None,
    special_tokens: Mapping[str, str],
    extra: Mapping[str, Any],
) -> str:
    """Render `source` for `messages`.

    The template sees `messages`, `tools`, `documents` (None unless given in `extra`),
    `add_generation_prompt`, the named special tokens that are set (`bos_token`, `eos_token`, ...)
    and every key of `extra`. As in HF, keys whose value is None are dropped from each message.
    """
    if not messages:
        raise ChatTemplateError("cannot apply the chat template to an empty conversation")
    variables: dict[str, Any] = {
        **special_tokens,
        "documents": None,
        **_plain(dict(extra)),
        "messages": [_message(message) for message in messages],
        "tools": _plain(list(tools)) if tools is not None else None,
        "add_generation_prompt": add_generation_prompt,
    }
    template = compile_chat_template(source)
    try:
        return template.render(variables)
    except ChatTemplateError:
        raise
    except Exception as exc:  # a template is code: any error in it is the template's failure
        raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from exc


@lru_cache(maxsize=32)
def compile_chat_template(source: str) -> jinja2.Template:
    """The compiled template for `source`; each distinct source is compiled once."""
    try:
        return _ENVIRONMENT.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ChatTemplateError(
            f"chat template is not valid Jinja (line {exc.lineno}): {exc.message}"
        ) from exc


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(message, Mapping):
        raise ChatTemplateError(f"chat messages must be objects, got {type(message).__name__}")
    return {key: _plain(value) for key, value in message.items() if value is not None}


def _plain(value: Any) -> Any:
    """A fresh copy of `value` made of JSON types only, so templates never touch caller objects."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {str(key): _plain(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_plain(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_plain(item) for item in value)
    # Subclasses (str enums, numpy scalars) may carry methods the sandbox does not know: keep the base value.
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    return f"<{type(value).__name__}>"


def _raise_exception(message: str) -> NoReturn:
    raise ChatTemplateError(message)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | str | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _Namespace(jinja2.utils.Namespace):
    """Jinja's `namespace()`, refusing attribute names that start with an underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_attribute_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_attribute_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_attribute_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(
            f"chat templates may not set the attribute {name!r} on a namespace"
        )


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; rendering keeps the body."""

    tags = {"generation"}  # noqa: RUF012  (the type jinja2.ext.Extension declares)

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[jinja2.ext.loopcontrols, _GenerationTag],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["namespace"] = _Namespace
    return env


_ENVIRONMENT = _environment()
