"""A mixture of experts served as a dense model is (a tiny random-weight Qwen3-MoE with the demo model's
tokenizer and chat template, through `ferrum serve` and the official `openai` client): structured outputs
that hold, a required tool call that parses, the prefix cache hit by a repeated system prompt, and
the chat page."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.live_server import live_server
from tests.tiny_model import save_hf_model, tiny_config

pytestmark = pytest.mark.slow
MODEL = "tiny-qwen3-moe"
TOOL: Any = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
                   "required": ["city"], "additionalProperties": False}}}


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = Path(tmp_path_factory.mktemp("moe")) / MODEL
    save_hf_model(folder, tiny_config("qwen3-moe", vocab_size=49152, max_position_embeddings=1024), demo_tokenizer=True)
    with live_server("--model", str(folder), "--backend", "cpu", "--dtype", "float32", "--served-model-name", MODEL,
                     "--max-model-len", "512", "--tool-call-parser", "hermes") as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_structured_outputs_hold(client: openai.OpenAI) -> None:
    """A regex and a choice (a random model given a JSON schema may write whitespace, which JSON allows,
    until max_tokens: the grammar holds either way, the demo model's tests check schemas end to end)."""
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Is the sky blue?"}], max_tokens=20, temperature=0,
        extra_body={"guided_regex": "(yes|no), [0-9]{2} percent"})
    assert re.fullmatch(r"(yes|no), [0-9]{2} percent", reply.choices[0].message.content or "")
    assert reply.choices[0].finish_reason == "stop"
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Pick one."}], max_tokens=20, temperature=0.8, seed=3,
        extra_body={"guided_choice": ["red", "green", "blue"]})
    assert reply.choices[0].message.content in ("red", "green", "blue")


def test_a_required_tool_call_parses(client: openai.OpenAI) -> None:
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=60, temperature=0,
        tools=[TOOL], tool_choice="required")
    calls = reply.choices[0].message.tool_calls or []
    assert calls and calls[0].function.name == "get_weather"  # type: ignore[union-attr]
    assert json.loads(calls[0].function.arguments)["city"] in ("Paris", "Rome")  # type: ignore[union-attr]


def test_a_repeated_system_prompt_hits_the_prefix_cache(base_url: str, client: openai.OpenAI) -> None:
    system = "You are a careful assistant. " * 12
    for question in ("Hello?", "Goodbye?"):
        client.chat.completions.create(model=MODEL, max_tokens=4, temperature=0, messages=[
            {"role": "system", "content": system}, {"role": "user", "content": question}])
    metrics = httpx.get(f"{base_url}/metrics").text
    hits = re.search(r"^ferrum_prefix_cache_hits_total(?:\{[^}]*\})? (\S+)$", metrics, re.M)
    assert hits and float(hits.group(1)) > 0


def test_the_chat_page_serves(base_url: str) -> None:
    page = httpx.get(f"{base_url}/")
    assert page.status_code == 200 and "<html" in page.text.lower()
