"""Tool calling: the output formats of three model families parsed whole and as a stream, and, through the
official `openai` client against servers whose chat templates (written here, in tests/server/templates) ask
for each family's format: named and required tool choices always yield calls that parse and match the
function's schema, streamed calls reassemble to the non-streamed ones, tool results are accepted back."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import jsonschema
import openai
import pytest
from openai.types.chat import (
    ChatCompletionFunctionToolParam,
    ChatCompletionMessage,
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageParam,
    ChatCompletionMessageToolCallParam,
)
from openai.types.shared_params import ResponseFormatJSONSchema

from ferrum.engine.sampling_params import StructuredOutput
from ferrum.engine.structured import checked_grammar
from ferrum.server.tool_calls import FORMATS, ToolCallStream, parse_tool_calls, tool_format
from tests.live_server import MODEL_DIR, live_server

TEMPLATES = Path(__file__).parent / "templates"
MODEL = "SmolLM2-135M-Instruct"
WEATHER: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20},
                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME: ChatCompletionFunctionToolParam = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The time in a time zone.",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 20}},
                       "required": ["zone"], "additionalProperties": False},
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the weather like in Paris today?"}]

SAMPLES = {
    "hermes": ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
               '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}; '
                    '{"name": "get_time", "parameters": {"zone": "CET"}}'),
    "mistral": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, '
                '{"name": "get_time", "arguments": {"zone": "CET"}}]'),
}


# -- the parsers, without a model ----------------------------------------------------------------------


@pytest.mark.parametrize("name", list(FORMATS))
def test_parser_reads_its_format_whole_and_in_any_pieces(name: str) -> None:
    fmt = FORMATS[name]
    content, calls = parse_tool_calls(fmt, SAMPLES[name])
    assert content == ("Let me check.\n" if name == "hermes" else "")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"zone": "CET"})]
    rng = random.Random(0)
    for _ in range(50):  # streamed in random pieces: the same content, names and argument strings
        stream = ToolCallStream(fmt)
        text, pieces, names = SAMPLES[name], [], {}
        args: dict[int, str] = {}
        i = 0
        while i < len(text):
            n = rng.randint(1, 7)
            pieces.append(stream.feed(text[i:i + n]))
            i += n
        pieces.append(stream.finish())
        for _, deltas in pieces:
            for d in deltas:
                if d.name is not None:
                    assert d.index not in names and d.id  # the header comes once, first
                    names[d.index] = d.name
                else:
                    assert d.index in names
                args[d.index] = args.get(d.index, "") + d.arguments
        assert "".join(c for c, _ in pieces) == content
        assert [names[i] for i in sorted(names)] == [c.name for c in calls]
        assert [args[i] for i in sorted(args)] == [c.arguments for c in calls]


@pytest.mark.parametrize("name", list(FORMATS))
def test_parser_limits_calls_and_leaves_plain_text_alone(name: str) -> None:
    fmt = FORMATS[name]
    _, calls = parse_tool_calls(fmt, SAMPLES[name], max_calls=1)
    assert [c.name for c in calls] == ["get_weather"]
    assert parse_tool_calls(fmt, "The weather in Paris is mild { or so }.") == (
        "The weather in Paris is mild { or so }.", [])


@pytest.mark.parametrize("name", list(FORMATS))
def test_forcing_grammar_compiles_and_accepts_its_own_format(name: str) -> None:
    import llguidance

    fmt = FORMATS[name]
    for forced, parallel in ((None, True), ("get_time", False)):
        grammar = checked_grammar(StructuredOutput("grammar", fmt.grammar(TOOLS, forced, parallel)))
        assert grammar
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(
        fmt.grammar(TOOLS, None, True))) == ""


def test_format_is_told_by_the_template_or_the_flag() -> None:
    for name in FORMATS:
        assert tool_format("auto", (TEMPLATES / f"{name}.jinja").read_text()) is FORMATS[name]
        assert tool_format(name, "no hints at all") is FORMATS[name]
    assert tool_format("auto", (MODEL_DIR / "chat_template.jinja").read_text()
                       if (MODEL_DIR / "chat_template.jinja").exists() else "") is None


def test_tool_turns_are_given_to_templates_in_the_shapes_they_know() -> None:
    from ferrum.server.protocol import ChatMessage, template_messages

    call = {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [ChatMessage.model_validate(m) for m in [
        {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_9", "content": "sunny"},
        {"role": "assistant", "function_call": {"name": "get_time", "arguments": "{}"}},
        {"role": "function", "name": "get_time", "content": "noon"},
    ]]
    assert template_messages(messages) == [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_9", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_9", "name": "get_weather"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_3_0", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "content": "noon", "name": "get_time", "tool_call_id": "call_3_0"},
    ]
    for bad in ({"role": "user", "content": None}, {"role": "tool", "content": "x", "tool_calls": [call]},
                {"role": "function", "content": "x"}):
        with pytest.raises(ValueError):
            ChatMessage.model_validate(bad)


def test_responses_input_items_become_a_conversation() -> None:
    from pydantic import ValidationError

    from ferrum.server.responses import ResponsesRequest

    function = {"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}
    req = ResponsesRequest.model_validate({"input": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "c1", "output": [{"type": "input_text", "text": "sunny"}]},
        {"type": "message", "role": "assistant", "id": "m1", "status": "completed",
         "content": [{"type": "output_text", "text": "Sunny.", "annotations": []}]},
    ], "tools": [function, {**function, "name": "get_time"}],
        "tool_choice": {"type": "allowed_tools", "mode": "required",
                        "tools": [{"type": "function", "name": "get_weather"}]}})
    chat = req.to_chat()
    assert [m.role for m in chat.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert chat.messages[3].content == "sunny" and chat.messages[3].tool_call_id == "c1"
    assert [t.function.name for t in chat.tools or []] == ["get_weather"] and chat.tool_choice == "required"
    for item, says in (({"type": "web_search_call", "id": "w"}, "not supported"),
                       ({"type": "item_reference", "id": "x"}, "stateless")):
        with pytest.raises(ValidationError, match=says):
            ResponsesRequest.model_validate({"input": [item]})


# -- through the server ---------------------------------------------------------------------------------


def _model_with_template(tmp: Path, family: str) -> Path:
    folder = tmp / f"model-{family}"
    folder.mkdir()
    for f in MODEL_DIR.iterdir():
        if f.name != "chat_template.jinja":
            (folder / f.name).symlink_to(f)
    (folder / "chat_template.jinja").write_text((TEMPLATES / f"{family}.jinja").read_text())
    return folder


@pytest.fixture(scope="module", params=list(FORMATS))
def family_server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[str, str]]:
    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip(f"demo model not prepared at {MODEL_DIR}")
    family = request.param
    folder = _model_with_template(tmp_path_factory.mktemp("tools"), family)
    # mistral's server names its parser; the others are told by their templates
    flags = ["--tool-call-parser", "mistral"] if family == "mistral" else []
    with live_server("--model", str(folder), "--backend", "cpu", "--dtype", "float32", "--served-model-name", MODEL,
                     *flags) as url:
        yield family, url


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


def _function_calls(message: ChatCompletionMessage) -> list[ChatCompletionMessageFunctionToolCall]:
    """The message's tool calls, every one a function call (the only kind there are here)."""
    assert message.tool_calls is not None
    calls = [c for c in message.tool_calls if isinstance(c, ChatCompletionMessageFunctionToolCall)]
    assert len(calls) == len(message.tool_calls)
    return calls


