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
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


class ToolParserError(ValueError):
    pass


@dataclass(frozen=True)
class ToolFormat:
    """How a model family writes tool calls: `open`, then each call's JSON object between `call_open` and
    `call_close`, joined by `joiner`, then `close` (what the forcing grammar writes, and how a conversation's
    earlier calls are shown to a template that has no place for them). Reading is more lenient: any of
    `separators` (and white space) may stand between calls, and `prefixes` before the first."""

    name: str
    marker: str  # what opens the tool-call part of the output ("" : the output must start with a call)
    arguments_keys: tuple[str, ...]  # the key holding a call's arguments (the first is what the grammar writes)
    template_hints: tuple[str, ...]  # text in a chat template that says it emits this format
    separators: tuple[str, ...]  # syntax allowed between calls
    prefixes: tuple[str, ...] = ()  # optional text before the calls ("<|python_tag|>")
    open: str = ""
    call_open: str = ""
    call_close: str = ""
    joiner: str = ""
    close: str = ""

    def grammar(self, tools: Sequence[Mapping[str, Any]], forced: str | None, parallel: bool,
                otherwise: str | None = None) -> str:
        """A Lark grammar (llguidance's dialect) for output that is only tool calls: one or more (one when
        `parallel` is false) of the tools, `forced` only when given, each call's arguments matching its
        function's JSON schema; or, when `otherwise` (a Lark expression) is given, that instead of calls."""
        chosen = [t for t in tools if forced is None or t["function"]["name"] == forced]
        if not chosen:
            raise ToolParserError(f"tool_choice names {forced!r}, which is not among the tools")
        schema = {"anyOf": [_call_schema(t["function"], self.arguments_keys[0]) for t in chosen],
                  "x-guidance": _COMPACT}
        call = _around(self.call_open, "%json " + json.dumps(schema), self.call_close)
        calls = f"call ({json.dumps(self.joiner)} call)*" if parallel else "call"
        start = _around(self.open, calls, self.close)
        rules = [f"start: {start}" if otherwise is None else f"start: ({start}) | answer", f"call: {call}"]
        if otherwise is not None:
            rules.append(f"answer: {otherwise}")
        return "\n".join(rules)

    def render(self, calls: Sequence[tuple[str, Any]]) -> str:
        """(name, arguments) pairs written as the model writes them (arguments given as JSON text are kept)."""
        objects = []
        for name, arguments in calls:
            args = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            objects.append(f"{self.call_open}{{\"name\": {json.dumps(name, ensure_ascii=False)}, "
                           f"\"{self.arguments_keys[0]}\": {args or '{}'}}}{self.call_close}")
        return self.open + self.joiner.join(objects) + self.close


def _around(before: str, expression: str, after: str) -> str:
    """A Lark expression between two pieces of literal text (left out when empty)."""
    return " ".join([*([json.dumps(before)] if before else []), expression, *([json.dumps(after)] if after else [])])


# calls written as json.dumps writes them: no room for the runs of white space small models drift into
_COMPACT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _call_schema(function: dict[str, Any], arguments_key: str) -> dict[str, Any]:
    # a function without parameters takes none (as OpenAI reads it): an empty object
    params = _closed(function.get("parameters") or {"type": "object", "properties": {}})
    return {"type": "object", "properties": {"name": {"const": function["name"]}, arguments_key: params},
            "required": ["name", arguments_key], "additionalProperties": False}


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")


