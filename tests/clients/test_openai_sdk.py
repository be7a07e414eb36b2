"""The official `openai` SDK, as its documentation shows it: chat, streaming with usage, completions with
logprobs, `parse()` into a pydantic model, JSON modes, n and seeds, tools under every tool choice (cut off by
max_tokens too), the whole tool round trip, and the Responses API with typed request parameters."""

from __future__ import annotations

import json
from typing import Any, cast

import openai
import pytest
from openai.types.chat import (
    ChatCompletionMessageFunctionToolCall,
    ChatCompletionMessageParam,
    ChatCompletionToolParam,
)
from openai.types.responses import FunctionToolParam, ResponseInputParam, ToolChoiceFunctionParam
from openai.types.responses.response_input_param import FunctionCallOutput
from pydantic import BaseModel, Field

from tests.clients.conftest import MODEL, WEATHER_QUESTION, get_weather

pytestmark = pytest.mark.slow

TOOL: ChatCompletionToolParam = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
                   "additionalProperties": False}}}


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)


def test_chat_whole_and_streamed_with_usage(client: openai.OpenAI) -> None:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16)
    assert whole.choices[0].message.content is not None
    assert "Paris" in whole.choices[0].message.content
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=16,
                                                 stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage is not None and whole.usage is not None
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_completions_with_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and lp.top_logprobs is not None
    assert len(lp.tokens) == 4 and all(len(top) == 3 for top in lp.top_logprobs)
    assert "".join(lp.tokens) == r.choices[0].text


def test_parse_and_json_modes(client: openai.OpenAI) -> None:
    parsed = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Paris"}],
                                           response_format=City, max_tokens=60, temperature=0)
    assert isinstance(parsed.choices[0].message.parsed, City)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A JSON object, please."}],
                                       response_format={"type": "json_object"}, max_tokens=40, temperature=0)
    if r.choices[0].finish_reason == "stop":
        assert r.choices[0].message.content is not None
        assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_n_and_seeds(client: openai.OpenAI) -> None:
    args: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                                max_tokens=8, temperature=1.0, n=2, seed=7)
    first, again = client.chat.completions.create(**args), client.chat.completions.create(**args)
    assert len(first.choices) == 2
    assert [c.message.content for c in first.choices] == [c.message.content for c in again.choices]


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}, "auto"])
def test_tool_choices_whole_and_streamed(client: openai.OpenAI, choice: object) -> None:
    args: dict[str, Any] = dict(model=MODEL, messages=[{"role": "user", "content": WEATHER_QUESTION}],
                                tools=[TOOL], tool_choice=choice, max_tokens=60, temperature=0)
    whole = client.chat.completions.create(**args).choices[0]
    calls = whole.message.tool_calls or []
    if choice != "auto":
        assert calls and calls[0].function.name == "get_weather"
    if isinstance(choice, dict):  # a named function: exactly one call
        assert whole.finish_reason == "tool_calls" and len(calls) == 1
    complete = calls if whole.finish_reason == "tool_calls" else calls[:-1]  # the last may be cut off
    for call in complete:
        assert set(json.loads(call.function.arguments)) == {"city"}
    streamed: dict[int, list[str]] = {}
    for chunk in client.chat.completions.create(stream=True, **args):
        for d in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
            entry = streamed.setdefault(d.index, ["", ""])
            entry[0] += d.function.name or ""
            entry[1] += d.function.arguments or ""
    assert [tuple(streamed[i]) for i in sorted(streamed)] == [(c.function.name, c.function.arguments) for c in calls]


def test_a_call_cut_off_by_max_tokens_returns_its_partial_arguments(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": WEATHER_QUESTION}],
                                       tools=[TOOL], tool_choice="required", max_tokens=14, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.tool_calls is not None
    (call,) = choice.message.tool_calls
    assert isinstance(call, ChatCompletionMessageFunctionToolCall)
    assert call.function.name == "get_weather" and '{"city": "'.startswith(call.function.arguments[:10])


def test_the_tool_round_trip(client: openai.OpenAI) -> None:
    """As the SDK's documentation writes an agent loop: the assistant message appended as returned, then
    one "tool" message per call, then the next turn."""
    messages: list = [{"role": "user", "content": WEATHER_QUESTION}]
    first = client.chat.completions.create(model=MODEL, messages=messages, tools=[TOOL], max_tokens=40,
                                           tool_choice="required", parallel_tool_calls=False, temperature=0)
    message = first.choices[0].message
    messages.append(message)
    assert message.tool_calls is not None
    for call in message.tool_calls:
        assert isinstance(call, ChatCompletionMessageFunctionToolCall)
        messages.append({"role": "tool", "tool_call_id": call.id,
                         "content": get_weather(**json.loads(call.function.arguments))})
    second = client.chat.completions.create(model=MODEL, messages=messages, tools=[TOOL], max_tokens=30,
                                            temperature=0)
    assert second.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert second.choices[0].message.content or second.choices[0].message.tool_calls


def test_responses_with_typed_parameters_and_a_function_round_trip(client: openai.OpenAI) -> None:
    tool: FunctionToolParam = {"type": "function", "name": "get_weather", "description": "The current weather.",
                               "parameters": TOOL["function"]["parameters"], "strict": True}
    choice: ToolChoiceFunctionParam = {"type": "function", "name": "get_weather"}
    items: ResponseInputParam = [{"role": "user", "content": WEATHER_QUESTION}]
    first = client.responses.create(model=MODEL, input=items, tools=[tool], tool_choice=choice,
                                    max_output_tokens=40, temperature=0)
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city"}
    # the output items, sent back (model_dump() is typed as a plain dict)
    items += cast(ResponseInputParam, [item.model_dump(exclude_none=True) for item in first.output])
    output: FunctionCallOutput = {"type": "function_call_output", "call_id": call.call_id,
                                  "output": get_weather(**json.loads(call.arguments))}
    items.append(output)
    second = client.responses.create(model=MODEL, input=items, tools=[tool], max_output_tokens=20, temperature=0)
    assert second.status in ("completed", "incomplete") and second.output
    parsed = client.responses.parse(model=MODEL, input="Paris is a city in France.", text_format=City,
                                    max_output_tokens=60, temperature=0)
    assert isinstance(parsed.output_parsed, City)
