"""`ferrum serve --speculative-config ...` (the engine in its own process, the server's defaults otherwise) on
the demo model through the official `openai` client: a streamed answer that copies its prompt, speculated
(the spec-decode counters in /metrics move), the same text as a non-streamed request, and a bad config
refused at start-up with the setting named."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.live_server import MODEL_DIR, live_server

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
PASSAGE = ("The river runs past the old mill, under the stone bridge and through the quiet village, where the "
           "baker opens his shop at six and the church bell rings twice every morning.")


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip(f"demo model not prepared at {MODEL_DIR}")
    with live_server("--model", str(MODEL_DIR), "--backend", "cpu", "--served-model-name", MODEL,
                     "--max-model-len", "1024", "--speculative-config", NGRAM) as url:
        yield url


def _accepted(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    found = re.search(r"^ferrum_spec_decode_num_accepted_tokens_total(?:\{[^}]*\})? (\S+)$", text, re.M)
    assert found, "no spec-decode counter in /metrics"
    return float(found.group(1))


def test_a_copying_answer_is_speculated_streamed_or_not(base_url: str) -> None:
    client = openai.OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    messages: Any = [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{PASSAGE}"}]
    before = _accepted(base_url)
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0)
    text = reply.choices[0].message.content or ""
    assert _accepted(base_url) - before >= 20
    stream = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0, stream=True)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == text and "old mill" in text


def test_a_bad_speculative_config_stops_start_up_naming_it() -> None:
    done = subprocess.run([sys.executable, "-m", "ferrum.cli", "serve", "--model", str(MODEL_DIR), "--backend", "cpu",
                           "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 40}'],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "num_speculative_tokens must be at most 16" in done.stderr
