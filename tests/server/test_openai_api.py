"""The OpenAI-compatible API end to end: a real `ferrum serve` subprocess on the demo model, driven by
the official `openai` client (and raw httpx where the wire format itself is under test)."""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from tests.live_server import MODEL_DIR, live_server

pytestmark = pytest.mark.slow

CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip(
            f"demo model not prepared at {MODEL_DIR} (run `make serve` or scripts/prepare_demo_model.py)"
        )
    # float32, and a float32 KV cache: several tests compare batched outputs with one-at-a-time outputs token
    # for token, which only float32 throughout guarantees on CPU (bf16 matmul results depend on the batch's
    # shape; a prompt that hits the prefix cache reads its prefix's keys as the cache holds them, rounded or
    # quantized, where the same prompt prefilled alone reads its own as computed: an int8 cache, which
    # quantization auto takes for float32 on AVX2, turned one of these answers). The default path is served
    # in tests/server/test_startup.py.
    with live_server("--model", str(MODEL_DIR), "--backend", "cpu", "--dtype", "float32",
                     "--kv-cache-dtype", "float32") as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def max_model_len(base_url: str) -> int:
    return int(httpx.get(f"{base_url}/v1/models").json()["data"][0]["max_model_len"])


def _error(response: httpx.Response) -> dict[str, Any]:
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert "\n" not in error["message"]
    return error


# -- the small routes -----------------------------------------------------------------------------------


def test_health_and_ready(base_url: str) -> None:
    r = httpx.get(f"{base_url}/health")
    assert r.status_code == 200 and r.json() == {"status": "ok", "phase": "ready"}
    r = httpx.get(f"{base_url}/ready")
    assert r.status_code == 200 and r.json()["status"] == "ready"


def test_models(client: openai.OpenAI, model: str, max_model_len: int) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [model]
    assert models[0].object == "model"
    assert max_model_len > 0
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_request_id_is_honoured(base_url: str, model: str) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2}
    r = httpx.post(
        f"{base_url}/v1/completions", json=body, headers={"X-Request-Id": "test-id-123"}, timeout=60
    )
    assert r.status_code == 200
    assert r.headers["x-request-id"] == "test-id-123"
    assert r.json()["id"] == "cmpl-test-id-123"
    r = httpx.post(f"{base_url}/v1/completions", json=body, timeout=60)
    assert re.fullmatch(r"[0-9a-f]{32}", r.headers["x-request-id"])


# -- completions and chat ------------------------------------------------------------------------------------


def test_completion(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    assert out.id.startswith("cmpl-") and out.object == "text_completion" and out.model == model
    assert len(out.choices) == 1
    choice = out.choices[0]
    assert choice.index == 0 and choice.text and choice.finish_reason in ("stop", "length")
    assert "Paris" in choice.text
    assert out.usage is not None
    assert out.usage.prompt_tokens > 0 and 0 < out.usage.completion_tokens <= 8
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_completion_echo_and_token_prompts(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert out.choices[0].text.startswith(PROMPT)
    plain = client.completions.create(model=model, prompt=PROMPT, max_tokens=4, temperature=0)
    assert out.choices[0].text == PROMPT + plain.choices[0].text
    # A prompt of token ids gives what its text gives; echo returns the ids' text.
    from ferrum.tokenizer import Tokenizer

    ids = Tokenizer.from_folder(MODEL_DIR).encode(PROMPT)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0, echo=True)
    assert by_ids.choices[0].text == out.choices[0].text
    # A list of prompts gives prompt-major choices.
    by_text = client.completions.create(
        model=model, prompt=[PROMPT, "1, 2, 3,"], max_tokens=4, temperature=0, n=2
    )
    assert [c.index for c in by_text.choices] == [0, 1, 2, 3]
    assert by_text.choices[0].text == by_text.choices[1].text == plain.choices[0].text
    assert by_text.choices[2].text == by_text.choices[3].text != plain.choices[0].text


def test_chat_paris(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(model=model, messages=CHAT, max_tokens=32, temperature=0)
    assert out.id.startswith("chatcmpl-") and out.object == "chat.completion"
    message = out.choices[0].message
    assert message.role == "assistant"
    assert message.content is not None and "Paris" in message.content
    assert out.choices[0].finish_reason in ("stop", "length")
    assert (
        out.usage is not None
        and out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens
    )


def test_chat_content_parts_and_missing_model(base_url: str) -> None:
    body = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}],
        "max_tokens": 32,
        "temperature": 0,
    }
    r = httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60)  # no "model": the served one
    assert r.status_code == 200, r.text
    assert "Paris" in r.json()["choices"][0]["message"]["content"]


