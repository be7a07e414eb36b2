"""--reasoning-parser: a reasoning model's thinking comes back as `reasoning_content`, apart from the answer,
whole and streamed (the pieces of a stream add up to the whole). The demo model does not think, so the live
tests make it write a thinking part through a regex (structured outputs)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from ferrum.server.reasoning import FORMATS, ReasoningStream, split_reasoning
from tests.live_server import MODEL_DIR, live_server

CASES = [
    ("qwen3", "<think>\nhmm, Paris.\n</think>\n\nThe capital is Paris.", ("\nhmm, Paris.\n", "The capital is Paris.")),
    ("qwen3", "Just an answer.", (None, "Just an answer.")),
    ("qwen3", "<think>unfinished", ("unfinished", "")),
    ("deepseek_r1", "thinking here</think>\n\nAnswer.", ("thinking here", "Answer.")),
    ("deepseek_r1", "<think>x</think>y", ("x", "y")),
    ("deepseek_r1", "never closed", ("never closed", "")),
]


@pytest.mark.parametrize(("name", "text", "expected"), CASES)
def test_thinking_is_split_whole_and_in_any_pieces(name: str, text: str, expected: tuple) -> None:
    fmt = FORMATS[name]
    assert split_reasoning(fmt, text) == expected
    for seed in range(30):
        rng = random.Random(seed)
        stream, thought, answer, i = ReasoningStream(fmt), "", "", 0
        while i < len(text):
            n = rng.randint(1, 5)
            r, a = stream.feed(text[i:i + n])
            thought, answer, i = thought + r, answer + a, i + n
        r, a = stream.finish()
        assert ((thought + r) if stream.thought else None, answer + a) == expected


MODEL = "SmolLM2-135M-Instruct"
FORCED = {  # what the model is made to write, per parser
    "qwen3": r"<think>[a-z ,]{5,40}</think>\n\nParis is the capital\.",
    "deepseek_r1": r"[a-z ,]{5,40}</think>Paris\.",
}


@pytest.fixture(scope="module", params=list(FORCED))
def server(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip(f"demo model not prepared at {MODEL_DIR}")
    with live_server("--model", str(MODEL_DIR), "--backend", "cpu", "--dtype", "float32", "--served-model-name",
                     MODEL, "--reasoning-parser", request.param) as url:
        yield request.param, url


@pytest.mark.slow
def test_reasoning_content_apart_from_the_answer(server: tuple[str, str]) -> None:
    name, url = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    args: dict[str, Any] = dict(
        model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}], max_tokens=60,
        temperature=0, extra_body={"structured_outputs": {"regex": FORCED[name]}})
    message = client.chat.completions.create(**args).choices[0].message
    thought = message.model_extra["reasoning_content"]
    assert thought and "<think>" not in thought and "</think>" not in thought
    assert message.content == ("Paris is the capital." if name == "qwen3" else "Paris.")
    streamed_thought = streamed_answer = ""
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            streamed_thought += (c.delta.model_extra or {}).get("reasoning_content") or ""
            streamed_answer += c.delta.content or ""
    assert (streamed_thought, streamed_answer) == (thought, message.content)
    plain = client.chat.completions.create(**{**args, "extra_body": {"structured_outputs": {"regex": "Paris\\."}}})
    if name == "qwen3":  # no <think>: all answer
        assert plain.choices[0].message.content == "Paris."
        assert plain.choices[0].message.model_extra.get("reasoning_content") is None
    else:  # deepseek_r1 starts inside the thinking part: never closed, all thinking
        assert plain.choices[0].message.model_extra.get("reasoning_content") == "Paris."
