"""LangChain's `ChatOpenAI` against the server, as LangChain's documentation shows it: invoke, stream, batch,
structured output (json_schema and function_calling), tools bound with every tool choice, and the whole tool
round trip through ToolMessages."""

from __future__ import annotations

from typing import Literal

import pytest
from langchain_core.messages import AIMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field

from tests.clients.conftest import MODEL, WEATHER_QUESTION
from tests.clients.conftest import get_weather as weather_in

pytestmark = pytest.mark.slow


@tool
def get_weather(city: str) -> str:
    """The current weather in a city."""
    return weather_in(city)


class City(BaseModel):
    """A city and its country."""

    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


@pytest.fixture(scope="module")
def llm(base_url: str) -> ChatOpenAI:
    return ChatOpenAI(base_url=base_url, api_key="unused", model=MODEL, temperature=0, max_tokens=60, max_retries=0,
                      timeout=120)


def test_invoke_stream_batch(llm: ChatOpenAI) -> None:
    answer = llm.invoke("What is the capital of France?")
    assert "Paris" in answer.content
    streamed = ""
    for chunk in llm.stream("What is the capital of France?"):
        assert isinstance(chunk.content, str)
        streamed += chunk.content
    assert streamed == answer.content
    replies = llm.batch(["What is the capital of France?", "Say hello."])
    assert replies[0].content == answer.content and replies[1].content


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output(llm: ChatOpenAI, method: Literal["json_schema", "function_calling"]) -> None:
    city = llm.with_structured_output(City, method=method, strict=True).invoke("Tell me about Paris.")
    assert isinstance(city, City)


@pytest.mark.parametrize("choice", ["get_weather", "required", "any", "auto"])
def test_bind_tools(llm: ChatOpenAI, choice: str) -> None:
    message = llm.bind_tools([get_weather], tool_choice=choice).invoke(WEATHER_QUESTION)
    assert isinstance(message, AIMessage)
    if choice == "auto":  # the small model may answer or call: either is well formed
        assert message.content or message.tool_calls
        return
    assert message.tool_calls and message.tool_calls[0]["name"] == "get_weather"
    assert set(message.tool_calls[0]["args"]) == {"city"}
    if choice == "get_weather":
        assert len(message.tool_calls) == 1 and not message.invalid_tool_calls


def test_a_full_tool_round_trip(llm: ChatOpenAI) -> None:
    with_tools = llm.bind_tools([get_weather])
    messages: list = [HumanMessage(WEATHER_QUESTION)]
    called = llm.bind_tools([get_weather], tool_choice="get_weather").invoke(messages)
    messages.append(called)
    for call in called.tool_calls:
        messages.append(ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]))
    final = with_tools.invoke(messages)
    assert isinstance(final, AIMessage) and (final.content or final.tool_calls)