def test_streaming_chat_matches_non_streaming(client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = {"model": model, "messages": CHAT, "max_tokens": 24, "temperature": 0}
    full = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].choices[0].delta.content == ""
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert reasons == [full.choices[0].finish_reason]
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.prompt_tokens == full.usage.prompt_tokens


def test_streaming_completion_matches_non_streaming(client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = {"model": model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    full = client.completions.create(**kwargs)
    chunks = list(client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.total_tokens == full.usage.total_tokens
    no_usage = list(client.completions.create(**kwargs, stream=True))
    assert all(c.usage is None for c in no_usage)


def test_raw_sse_format(base_url: str, model: str) -> None:
    body = {"model": model, "messages": CHAT, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert all(e.startswith("data: ") for e in events[:-1])
    assert payloads[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(p["object"] == "chat.completion.chunk" for p in payloads)
    assert payloads[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert payloads[-1]["choices"][0]["delta"] == {}


def test_completion_logprobs(client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert lp is not None and out.usage is not None
    n = out.usage.completion_tokens
    assert lp.tokens is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert all(isinstance(x, float) and x <= 0 for x in lp.token_logprobs)
    assert all(3 <= len(top) <= 4 for top in lp.top_logprobs)
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[token] == pytest.approx(logprob)
        assert logprob == pytest.approx(max(top.values()))  # greedy: the chosen token is the likeliest
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert "".join(lp.tokens) == out.choices[0].text


def test_chat_logprobs(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(
        model=model,
        messages=CHAT,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == out.usage.completion_tokens  # type: ignore[union-attr]
    for item in content:
        assert isinstance(item.token, str) and item.logprob <= 0
        assert item.bytes == list(item.token.encode("utf-8"))
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
    assert "".join(item.token for item in content).startswith(out.choices[0].message.content or "\0")
    plain = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=6, temperature=0, logprobs=True
    )
    assert all(item.top_logprobs == [] for item in plain.choices[0].logprobs.content)  # type: ignore[union-attr]


def test_seed_reproducible(client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = {
        "model": model,
        "prompt": "Once upon a time",
        "max_tokens": 16,
        "temperature": 1.0,
    }
    a = client.completions.create(**kwargs, seed=1234).choices[0].text
    b = client.completions.create(**kwargs, seed=1234).choices[0].text
    assert a == b
    # n > 1 with a seed: choice i is sampled with seed + i.
    fan = client.completions.create(**kwargs, seed=1234, n=2)
    assert fan.choices[0].text == a
    assert fan.choices[1].text == client.completions.create(**kwargs, seed=1235).choices[0].text


def test_n_choices(client: openai.OpenAI, model: str) -> None:
    out = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert len({c.message.content for c in out.choices}) == 1  # greedy: all the same
    single = client.chat.completions.create(model=model, messages=CHAT, max_tokens=8, temperature=0)
    assert out.choices[0].message.content == single.choices[0].message.content
    assert out.usage is not None and single.usage is not None
    assert out.usage.prompt_tokens == single.usage.prompt_tokens  # the prompt counts once
    assert out.usage.completion_tokens == 3 * single.usage.completion_tokens


def test_stop_strings(client: openai.OpenAI, model: str) -> None:
    kwargs: dict[str, Any] = {"model": model, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    text = client.completions.create(**kwargs).choices[0].text
    words = text.split()
    assert len(words) >= 3, text
    stop = words[2]
    cut = text.index(stop)
    out = client.completions.create(**kwargs, stop=[stop, "\u2603never"]).choices[0]
    assert out.text == text[:cut] and out.finish_reason == "stop"
    kept = client.completions.create(**kwargs, stop=stop, extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == text[: cut + len(stop)]
    streamed = client.completions.create(**kwargs, stop=[stop], stream=True)
    assert "".join(c.choices[0].text for c in streamed if c.choices) == text[:cut]


def test_max_tokens_may_be_omitted(client: openai.OpenAI, model: str) -> None:
    # Without max_tokens the limit is the rest of the context; the stop string ends this one early.
    out = client.completions.create(model=model, prompt=PROMPT, temperature=0, stop=["\n"])
    assert out.choices[0].finish_reason == "stop" and "Paris" in out.choices[0].text


# -- errors ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("endpoint", "extra", "param"),
    [
        ("chat", {"temperature": -1}, "temperature"),
        ("chat", {"temperature": 3}, "temperature"),
        ("chat", {"top_p": 0}, "top_p"),
        ("chat", {"top_p": 1.5}, "top_p"),
        ("chat", {"presence_penalty": 5}, "presence_penalty"),
        ("chat", {"frequency_penalty": -3}, "frequency_penalty"),
        ("chat", {"n": 0}, "n"),
        ("chat", {"max_tokens": 0}, "max_tokens"),
        ("chat", {"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ("chat", {"response_format": {"type": "xml"}}, "response_format.type"),
        ("chat", {"logit_bias": {"5": 101}}, "logit_bias"),
        ("completions", {"logprobs": 50}, "logprobs"),
        ("completions", {"best_of": 3}, "best_of"),
        ("completions", {"suffix": "and so on"}, "suffix"),
        ("completions", {"top_k": -2}, "top_k"),
        ("completions", {"min_p": 2}, "min_p"),
        ("completions", {"repetition_penalty": 0}, "repetition_penalty"),
    ],
)
def test_bad_parameters_are_400(
    client: openai.OpenAI, model: str, endpoint: str, extra: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        if endpoint == "chat":
            client.chat.completions.create(model=model, messages=CHAT, max_tokens=4, extra_body=extra)
        else:
            client.completions.create(model=model, prompt=PROMPT, max_tokens=4, extra_body=extra)
    error = _error(info.value.response)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_invalid_json_is_400(base_url: str) -> None:
    for path in ("/v1/chat/completions", "/v1/completions"):
        r = httpx.post(
            f"{base_url}{path}", content=b'{"messages": [', headers={"content-type": "application/json"}
        )
        assert r.status_code == 400
        assert "not valid JSON" in _error(r)["message"]


def test_context_length_exceeded(
    client: openai.OpenAI, model: str, base_url: str, max_model_len: int
) -> None:
    prompt_tokens = client.chat.completions.create(
        model=model, messages=CHAT, max_tokens=1
    ).usage.prompt_tokens  # type: ignore[union-attr]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=model, messages=CHAT, max_tokens=max_model_len)
    error = _error(info.value.response)
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    message = error["message"]
    assert str(max_model_len) in message
    assert str(prompt_tokens + max_model_len) in message and str(prompt_tokens) in message
    # The prompt alone is too long.
    r = httpx.post(
        f"{base_url}/v1/completions", json={"model": model, "prompt": [1] * max_model_len}, timeout=60
    )
    assert r.status_code == 400
    error = _error(r)
    assert error["param"] == "prompt" and error["code"] == "context_length_exceeded"
    assert str(max_model_len) in error["message"]


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=CHAT, max_tokens=2)
    error = _error(info.value.response)
    assert error["code"] == "model_not_found" and "no-such-model" in error["message"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)


def test_unknown_route_and_wrong_method(base_url: str) -> None:
    r = httpx.post(f"{base_url}/v1/nothing-here", json={})
    assert r.status_code == 404 and _error(r)
    r = httpx.get(f"{base_url}/v1/chat/completions")
    assert r.status_code == 405 and _error(r)


_MSG = [{"role": "user", "content": "hi"}]
_MALFORMED_CHAT: list[Any] = [
    {},
    {"messages": None},
    {"messages": []},
    {"messages": "hi"},
    {"messages": [1, 2]},
    {"messages": [{}]},
    {"messages": [[[[]]]]},
    {"messages": [{"role": "user"}]},
    {"messages": [{"role": "wizard", "content": "x"}]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": {"nested": {"garbage": [1, {"a": None}]}}}]},
    {
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}
        ]
    },
    {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": ["a"]}]}]},
    {"messages": [{"role": "user", "content": ["just a string"]}]},
    {"messages": [{"role": "assistant", "content": None}]},
    {"messages": [{"role": "user", "content": "x", "tool_calls": "nope"}]},
    {"messages": _MSG, "model": 123},
    {"messages": _MSG, "model": "no-such-model"},
    {"messages": _MSG, "temperature": "hot"},
    {"messages": _MSG, "temperature": [0.5]},
    {"messages": _MSG, "temperature": None, "top_p": {"a": 1}},
    {"messages": _MSG, "max_tokens": -5},
    {"messages": _MSG, "max_tokens": 1.5},
    {"messages": _MSG, "max_tokens": 10**30},
    {"messages": _MSG, "max_completion_tokens": 0},
    {"messages": _MSG, "n": "many"},
    {"messages": _MSG, "n": 100000},
    {"messages": _MSG, "stop": [1, 2]},
    {"messages": _MSG, "stop": {"a": "b"}},
    {"messages": _MSG, "stop": [""]},
    {"messages": _MSG, "stop": ["s"] * 100},
    {"messages": _MSG, "stop_token_ids": [-1]},
    {"messages": _MSG, "stop_token_ids": "eos"},
    {"messages": _MSG, "seed": 2**70},
    {"messages": _MSG, "seed": "lucky"},
    {"messages": _MSG, "seed": 2**64 - 1, "n": 2},
    {"messages": _MSG, "stream": True, "stream_options": "yes"},
    {"messages": _MSG, "stream_options": {"include_usage": True}},
    {"messages": _MSG, "response_format": "text"},
    {"messages": _MSG, "response_format": {"type": "json_schema", "json_schema": {}}},
    {"messages": _MSG, "tools": "nope"},
    {"messages": _MSG, "tool_choice": "required"},
    {"messages": _MSG, "logit_bias": {"5": "much"}},
    {"messages": _MSG, "logit_bias": {"five": 1}},
    {"messages": _MSG, "structured_outputs": {"regex": "("}},
    {"messages": _MSG, "guided_choice": []},
    {"messages": _MSG, "logit_bias": "x"},
    {"messages": _MSG, "logprobs": "yes please"},
    {"messages": _MSG, "top_logprobs": 2},
    {"messages": _MSG, "top_k": -5},
    {"messages": _MSG, "best_of": 4},
    {"messages": _MSG, "chat_template_kwargs": [1]},
    {"messages": _MSG, "chat_template_kwargs": {"messages": []}},
    {
        "messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "y"}],
        "ignore_eos": {"a": 1},
    },
]
_MALFORMED_COMPLETIONS: list[Any] = [
    {},
    {"prompt": None},
    {"prompt": ""},
    {"prompt": []},
    {"prompt": [[]]},
    {"prompt": [1, "a"]},
    {"prompt": [-1]},
    {"prompt": [10**9]},
    {"prompt": [[1, 2], [3, "x"]]},
    {"prompt": [[[1]]]},
    {"prompt": True},
    {"prompt": 5},
    {"prompt": {"a": {"b": [None]}}},
    {"prompt": "x", "suffix": "y"},
    {"prompt": "x", "echo": True, "logprobs": 21},
    {"prompt": "x", "prompt_logprobs": -1},
    {"prompt": "x", "max_tokens": 0},
    {"prompt": "x", "logprobs": -1},
    {"prompt": "x", "logprobs": "all"},
    {"prompt": "x", "best_of": 2},
    {"prompt": "x", "n": 0},
    {"prompt": "x", "max_tokens": "ten"},
    {"prompt": "x", "echo": "loud"},
]
_MALFORMED_RAW: list[bytes] = [
    b"",
    b"null",
    b"[]",
    b'"a string"',
    b"123",
    b"{",
    b'{"messages": NaN}',
    b'{"messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}',
    b"\xff\xfe\x00garbage",
    b"[" * 100_000,
]


def _assert_clean_client_error(r: httpx.Response) -> None:
    assert r.status_code in (400, 404), (r.status_code, r.text)
    _error(r)


@pytest.mark.parametrize("body", _MALFORMED_CHAT, ids=[f"chat{i}" for i in range(len(_MALFORMED_CHAT))])
def test_malformed_chat_bodies(base_url: str, body: Any) -> None:
    _assert_clean_client_error(httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=30))


@pytest.mark.parametrize(
    "body", _MALFORMED_COMPLETIONS, ids=[f"cmpl{i}" for i in range(len(_MALFORMED_COMPLETIONS))]
)
def test_malformed_completion_bodies(base_url: str, body: Any) -> None:
    _assert_clean_client_error(httpx.post(f"{base_url}/v1/completions", json=body, timeout=30))


@pytest.mark.parametrize("raw", _MALFORMED_RAW, ids=[f"raw{i}" for i in range(len(_MALFORMED_RAW))])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_malformed_raw_bodies(base_url: str, path: str, raw: bytes) -> None:
    r = httpx.post(f"{base_url}{path}", content=raw, headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    _error(r)


# -- concurrency and disconnects ---------------------------------------------------------------------------


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


async def test_concurrent_streams_and_disconnects(client: openai.OpenAI, model: str, base_url: str) -> None:
    # 32 streams over 8 distinct prompts (prompts of different lengths in one batch); the sequential
    # reference is computed once per distinct prompt to keep the test short on a small CPU.
    distinct = [f"Write a short sentence about the number {i}." + " Please." * i for i in range(8)]
    reference = {
        p: client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": p}], max_tokens=16, temperature=0
        )
        .choices[0]
        .message.content
        for p in distinct
    }
    prompts = distinct * 4
    expected = [reference[p] for p in prompts]

    aclient = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=300)

    async def stream_one(prompt: str) -> str:
        stream = await aclient.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=16,
            temperature=0,
            stream=True,
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    got = await asyncio.gather(*(stream_one(p) for p in prompts))
    await aclient.close()
    assert got == expected

    # Clients that go away mid-request: their engine requests must be aborted and their KV blocks freed.
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:

        async def disconnect_streaming(i: int) -> None:
            body = {
                "model": model,
                "prompt": f"Tell me a very long story number {i}.",
                "max_tokens": 1000,
                "stream": True,
                "ignore_eos": True,
            }
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                seen = 0
                async for line in r.aiter_lines():
                    seen += line.startswith("data: ")
                    if seen >= 3:
                        break

        async def disconnect_waiting(i: int) -> None:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": f"Story {i}"}],
                "max_tokens": 1000,
                "ignore_eos": True,
            }
            with pytest.raises(httpx.TimeoutException):
                await http.post("/v1/chat/completions", json=body, timeout=1.5)

        await asyncio.gather(
            *(disconnect_streaming(i) for i in range(10)), *(disconnect_waiting(i) for i in range(3))
        )

        deadline = time.monotonic() + 60
        while True:
            text = (await http.get("/metrics")).text
            used = _metric(text, "ferrum_kv_blocks_used")
            running = _metric(text, "ferrum_num_requests_running")
            waiting = _metric(text, "ferrum_num_requests_waiting")
            if (used, running, waiting) == (0, 0, 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.25)
        assert (used, running, waiting) == (0, 0, 0)
        assert _metric(text, "ferrum_kv_blocks_total") > 0