def _closed(schema: Any) -> Any:
    """The schema with objects that list their properties taking no others unless it says they may (as vLLM's
    default grammar backend reads a schema): a small model otherwise writes on, key after made-up key."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SCHEMA_MAPS:
        if isinstance(schema.get(key), dict):
            out[key] = {name: _closed(sub) for name, sub in schema[key].items()}
    for key in _SCHEMA_LISTS:
        if isinstance(schema.get(key), list):
            out[key] = [_closed(sub) for sub in schema[key]]
    for key in _SCHEMA_ONE:
        if key in schema:
            out[key] = _closed(schema[key])
    if "properties" in schema and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("hermes", "<tool_call>", ("arguments",), ("<tool_call>",),
                         separators=("</tool_call>", "<tool_call>", ","),
                         call_open="<tool_call>\n", call_close="\n</tool_call>", joiner="\n"),
    "llama3_json": ToolFormat("llama3_json", "", ("parameters", "arguments"), ("<|python_tag|>", '"parameters"'),
                              separators=(";", ","), prefixes=("<|python_tag|>",), joiner="; "),
    "mistral": ToolFormat("mistral", "[TOOL_CALLS]", ("arguments",), ("[TOOL_CALLS]",), separators=("[", "]", ","),
                          open="[TOOL_CALLS][", joiner=", ", close="]"),
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
    arguments: str  # JSON text of the arguments object, as the model wrote it (cut short if the output was)
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass
class CallDelta:
    """One streamed piece of a tool call: the header (name set) or an arguments fragment."""

    index: int
    arguments: str
    name: str | None = None
    id: str | None = None


# where the stream is in the output
_CONTENT = "content"  # plain text; a marker would open tool calls
_BETWEEN = "between"  # in the tool-call part, before a call's `{` (or the syntax between calls)
_CALL = "call"  # inside a call's JSON object
_TEXT = "text"  # plain text to the end (a format whose calls can only come first)
_DONE = "done"  # as many calls as allowed were read: the rest is dropped

# where a call's object scanner is at the object's own level (depth 1)
_KEY, _KEY_STR, _COLON, _VALUE, _VALUE_STR, _VALUE_NESTED, _VALUE_SCALAR = range(7)
_STRING_SPECIAL = re.compile(r'["\\]')
_NESTED_SPECIAL = re.compile(r'["{}\[\]]')


class ToolCallStream:
    """Splits a choice's output, as it arrives, into content and tool calls (see the module docstring).
    `feed(text)` returns (content, call deltas) new since the last feed; `finish()` the rest; `calls` and
    `content` the whole result so far.

    Every character is scanned once, by a small state machine over the format's syntax and the JSON of each
    call, so a feed costs time in proportion to its text and nothing can loop on its input. At `finish`, a
    call the output cut short is returned as written so far (OpenAI's partial arguments, finish_reason
    "length"); an object without a "name" (or, given `names`, naming no such tool) is not a call, and goes
    back to the content."""

    def __init__(self, fmt: ToolFormat, max_calls: int | None = None, names: Container[str] | None = None) -> None:
        self.fmt = fmt
        self.max_calls = max_calls
        self.names = names
        self.text = ""
        self.content = ""
        self.calls: list[ToolCall] = []
        self._pos = 0  # text before it is handled
        self._state = _CONTENT
        self._part_start = 0  # where the current tool-call part began (its marker), for content fall-back
        self._part_calls = 0  # calls read in the current part
        self._call: _CallScan | None = None
        self._lead_end = 0  # the white space at the start already looked at (formats without a marker)

    def feed(self, new: str) -> tuple[str, list[CallDelta]]:
        self.text += new
        return self._advance(final=False)

    def finish(self) -> tuple[str, list[CallDelta]]:
        return self._advance(final=True)

    # -- the scanner -------------------------------------------------------------------------------
    def _advance(self, final: bool) -> tuple[str, list[CallDelta]]:
        content: list[str] = []
        deltas: list[CallDelta] = []
        # each pass either consumes text or changes state towards one that waits for more: it ends
        while self._pos < len(self.text) or (final and self._state == _CALL):
            before = (self._pos, self._state)
            if self._state == _CONTENT:
                self._in_content(content, final)
            elif self._state == _TEXT:
                content.append(self.text[self._pos:])
                self._pos = len(self.text)
            elif self._state == _BETWEEN:
                self._between(content, final)
            elif self._state == _CALL:
                self._in_call(content, deltas, final)
            else:  # _DONE
                self._pos = len(self.text)
            if (self._pos, self._state) == before:
                break  # waiting for more text
        if final and self._state == _BETWEEN and self._part_calls == 0:
            content.append(self.text[self._part_start:self._pos])  # a marker and nothing after it
        piece = "".join(content)
        self.content += piece
        return piece, deltas

    def _in_content(self, content: list[str], final: bool) -> None:
        text, fmt = self.text, self.fmt
        if not fmt.marker:  # the output is calls if it starts with one (after an optional prefix)
            i = self._lead_end = _skip_space(text, max(self._pos, self._lead_end))
            for prefix in fmt.prefixes:
                if text.startswith(prefix, i):
                    i = _skip_space(text, i + len(prefix))
            rest = text[i:i + max(map(len, fmt.prefixes), default=1)]
            if i < len(text) and text[i] == "{":
                self._enter_calls(self._pos, i)
            elif not final and (i == len(text) or any(p.startswith(rest) for p in fmt.prefixes)):
                return  # not known yet
            else:
                self._state = _TEXT
            return
        i = text.find(fmt.marker, self._pos)
        if i >= 0:
            content.append(text[self._pos:i])
            self._enter_calls(i, i + len(fmt.marker))
            return
        keep = 0 if final else _partial_suffix(text, fmt.marker, self._pos)
        content.append(text[self._pos:len(text) - keep])
        self._pos = len(text) - keep

    def _enter_calls(self, part_start: int, pos: int) -> None:
        self._state = _BETWEEN
        self._part_start = part_start
        self._part_calls = 0
        self._pos = pos

    def _between(self, content: list[str], final: bool) -> None:
        """Moves past white space and the syntax between calls to the next call's `{`."""
        if self.max_calls is not None and len(self.calls) >= self.max_calls:
            self._state = _DONE
            return
        text, fmt = self.text, self.fmt
        i = _skip_space(text, self._pos)
        while i < len(text):
            if text[i] == "{":
                self._pos = i
                self._state = _CALL
                self._call = _CallScan(i, len(self.calls), fmt.arguments_keys, self.names)
                return
            sep = next((s for s in fmt.separators if text.startswith(s, i)), None)
            if sep is None:
                break
            i = _skip_space(text, i + len(sep))
        self._pos = i
        if i == len(text):
            return
        if any(s.startswith(text[i:]) for s in fmt.separators):
            if final:  # syntax cut off after the last call
                self._pos = len(text)
            return  # the start of a separator: wait for the rest
        # the model wrote on after its calls: that text is content (and may open another tool-call part)
        if self._part_calls == 0:
            content.append(text[self._part_start:i])
        self._state = _CONTENT if fmt.marker else _TEXT

    def _in_call(self, content: list[str], deltas: list[CallDelta], final: bool) -> None:
        call = self._call
        assert call is not None
        end = call.scan(self.text, self._pos)
        self._pos = end if end is not None else len(self.text)
        call.stream(self.text, deltas, self._pos)
        if end is None and not final:
            return
        self._call = None
        if call.name is None:  # not a call: the tool-call part ends here, its text is content
            if self._part_calls == 0:
                content.append(self.text[self._part_start:self._pos])
            elif end is not None:  # (a call cut off before its name, after others, is dropped)
                content.append(self.text[call.start:self._pos])
            self._state = _CONTENT if self.fmt.marker else _TEXT
            return
        self.calls.append(call.close(self.text, deltas, self._pos, complete=end is not None))
        self._part_calls += 1
        self._state = _BETWEEN


