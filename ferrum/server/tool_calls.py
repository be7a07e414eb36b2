"""Tool calls in a model's output: the formats model families emit, parsed whole or as a stream, and the
grammar that makes `tool_choice` "required" or a named function hold.

    hermes        <tool_call>{"name": ..., "arguments": {...}}</tool_call>, repeated   (Qwen, Hermes, ...)
    llama3_json   {"name": ..., "parameters": {...}}; {...}, optionally after <|python_tag|>   (Llama 3.x)
    mistral       [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]   (Mistral)

Every format is: text, then a marker, then JSON objects with a name and an arguments object, separated
by bits of syntax (commas, semicolons, closing tags). `ToolCallStream` follows that shape as text arrives:
content before the marker streams as content; each call streams as OpenAI's deltas (its index, id, type
and name first, then the arguments text as it is generated). The arguments string is the model's own
text of the arguments object, so a streamed call reassembles to exactly the non-streamed one.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

_DECODER = json.JSONDecoder()
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


class ToolParserError(ValueError):
    pass


@dataclass(frozen=True)
class ToolFormat:
    name: str
    marker: str  # what opens the tool-call part of the output ("" : the output must start with a call)
    arguments_keys: tuple[str, ...]  # the key holding a call's arguments (the first is what the grammar writes)
    template_hints: tuple[str, ...]  # text in a chat template that says it emits this format
    skip: str  # characters allowed between calls (besides whitespace)
    prefixes: tuple[str, ...] = ()  # optional text before the marker's calls ("<|python_tag|>")

    def grammar(self, tools: list[dict[str, Any]], forced: str | None, parallel: bool) -> str:
        """A Lark grammar (llguidance's dialect) for output that is only tool calls: one or more (one when
        `parallel` is false) of the tools, `forced` only when given, each call's arguments matching its
        function's JSON schema."""
        chosen = [t for t in tools if forced is None or t["function"]["name"] == forced]
        if not chosen:
            raise ToolParserError(f"tool_choice names {forced!r}, which is not among the tools")
        schema = {"anyOf": [_call_schema(t["function"], self.arguments_keys[0]) for t in chosen]}
        call = "%json " + json.dumps(schema)
        if self.name == "hermes":
            one = f'"<tool_call>\\n" {call} "\\n</tool_call>"'
            body = f"{one} (\"\\n\" {one})*" if parallel else one
            return f"start: {body}"
        if self.name == "mistral":
            many = f"{call} (\", \" {call})*" if parallel else call
            return f'start: "[TOOL_CALLS][" {many} "]"'
        many = f"{call} (\"; \" {call})*" if parallel else call
        return f"start: {many}"


def _call_schema(function: dict[str, Any], arguments_key: str) -> dict[str, Any]:
    params = function.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, arguments_key: params},
            "required": ["name", arguments_key], "additionalProperties": False}


FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("hermes", "<tool_call>", ("arguments",), ("<tool_call>",), "</tool_call><tool_call>,"),
    "llama3_json": ToolFormat("llama3_json", "", ("parameters", "arguments"),
                              ("<|python_tag|>", '"parameters"'), ";,", ("<|python_tag|>",)),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", ("arguments",), ("[TOOL_CALLS]",), "[],"),
}


def tool_format(name: str | None, chat_template: str | None) -> ToolFormat | None:
    """The format named by `--tool-call-parser` (or "auto": detected from the chat template), or None."""
    if name not in (None, "auto"):
        if name not in FORMATS:
            raise ToolParserError(f"unknown tool call parser {name!r}; known: {', '.join(sorted(FORMATS))}, auto")
        return FORMATS[name]
    for fmt in FORMATS.values():
        if chat_template and any(hint in chat_template for hint in fmt.template_hints):
            return fmt
    return None


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text of the arguments object, as the model wrote it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass
class CallDelta:
    """One streamed piece of a tool call: the header (name set) or an arguments fragment."""

    index: int
    arguments: str
    name: str | None = None
    id: str | None = None


