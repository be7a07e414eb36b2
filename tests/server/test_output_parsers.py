"""The output parsers (tool calls in each format, reasoning, and the two together as a chat choice's output)
fed every kind of text: valid outputs, every cut of them, and hostile text made of the formats' own syntax,
whole and in random pieces. Every call returns within a time bound, the result never holds more than the
text did, and a stream always reassembles to the whole-text result."""

from __future__ import annotations

import itertools
import json
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Literal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ferrum.server.chat_output import ChatOutput
from ferrum.server.reasoning import FORMATS as REASONING
from ferrum.server.reasoning import ReasoningStream, split_reasoning
from ferrum.server.tool_calls import FORMATS, ToolCall, ToolCallStream, parse_tool_calls

CALL_BOUND_S = 1.0  # per feed or finish; a correct parser takes well under a millisecond on these texts
PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
NAMES = ["get_weather", "get_time", "search"]

# the formats' own syntax, to build hostile text from
SYNTAX = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<think>", "</think>", "{", "}", "[",
          "]", '"', "\\", ":", ",", ";", " ", "\n", '"name"', '"arguments"', '"parameters"', '"get_weather"', "Par",
          "null", "1", "<", "/", "tool_call", ">", "\\u00e9", "é"]
json_scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False, allow_infinity=False),
                         st.text(max_size=8))
json_values = st.recursive(json_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=6), inner, max_size=3)), max_leaves=8)
arguments = st.dictionaries(st.text(max_size=8), json_values, max_size=4)
calls = st.lists(st.tuples(st.sampled_from(NAMES), arguments), min_size=1, max_size=3)
hostile = st.lists(st.one_of(st.sampled_from(SYNTAX), st.text(max_size=4)), max_size=40).map("".join)
plain = st.text(st.characters(blacklist_characters="<[{"), max_size=20)