class _CallScan:
    """One call's JSON object, scanned as it arrives: the "name" string and the arguments value at the
    object's own level (keys inside the arguments are not looked at)."""

    def __init__(self, start: int, index: int, arguments_keys: tuple[str, ...], names: Container[str] | None) -> None:
        self.start = start
        self.index = index
        self.arguments_keys = arguments_keys
        self.names = names
        self.name: str | None = None  # set once read (and, given `names`, one of them)
        self.name_read = False
        self.call_id = f"call_{uuid.uuid4().hex[:24]}"
        self.args_start: int | None = None
        self.args_end: int | None = None
        self.args_sent = 0
        self.header_sent = False
        # the scanner
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.where = _KEY
        self.key = ""
        self.token_start = 0  # where the current key or value began
        self.scalar_end = 0  # one past the last non-space character of a scalar value

    def scan(self, text: str, pos: int) -> int | None:
        """Scans from `pos`; returns the index one past the object's closing `}`, or None when the text ends
        first."""
        i, n = pos, len(text)
        while i < n:
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                    i += 1
                    continue
                m = _STRING_SPECIAL.search(text, i)
                if m is None:
                    return None
                i = m.start()
                if text[i] == "\\":
                    self.escaped = True
                else:
                    self.in_string = False
                    if self.depth == 1:
                        self._string_closed(text, i + 1)
                i += 1
                continue
            if self.depth > 1:  # inside a value: only strings and brackets matter
                m = _NESTED_SPECIAL.search(text, i)
                if m is None:
                    return None
                i = m.start()
            ch = text[i]
            if ch == '"':
                self.in_string = True
                if self.depth == 1:
                    if self.where == _KEY:
                        self.where, self.token_start = _KEY_STR, i
                    elif self.where == _VALUE:
                        self._value_begins(_VALUE_STR, i)
            elif ch in "{[":
                if self.depth == 1 and self.where == _VALUE:
                    self._value_begins(_VALUE_NESTED, i)
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 1 and self.where == _VALUE_NESTED:
                    self._value_ends(i + 1)
                elif self.depth <= 0:
                    if self.where == _VALUE_SCALAR:
                        self._value_ends(self.scalar_end)
                    return i + 1
            elif self.depth == 1:
                if ch == ":" and self.where == _COLON:
                    self.where = _VALUE
                elif ch == ",":
                    if self.where == _VALUE_SCALAR:
                        self._value_ends(self.scalar_end)
                    self.where = _KEY
                elif not ch.isspace():
                    if self.where == _VALUE:
                        self._value_begins(_VALUE_SCALAR, i)
                    if self.where == _VALUE_SCALAR:
                        self.scalar_end = i + 1
            i += 1
        return None

    def _string_closed(self, text: str, end: int) -> None:
        if self.where == _KEY_STR:
            self.key = _json_string(text[self.token_start:end]) or ""
            self.where = _COLON
        elif self.where == _VALUE_STR:
            if self.key == "name" and not self.name_read:
                self.name_read = True
                name = _json_string(text[self.token_start:end])
                self.name = name if name is not None and (self.names is None or name in self.names) else None
            self._value_ends(end)

    def _value_begins(self, kind: int, i: int) -> None:
        self.where, self.token_start = kind, i
        if self.key in self.arguments_keys and self.args_start is None:
            self.args_start = i

    def _value_ends(self, end: int) -> None:
        if self.args_start == self.token_start and self.args_end is None:
            self.args_end = end
        self.where = _KEY  # (a comma or the closing brace comes next)

    def stream(self, text: str, deltas: list[CallDelta], upto: int) -> None:
        """The deltas for what was scanned: the header once the name is known, then the arguments so far
        (a scalar's only once it is whole)."""
        if self.name is None:
            return
        if not self.header_sent:
            deltas.append(CallDelta(self.index, "", name=self.name, id=self.call_id))
            self.header_sent = True
        if self.args_start is None:
            return
        if self.args_end is not None:
            upto = self.args_end
        elif self.where == _VALUE_SCALAR and self.token_start == self.args_start:
            return
        if upto > self.args_start + self.args_sent:
            deltas.append(CallDelta(self.index, text[self.args_start + self.args_sent:upto]))
            self.args_sent = upto - self.args_start

    def close(self, text: str, deltas: list[CallDelta], end: int, complete: bool) -> ToolCall:
        """The call; `complete`: its object was closed (else the output ended inside it)."""
        assert self.name is not None
        if self.args_start is None:  # no arguments: an empty object, or none yet where the output was cut
            arguments = "{}" if complete else ""
            if arguments:
                deltas.append(CallDelta(self.index, arguments))
            return ToolCall(self.name, arguments, self.call_id)
        if self.args_end is None and self.where == _VALUE_SCALAR:  # cut off in a scalar: what there is
            self.args_end = self.scalar_end
            self.stream(text, deltas, end)
        return ToolCall(self.name, text[self.args_start:self.args_start + self.args_sent], self.call_id)


def _json_string(literal: str) -> str | None:
    try:
        value = json.loads(literal)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, str) else None


_SPACE = re.compile(r"\s*")


def _skip_space(text: str, i: int) -> int:
    match = _SPACE.match(text, i)
    assert match is not None
    return match.end()


def _partial_suffix(text: str, marker: str, start: int) -> int:
    """How many characters at the end of `text` could begin `marker` (held back from the content)."""
    for n in range(min(len(marker) - 1, len(text) - start), 0, -1):
        if marker.startswith(text[len(text) - n:]):
            return n
    return 0


def parse_tool_calls(fmt: ToolFormat, text: str, max_calls: int | None = None,
                     names: Container[str] | None = None) -> tuple[str, list[ToolCall]]:
    """The whole output's content and tool calls."""
    stream = ToolCallStream(fmt, max_calls, names)
    stream.feed(text)
    stream.finish()
    return stream.content, stream.calls