def _valid_call(call: Any, names: set[str]) -> dict:
    assert call.type == "function" and call.id and call.function.name in names
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


@pytest.mark.slow
def test_named_tool_choice_always_yields_a_valid_call(family_server: tuple[str, str]) -> None:
    _, url = family_server
    client = _client(url)
    for name in ("get_weather", "get_time"):
        for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2)):
            reply = client.chat.completions.create(
                model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=80, temperature=temperature, seed=seed,
                tool_choice={"type": "function", "function": {"name": name}}, parallel_tool_calls=False)
            choice = reply.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            calls = _function_calls(choice.message)
            assert len(calls) == 1 and calls[0].function.name == name
            _valid_call(calls[0], {name})


@pytest.mark.slow
def test_streamed_tool_calls_reassemble_to_the_non_streamed_ones(family_server: tuple[str, str]) -> None:
    _, url = family_server
    client = _client(url)
    args: dict[str, Any] = {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "tool_choice": "required",
                            "max_tokens": 120, "temperature": 0}
    whole = client.chat.completions.create(**args).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.tool_calls
    for call in whole.message.tool_calls:
        _valid_call(call, set(SCHEMAS))
    calls: dict[int, dict[str, Any]] = {}
    finish = None
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, {"id": None, "name": None, "arguments": ""})
                if d.id:
                    assert entry["id"] is None and d.type == "function" and d.function.name
                    entry.update(id=d.id, name=d.function.name)
                entry["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls"
    assert [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)] == [
        (c.function.name, c.function.arguments) for c in whole.message.tool_calls]


