"""pydantic-ai's agents over the OpenAI chat model, as its documentation shows them: an agent with a tool
and a structured output (tool output, its default, and native output), and a conversation carried on from
a message history that holds a tool call and its result."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import BaseModel, Field
from pydantic_ai import Agent, NativeOutput
from pydantic_ai.messages import (
    ModelMessage,
    ModelRequest,
    ModelResponse,
    ToolCallPart,
    ToolReturnPart,
    UserPromptPart,
)
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.output import OutputSpec
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings
from pydantic_ai.usage import UsageLimits

from tests.clients.conftest import MODEL, WEATHER_QUESTION, get_weather

pytestmark = pytest.mark.slow
LIMITS = UsageLimits(request_limit=6)  # a run that loops fails fast instead of running 50 requests


class Weather(BaseModel):
    city: str = Field(max_length=20)
    summary: str = Field(max_length=40)


@pytest.fixture(scope="module")
def model(base_url: str) -> OpenAIChatModel:
    return OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=base_url, api_key="unused"))


def agent_with_a_tool(model: OpenAIChatModel, output_type: OutputSpec[Any], calls: list[str]) -> Agent:
    agent = Agent(model, output_type=output_type, retries=2,
                  model_settings=ModelSettings(temperature=0, max_tokens=100))

    @agent.tool_plain
    def weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return get_weather(city)

    return agent


def test_an_agent_with_a_tool_and_structured_output(model: OpenAIChatModel) -> None:
    calls: list[str] = []
    agent = agent_with_a_tool(model, Weather, calls)  # the output as a tool (pydantic-ai's default)
    result = agent.run_sync(WEATHER_QUESTION, usage_limits=LIMITS)
    assert isinstance(result.output, Weather)
    # whether the small model called the tool first is its choice; when it did, the result went back to it
    returned = [p for m in result.all_messages() for p in getattr(m, "parts", []) if isinstance(p, ToolReturnPart)]
    assert len(returned) >= len(calls)


def test_native_structured_output(model: OpenAIChatModel) -> None:
    """The output as the answer's JSON schema (response_format). (With tools as well, "auto" lets the model call
    them instead of answering, as OpenAI does; the demo model then calls them again and again.)"""
    agent = Agent(model, output_type=NativeOutput(Weather), model_settings=ModelSettings(temperature=0, max_tokens=100))
    result = agent.run_sync(WEATHER_QUESTION, usage_limits=LIMITS)
    assert isinstance(result.output, Weather)


def test_a_conversation_carried_on_after_a_tool_result(model: OpenAIChatModel) -> None:
    history: list[ModelMessage] = [
        ModelRequest(parts=[UserPromptPart(WEATHER_QUESTION)]),
        ModelResponse(parts=[ToolCallPart("weather", {"city": "Paris"}, tool_call_id="call_1")]),
        ModelRequest(parts=[ToolReturnPart("weather", get_weather("Paris"), tool_call_id="call_1")]),
    ]
    agent = agent_with_a_tool(model, str, [])
    result = agent.run_sync("Summarise that in one sentence.", message_history=history, usage_limits=LIMITS)
    assert isinstance(result.output, str) and result.output
