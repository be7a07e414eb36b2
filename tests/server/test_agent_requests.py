"""The requests agent clients send, against `ferrum serve --config config/default.yaml --tool-call-parser hermes`
on the demo model: forced tool choices cut off by max_tokens inside a call's arguments (they once hung the
server's event loop for good) while /health is polled, the second turn of an agent loop (tool results sent
back), a forced choice with an answer format, and one request-log line per request, 4xx included."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.live_server import MODEL_DIR, ROOT, ServerProcess, server_process
from tests.server.test_tool_calls import _model_with_template

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason="demo model not prepared"),
]

WEATHER: dict[str, Any] = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
NO_PARAMETERS = {"type": "function", "function": {"name": "get_time", "description": "The time now."}}
QUESTION = [{"role": "user", "content": "What is the weather like in Paris today?"}]
CHAT = "/v1/chat/completions"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with server_process("--config", str(ROOT / "config" / "default.yaml"), "--tool-call-parser", "hermes",
                        "--log-format", "json") as s:
        yield s


class HealthWatch:
    """Polls GET /health every 50 ms on its own thread; `worst_s` is the slowest answer (a miss counts as
    infinitely slow)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.worst_s = 0.0
        self.polls = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=1.0) as client:
            while not self._stop.is_set():
                start = time.monotonic()
                try:
                    ok = client.get(f"{self.url}/health").status_code == 200
                except httpx.HTTPError:
                    ok = False
                self.worst_s = max(self.worst_s, time.monotonic() - start if ok else float("inf"))
                self.polls += 1
                time.sleep(0.05)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()


def _stream(url: str, body: dict[str, Any]) -> tuple[str | None, list[dict[str, str]]]:
    """A streamed chat's finish reason and its calls reassembled from the deltas."""
    calls: dict[int, dict[str, str]] = {}
    finish = None
    with httpx.stream("POST", f"{url}{CHAT}", json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for choice in chunk["choices"]:
                finish = choice.get("finish_reason") or finish
                for d in choice["delta"].get("tool_calls") or []:
                    entry = calls.setdefault(d["index"], {"name": "", "arguments": ""})
                    entry["name"] += d["function"].get("name") or ""
                    entry["arguments"] += d["function"].get("arguments") or ""
    return finish, [calls[i] for i in sorted(calls)]


def test_calls_cut_off_by_max_tokens_come_back_partial_while_health_answers(server: ServerProcess) -> None:
    """tool_choice "required" and a named function with parallel_tool_calls left out, as the openai SDK,
    LangChain's bind_tools and instructor's TOOLS mode send them, cut off at 6-40 tokens: every answer is a
    200 with finish_reason "length" and the call as written so far; /health answers within 1 s throughout."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    bodies = [{"messages": QUESTION, "tools": [WEATHER], "tool_choice": choice, "max_tokens": n, "seed": n}
              for choice in ("required", named) for n in (6, 12, 25, 40)]
    with HealthWatch(server.url) as health, ThreadPoolExecutor(8) as pool:
        whole = list(pool.map(lambda b: httpx.post(f"{server.url}{CHAT}", json=b, timeout=120), bodies))
        streamed = list(pool.map(lambda b: _stream(server.url, b), bodies))
    assert health.polls > 5 and health.worst_s < 1.0, (health.polls, health.worst_s)
    for body, reply, (stream_finish, stream_calls) in zip(bodies, whole, streamed, strict=True):
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        calls = choice["message"].get("tool_calls") or []
        if choice["finish_reason"] == "length" and calls:  # cut off: each call a prefix of a valid one
            assert all(c["function"]["name"] == "get_weather" for c in calls)
        elif choice["finish_reason"] == "length":  # cut off before the first call's name: the text as written
            assert '<tool_call>\n{"name": "get_weather"'.startswith(choice["message"]["content"])
        else:
            assert choice["finish_reason"] == "tool_calls", choice
            assert all(json.loads(c["function"]["arguments"])["city"] for c in calls)
        if body["tool_choice"] != "required":
            assert len(calls) <= 1 and len(stream_calls) <= 1  # a named function is called once
        assert stream_finish in ("length", "tool_calls")
    # the server is whole after it: a plain question, answered right
    reply = httpx.post(f"{server.url}{CHAT}", timeout=60, json={
        "messages": [{"role": "user", "content": "What is the capital of France?"}], "temperature": 0,
        "max_tokens": 20})
    assert reply.status_code == 200 and "Paris" in reply.json()["choices"][0]["message"]["content"]


def test_tool_results_go_back_through_a_template_without_tool_support(server: ServerProcess) -> None:
    """The demo model's template knows no tool calls: the second turn of an agent loop renders (content null,
    a role "tool" result; the older role "function" and function_call too), the earlier call written into the
    assistant's turn the way the model writes it."""
    first = httpx.post(f"{server.url}{CHAT}", timeout=60, json={
        "messages": QUESTION, "tools": [WEATHER, NO_PARAMETERS], "parallel_tool_calls": False,
        "tool_choice": {"type": "function", "function": {"name": "get_time"}}, "max_tokens": 30}).json()
    (call,) = first["choices"][0]["message"]["tool_calls"]
    assert call["function"] == {"name": "get_time", "arguments": "{}"}  # no parameters: an empty object
    second_turn = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": call["id"], "content": "12:00"}]
    older = [*QUESTION, {"role": "assistant", "function_call": {"name": "get_time", "arguments": "{}"}},
             {"role": "function", "name": "get_time", "content": "12:00"}]
    for messages in (second_turn, older):
        reply = httpx.post(f"{server.url}{CHAT}", timeout=60, json={
            "messages": messages, "tools": [WEATHER, NO_PARAMETERS], "max_tokens": 8, "temperature": 0})
        assert reply.status_code == 200, reply.text
        ids = httpx.post(f"{server.url}/tokenize", json={"messages": messages}).json()["tokens"]
        prompt = httpx.post(f"{server.url}/detokenize", json={"tokens": ids}).json()["prompt"]
        assert '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>' in prompt
        assert "tool\n12:00" in prompt