@pytest.mark.slow
def test_tool_results_go_back_to_the_model(family_server: tuple[str, str]) -> None:
    _, url = family_server
    client = _client(url)
    first = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=80,
                                           temperature=0, tool_choice="required", parallel_tool_calls=False)
    call = _function_calls(first.choices[0].message)[0]
    messages: list[ChatCompletionMessageParam] = [
        *QUESTION,
        {"role": "assistant", "content": None,
         "tool_calls": [cast(ChatCompletionMessageToolCallParam, call.model_dump())]},
                {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18, "sky": "clear"}'}]
    reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, max_tokens=30,
                                           temperature=0, tool_choice="none")
    assert reply.choices[0].message.content and not reply.choices[0].message.tool_calls
    rendered = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()["tokens"]
    assert len(rendered) > len(httpx.post(f"{url}/tokenize", json={"messages": QUESTION}).json()["tokens"])


@pytest.mark.slow
def test_tool_choices_mean_what_openai_says(family_server: tuple[str, str]) -> None:
    """A named function: exactly one call, even with parallel_tool_calls left at its default; a forced choice
    with an answer format: the call; "auto" with an answer format: calls, or an answer in that format."""
    _, url = family_server
    client = _client(url)
    person = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}},
              "required": ["name"], "additionalProperties": False}
    answer_format: ResponseFormatJSONSchema = {"type": "json_schema",
                                               "json_schema": {"name": "person", "schema": person}}
    for temperature, seed in ((0.0, None), (1.0, 3)):
        named = client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=60, temperature=temperature, seed=seed,
            tool_choice={"type": "function", "function": {"name": "get_time"}}).choices[0]
        assert named.finish_reason == "tool_calls"
        assert [c.function.name for c in _function_calls(named.message)] == ["get_time"]
        for parallel in (False, None):  # None: left out (true), so the model may go on calling to max_tokens
            forced = client.chat.completions.create(
                model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=60, temperature=temperature, seed=seed,
                tool_choice="required", response_format=answer_format,
                parallel_tool_calls=openai.omit if parallel is None else parallel).choices[0]
            calls = forced.message.tool_calls
            assert calls and forced.finish_reason in ("tool_calls", "length" if parallel is None else "tool_calls")
            assert len(calls) == 1 or parallel is None
            for call in calls if forced.finish_reason == "tool_calls" else calls[:-1]:  # the last may be cut off
                _valid_call(call, set(SCHEMAS))
        auto = client.chat.completions.create(
            model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=60, temperature=temperature, seed=seed,
            response_format=answer_format).choices[0]
        if auto.message.tool_calls:
            assert auto.finish_reason in ("tool_calls", "length")
            for call in auto.message.tool_calls[:None if auto.finish_reason == "tool_calls" else -1]:
                _valid_call(call, set(SCHEMAS))
        elif auto.finish_reason == "stop":
            assert auto.message.content is not None
            jsonschema.validate(json.loads(auto.message.content), person)


@pytest.mark.slow
def test_auto_tool_choice_returns_content_or_calls(family_server: tuple[str, str]) -> None:
    _, url = family_server
    reply = _client(url).chat.completions.create(model=MODEL, messages=QUESTION, tools=TOOLS, max_tokens=60,
                                                 temperature=0)
    choice = reply.choices[0]
    if choice.message.tool_calls:
        assert choice.finish_reason == "tool_calls"
        for call in _function_calls(choice.message):
            json.loads(call.function.arguments)
    else:
        assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")


@pytest.mark.slow
def test_bad_tool_requests_are_400s(family_server: tuple[str, str]) -> None:
    _, url = family_server
    base = {"model": MODEL, "messages": QUESTION, "max_tokens": 5}
    cases: list[tuple[dict[str, Any], str]] = [
        ({"tool_choice": "required"}, "tool_choice"),  # no tools
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        # a forced choice wins over the answer format, but a malformed format is still refused
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}}, "response_format"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools"),
    ]
    for extra, param in cases:
        r = httpx.post(f"{url}/v1/chat/completions", json={**base, **extra}, timeout=60)
        assert r.status_code == 400, (extra, r.text)
        assert (r.json()["error"]["param"] or "").startswith(param), r.json()


@pytest.mark.slow
def test_tools_with_a_template_that_shows_no_format_need_the_flag() -> None:
    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip(f"demo model not prepared at {MODEL_DIR}")
    with live_server("--model", str(MODEL_DIR), "--backend", "cpu", "--served-model-name", MODEL) as url:
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": QUESTION, "tools": TOOLS, "max_tokens": 5})
        assert r.status_code == 400 and "--tool-call-parser" in r.json()["error"]["message"]
        r = httpx.post(f"{url}/v1/chat/completions", timeout=60,
                       json={"model": MODEL, "messages": QUESTION, "tools": TOOLS, "tool_choice": "none",
                             "max_tokens": 5})
        assert r.status_code == 200
