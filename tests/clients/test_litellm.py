"""LiteLLM's SDK against the server as an OpenAI-compatible provider ("openai/<model>" with api_base), as its
documentation shows it: completion, streaming, response_format, tools with the round trip, and responses."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest
from pydantic import BaseModel, Field

from tests.clients.conftest import MODEL, WEATHER_QUESTION, get_weather

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of its price list (no network here)
import litellm
from litellm.types.llms.openai import ResponsesAPIResponse

pytestmark = pytest.mark.slow
TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


@pytest.fixture(scope="module")
def provider(base_url: str) -> dict[str, Any]:
    return {"model": f"openai/{MODEL}", "api_base": base_url, "api_key": "unused", "timeout": 120}


def test_completion_and_streaming(provider: dict[str, Any]) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = litellm.completion(messages=messages, max_tokens=16, temperature=0, **provider)
    assert "Paris" in whole.choices[0].message.content
    stream = litellm.completion(messages=messages, max_tokens=16, temperature=0, stream=True, **provider)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == whole.choices[0].message.content


def test_response_format(provider: dict[str, Any]) -> None:
    r = litellm.completion(messages=[{"role": "user", "content": "Paris"}], response_format=City, max_tokens=60,
                           temperature=0, **provider)
    City.model_validate_json(r.choices[0].message.content)


def test_tools_and_their_results(provider: dict[str, Any]) -> None:
    messages: list[Any] = [{"role": "user", "content": WEATHER_QUESTION}]
    first = litellm.completion(messages=messages, tools=[TOOL], tool_choice="required", parallel_tool_calls=False,
                               max_tokens=40, temperature=0, **provider)
    message = first.choices[0].message
    (call,) = message.tool_calls
    assert call.function.name == "get_weather" and first.choices[0].finish_reason == "tool_calls"
    messages.append(message)
    messages.append({"role": "tool", "tool_call_id": call.id,
                     "content": get_weather(**json.loads(call.function.arguments))})
    second = litellm.completion(messages=messages, tools=[TOOL], max_tokens=20, temperature=0, **provider)
    assert second.choices[0].message.content or second.choices[0].message.tool_calls


def test_responses(provider: dict[str, Any]) -> None:
    r = litellm.responses(input="What is the capital of France?", max_output_tokens=16, temperature=0, **provider)
    assert isinstance(r, ResponsesAPIResponse)  # neither streamed nor awaited
    output: list[Any] = r.output  # items of several libraries' classes (or dicts), read by `type` as the docs do
    text = "".join(part.text for item in output if item.type == "message" for part in item.content)
    assert "Paris" in text