class ToolCallStream:
    """Splits a choice's output, as it arrives, into content and tool calls (see the module docstring).
    `feed(text)` returns (content, call deltas) new since the last feed; `finish()` the rest; `calls` and
    `content` the whole result so far."""

    def __init__(self, fmt: ToolFormat, max_calls: int | None = None) -> None:
        self.fmt = fmt
        self.max_calls = max_calls
        self.text = ""
        self.content = ""
        self.calls: list[ToolCall] = []
        self._pos = 0  # text before it is handled
        self._in_calls = False
        self._call_start: int | None = None  # where the current call's object begins
        self._args_start: int | None = None
        self._args_sent = 0  # arguments characters sent of the current call
        self._name_sent = False
        self._pending = ToolCall("", "")

    def feed(self, new: str) -> tuple[str, list[CallDelta]]:
        self.text += new
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[CallDelta]]:
        return self._advance(final=True)

    # -- the scanner -------------------------------------------------------------------------------
    def _advance(self, final: bool) -> tuple[str, list[CallDelta]]:
        content = ""
        deltas: list[CallDelta] = []
        while True:
            if not self._in_calls:
                piece, entered = self._content_until_marker(final)
                content += piece
                if not entered:
                    break
                continue
            if self._call_start is None and not self._find_call_start(final):
                break
            if not self._step_call(deltas, final):
                break
        self.content += content
        return content, deltas

    def _content_until_marker(self, final: bool) -> tuple[str, bool]:
        text, fmt = self.text, self.fmt
        if not fmt.marker:  # the output is calls if it starts with one (after an optional prefix)
            head = text[self._pos:].lstrip()
            for prefix in fmt.prefixes:
                if head.startswith(prefix):
                    head = head[len(prefix):].lstrip()
            if head.startswith("{") and not self.content:
                self._in_calls = True
                return "", True
            if not head or any(p.startswith(head) for p in fmt.prefixes) and not final:
                return "", False  # not known yet
            piece = text[self._pos:]
            self._pos = len(text)
            return piece, False
        i = text.find(fmt.marker, self._pos)
        if i >= 0:
            piece = text[self._pos:i]
            self._pos = i + len(fmt.marker)
            self._in_calls = True
            return piece, True
        keep = 0 if final else _partial_suffix(text, fmt.marker, self._pos)
        piece = text[self._pos:len(text) - keep]
        self._pos = len(text) - keep
        return piece, False

    def _find_call_start(self, final: bool) -> bool:
        """Moves past separators to the next call's `{`; False when there is none (yet)."""
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            self._pos = len(self.text)
            return False
        text = self.text
        i = self._pos
        while i < len(text):
            ch = text[i]
            if ch == "{":
                self._call_start = i
                self._pos = i
                return True
            prefix = next((p for p in self.fmt.prefixes if text.startswith(p, i)), "")
            if prefix:
                i += len(prefix)
                continue
            if ch.isspace() or ch in self.fmt.skip:
                i += 1
                continue
            break  # something that is not a call: the model wrote on after its calls
        self._pos = i
        return False

    def _step_call(self, deltas: list[CallDelta], final: bool) -> bool:
        """Advances the current call; True when it completed (look for the next)."""
        assert self._call_start is not None
        text, start = self.text, self._call_start
        index = len(self.calls)
        if not self._name_sent:
            m = _NAME.search(text, start)
            if m is None:
                return False
            self._pending = ToolCall(json.loads(f'"{m.group(1)}"'), "")
            deltas.append(CallDelta(index, "", name=self._pending.name, id=self._pending.id))
            self._name_sent = True
        if self._args_start is None:
            for key in self.fmt.arguments_keys:
                m = re.compile(rf'"{key}"\s*:\s*').search(text, start)
                if m is not None and m.end() < len(text):  # the value has begun (not just white space)
                    self._args_start = m.end()
                    break
            else:
                if final:
                    self._close_call(text, deltas, index)
                return final
        args_start = self._args_start
        try:
            _, end = _DECODER.raw_decode(text, args_start)
        except json.JSONDecodeError:
            end = None
        upto = end if end is not None else len(text)
        if upto > args_start + self._args_sent:
            deltas.append(CallDelta(index, text[args_start + self._args_sent:upto]))
            self._args_sent = upto - args_start
        if end is None:
            if final:
                self._close_call(text, deltas, index)
            return final
        self._pending.arguments = text[args_start:end]
        try:  # the whole call object, to move past it
            _, call_end = _DECODER.raw_decode(text, start)
        except json.JSONDecodeError:
            if not final:
                return False
            call_end = len(text)
        self._pos = call_end
        self._close_call(text, deltas, index)
        return True

    def _close_call(self, text: str, deltas: list[CallDelta], index: int) -> None:
        if self._args_start is not None and not self._pending.arguments:
            self._pending.arguments = text[self._args_start:self._args_start + self._args_sent]
        self.calls.append(self._pending)
        self._call_start = self._args_start = None
        self._args_sent = 0
        self._name_sent = False


def _partial_suffix(text: str, marker: str, start: int) -> int:
    """How many characters at the end of `text` could begin `marker` (held back from the content)."""
    for n in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if marker.startswith(text[len(text) - n:]):
            return n
    return 0


def parse_tool_calls(fmt: ToolFormat, text: str, max_calls: int | None = None) -> tuple[str, list[ToolCall]]:
    """The whole output's content and tool calls."""
    stream = ToolCallStream(fmt, max_calls)
    stream.feed(text)
    stream.finish()
    return stream.content, stream.calls