@contextmanager
def time_bound(seconds: float = CALL_BOUND_S) -> Iterator[None]:
    """Fails the call inside if it runs longer than `seconds` (a loop that never ends included)."""

    def expired(*_: Any) -> None:
        raise TimeoutError(f"a parser call ran for more than {seconds} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def pieces(text: str, cuts: list[int]) -> list[str]:
    points = sorted({c % (len(text) + 1) for c in cuts} | {0, len(text)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


def stream_tools(name: str, parts: list[str], max_calls: int | None = None) -> tuple[str, list[ToolCall], dict]:
    """Feeds `parts` then finishes, each call time-bounded; the content, the calls, and the calls rebuilt from
    the deltas alone."""
    stream = ToolCallStream(FORMATS[name], max_calls, NAMES)
    content, rebuilt = "", {}
    for part in [*parts, None]:
        with time_bound():
            piece, deltas = stream.finish() if part is None else stream.feed(part)
        content += piece
        for d in deltas:
            if d.name is not None:
                assert d.index not in rebuilt and d.id, "a call's header comes once, first"
                rebuilt[d.index] = [d.id, d.name, ""]
            else:
                assert d.index in rebuilt, "arguments before the call's header"
            rebuilt[d.index][2] += d.arguments
    assert content == stream.content
    return content, stream.calls, rebuilt


def check_tools(name: str, text: str, cuts: list[int], max_calls: int | None = None) -> tuple[str, list[ToolCall]]:
    with time_bound():
        content, whole = parse_tool_calls(FORMATS[name], text, max_calls, NAMES)
    streamed, calls, rebuilt = stream_tools(name, pieces(text, cuts), max_calls)
    assert streamed == content
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole]
    assert [tuple(rebuilt[i]) for i in sorted(rebuilt)] == [(c.id, c.name, c.arguments) for c in calls]
    # nothing is made up: the result is no bigger than the text (a call without arguments gets "{}")
    assert len(content) + sum(len(c.name) + len(c.arguments) for c in calls) <= len(text) + 2 * len(calls)
    assert len(calls) <= text.count("{") and (max_calls is None or len(calls) <= max_calls)
    return content, calls


@pytest.mark.parametrize("name", list(FORMATS))
@PROPERTY
@given(data=st.data())
def test_tool_parsers_on_valid_outputs_and_every_cut(name: str, data: st.DataObject) -> None:
    fmt = FORMATS[name]
    made = data.draw(calls)
    before = data.draw(plain) if fmt.marker else ""
    written = [(n, json.dumps(a, ensure_ascii=data.draw(st.booleans()))) for n, a in made]
    text = before + fmt.render(written)
    cuts = data.draw(st.lists(st.integers(0, 10_000), max_size=12))
    content, got = check_tools(name, text, cuts)
    assert content == before
    assert [(c.name, c.arguments) for c in got] == written
    # cut anywhere: the calls read so far, each a prefix of what was written (a cut-off call keeps its
    # partial arguments, as OpenAI returns them with finish_reason "length")
    end = data.draw(st.integers(0, len(text)))
    content, got = check_tools(name, text[:end], cuts)
    assert len(got) <= len(written)
    for call, (n, args) in zip(got, written, strict=False):
        assert call.name == n and args.startswith(call.arguments)
    assert content in (before, before[:end]) or content == text[:end]
    # at most one call when only one may be made
    _, one = check_tools(name, text, cuts, max_calls=1)
    assert [(c.name, c.arguments) for c in one] == written[:1]


@pytest.mark.parametrize("name", list(FORMATS))
@PROPERTY
@given(text=hostile, cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_tool_parsers_on_hostile_text(name: str, text: str, cuts: list[int]) -> None:
    check_tools(name, text, cuts)
    check_tools(name, text, cuts, max_calls=1)


@pytest.mark.parametrize("name", list(REASONING))
@PROPERTY
@given(text=hostile, cuts=st.lists(st.integers(0, 10_000), max_size=12))
def test_reasoning_parsers_on_any_text(name: str, text: str, cuts: list[int]) -> None:
    fmt = REASONING[name]
    with time_bound():
        whole_reasoning, whole_answer = split_reasoning(fmt, text)
    stream = ReasoningStream(fmt)
    reasoning = answer = ""
    for part in [*pieces(text, cuts), None]:
        with time_bound():
            r, a = stream.finish() if part is None else stream.feed(part)
        reasoning, answer = reasoning + r, answer + a
    assert (whole_reasoning or "", whole_answer) == (reasoning, answer)
    assert len(reasoning) + len(answer) <= len(text)


@pytest.mark.parametrize(("tools", "reasoning"), [("hermes", "qwen3"), ("llama3_json", "deepseek_r1"),
                                                  ("mistral", "qwen3")])
@PROPERTY
@given(text=hostile, cuts=st.lists(st.integers(0, 10_000), max_size=12),
       finish=st.sampled_from(["stop", "length"]))
def test_a_choice_streamed_matches_the_whole_message(tools: str, reasoning: str, text: str, cuts: list[int],
                                                     finish: Literal["stop", "length"]) -> None:
    output = ChatOutput(FORMATS[tools], None, REASONING[reasoning], frozenset(NAMES))
    with time_bound():
        message, whole_finish = output.message(text, finish)
    stream = output.stream()
    content = thought = ""
    calls: dict[int, list[str]] = {}
    for part in pieces(text, cuts):
        with time_bound():
            delta = stream.feed(part)
        deltas = [] if delta is None else [delta]
        content, thought = _add(deltas, content, thought, calls)
    with time_bound():
        last, streamed_finish = stream.finish(finish)
    content, thought = _add([] if last is None else [last], content, thought, calls)
    assert streamed_finish == whole_finish
    assert content == (message.content or "") and thought == (message.reasoning_content or "")
    assert [(n, a) for _, n, a in (calls[i] for i in sorted(calls))] == [
        (c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _add(deltas: list[Any], content: str, thought: str, calls: dict[int, list[str]]) -> tuple[str, str]:
    for d in deltas:
        content += d.content or ""
        thought += d.reasoning_content or ""
        for c in d.tool_calls or []:
            if c.id:
                calls[c.index] = [c.id, c.function.name, ""]
            calls[c.index][2] += c.function.arguments or ""
    return content, thought


@pytest.mark.parametrize("name", list(FORMATS))
def test_long_outputs_take_time_in_proportion_to_their_length(name: str) -> None:
    """A 70 KB call, after 50 KB of white space or not, fed a few characters at a time (a token each): a parser
    that rescans what it saw in Python takes minutes; this one well under a second."""
    fmt = FORMATS[name]
    big = fmt.render([("search", {"q": "x" * 50_000, "deep": [[{"a": "}{"}] * 2000]})])
    for text in (big, " " * 50_000 + big, big[: len(big) // 2]):
        start = time.perf_counter()
        _, calls, _ = stream_tools(name, [text[i:i + 4] for i in range(0, len(text), 4)])
        assert time.perf_counter() - start < 10, "parsing took more than linear time"
        assert len(calls) == 1 and calls[0].name == "search"
    stream = ReasoningStream(REASONING["qwen3"])
    start = time.perf_counter()
    for i in range(0, 200_000, 4):
        stream.feed(" " if i < 100_000 else "<th" if i == 100_000 else "x")
    assert time.perf_counter() - start < 10