def test_forced_choice_with_an_answer_format_answers_with_the_call(server: ServerProcess) -> None:
    """instructor's RESPONSES_TOOLS sends a named function and text.format together; chat clients send
    "required" with response_format: the call wins."""
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
              "additionalProperties": False}
    r = httpx.post(f"{server.url}/v1/responses", timeout=60, json={
        "input": "What is the weather like in Paris today?", "max_output_tokens": 40,
        "tools": [{"type": "function", **WEATHER["function"]}],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "text": {"format": {"type": "json_schema", "name": "City", "schema": schema, "strict": True}}})
    assert r.status_code == 200, r.text
    assert [item["name"] for item in r.json()["output"] if item["type"] == "function_call"] == ["get_weather"]
    r = httpx.post(f"{server.url}{CHAT}", timeout=60, json={
        "messages": QUESTION, "tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False,
        "max_tokens": 40,
        "response_format": {"type": "json_schema", "json_schema": {"name": "City", "schema": schema}}})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "tool_calls", r.text


def test_every_request_has_its_log_line_4xx_included(server: ServerProcess) -> None:
    refused = [
        (CHAT, {"model": "no-such-model", "messages": QUESTION}, 404),
        (CHAT, {"messages": QUESTION, "tools": [WEATHER], "tool_choice": {"type": "function",
                                                                          "function": {"name": "nope"}}}, 400),
        (CHAT, {"messages": []}, 400),
        ("/v1/responses", {"input": [{"type": "web_search_call", "id": "x"}]}, 400),
    ]
    ids = []
    for path, body, status in refused:
        r = httpx.post(f"{server.url}{path}", json=body, timeout=30)
        assert r.status_code == status, r.text
        ids.append((r.headers["x-request-id"], status, r.json()["error"]["message"]))
    time.sleep(0.2)
    lines = [json.loads(line) for line in server.log().splitlines() if line.startswith("{")]
    logged = {line.get("id"): line for line in lines if line.get("logger") == "ferrum.request"}
    for request_id, status, message in ids:
        line = logged[request_id]
        assert line["status"] == status and line["outcome"] == "error" and line["error"] == message[:500]


@pytest.fixture(scope="module")
def strict_template_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The demo model with a template that takes only user and assistant turns (as Llama 2's and older
    Mistral templates)."""
    folder: Path = _model_with_template(tmp_path_factory.mktemp("strict"), "roles_only")
    with server_process("--model", str(folder), "--backend", "cpu", "--tool-call-parser", "hermes") as s:
        yield s.url


def test_a_template_that_cannot_render_tool_turns_is_a_clear_400(strict_template_server: str) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    r = httpx.post(f"{strict_template_server}{CHAT}", json={"messages": messages, "max_tokens": 4}, timeout=30)
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "messages" and "cannot render this conversation's tool calls or tool results" in \
        error["message"] and "roles must be user or assistant" in error["message"]
    ok = httpx.post(f"{strict_template_server}{CHAT}", json={"messages": QUESTION, "max_tokens": 4}, timeout=30)
    assert ok.status_code == 200
