"""/v1/responses through the official `openai` client on the demo model: text in and out with instructions,
the streaming event sequence adding up to the whole response, function tools (with a tool-aware template),
JSON-schema text format, and what a stateless server refuses."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import FunctionToolParam

from tests.live_server import MODEL_DIR, live_server
from tests.server.test_tool_calls import SCHEMAS, TOOLS, _model_with_template

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
# the SDK's FunctionToolParam requires `strict`; these tools leave it out, which Ferrum accepts
FUNCTION_TOOLS = cast("list[FunctionToolParam]", [{"type": "function", **t["function"]} for t in TOOLS])


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip(f"demo model not prepared at {MODEL_DIR}")
    folder: Path = _model_with_template(tmp_path_factory.mktemp("responses"), "hermes")
    with live_server("--model", str(folder), "--backend", "cpu", "--dtype", "float32", "--served-model-name",
                     MODEL) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_text_in_text_out(client: openai.OpenAI) -> None:
    r = client.responses.create(model=MODEL, input="What is the capital of France?", max_output_tokens=24,
                                temperature=0, instructions="You are a helpful assistant.")
    assert r.status == "completed" and r.object == "response" and r.id.startswith("resp_")
    assert "Paris" in r.output_text
    assert r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.usage is not None and r.usage.input_tokens > 0 and 0 < r.usage.output_tokens <= 24
    short = client.responses.create(model=MODEL, input="Tell me a long story about Paris.", max_output_tokens=4,
                                    temperature=0)
    assert short.status == "incomplete" and short.incomplete_details is not None
    assert short.incomplete_details.reason == "max_output_tokens"


def test_streamed_events_add_up_to_the_response(client: openai.OpenAI) -> None:
    args: dict[str, Any] = dict(
        model=MODEL, input=[{"role": "user", "content": "What is the capital of France?"}], max_output_tokens=24,
        temperature=0)
    whole = client.responses.create(**args)
    kinds, text, final = [], "", None
    for event in client.responses.create(stream=True, **args):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        if event.type == "response.completed":
            final = event.response
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.index("response.output_item.added") < kinds.index("response.content_part.added") < kinds.index(
        "response.output_text.delta") < kinds.index("response.output_text.done") < kinds.index(
        "response.output_item.done")
    assert final is not None
    assert text == whole.output_text == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens


def test_function_tools_and_their_results(client: openai.OpenAI) -> None:
    args: dict[str, Any] = dict(
        model=MODEL, input="What is the weather in Paris?", tools=FUNCTION_TOOLS, tool_choice="required",
        max_output_tokens=80, temperature=0, parallel_tool_calls=False)
    r = client.responses.create(**args)
    (call,) = [item for item in r.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    streamed = {}
    for event in client.responses.create(stream=True, **args):
        if event.type == "response.output_item.done" and event.item.type == "function_call":
            streamed = {"name": event.item.name, "arguments": event.item.arguments}
    assert streamed == {"name": call.name, "arguments": call.arguments}
    follow = client.responses.create(model=MODEL, max_output_tokens=20, temperature=0, tools=FUNCTION_TOOLS,
                                     tool_choice="none", input=[
                                         {"role": "user", "content": "What is the weather in Paris?"},
                                         {"type": "function_call", "call_id": call.call_id, "name": call.name,
                                          "arguments": call.arguments},
                                         {"type": "function_call_output", "call_id": call.call_id,
                                          "output": '{"temperature": 18}'}])
    assert follow.status in ("completed", "incomplete") and follow.output_text


def test_json_schema_text_format(client: openai.OpenAI) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Name the capital of France as JSON.", max_output_tokens=40,
                                temperature=0, text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                                                                "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_what_a_stateless_server_refuses(url: str) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": []}, "input"),
        ({"input": "hi", "text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
        ({"input": [{"type": "function_call_output"}]}, "input")]
    for body, param in cases:
        r = httpx.post(f"{url}/v1/responses", json={"model": MODEL, **body}, timeout=30)
        assert r.status_code == 400, (body, r.text)
        assert (r.json()["error"]["param"] or "").startswith(param), r.json()
