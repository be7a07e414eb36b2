"""The client libraries people put in front of an OpenAI-compatible server, against the server a new user
starts: `ferrum serve --config config/default.yaml --tool-call-parser hermes` on the demo model (one server for
the whole package). The demo model is small: where a good answer needs a better model (choosing a tool under
"auto", filling a schema with the right facts), the tests assert a well-formed answer, not a good one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.live_server import MODEL_DIR, ROOT, server_process

MODEL = "SmolLM2-135M-Instruct"
WEATHER_QUESTION = "What is the weather like in Paris today?"


@pytest.fixture(scope="package")
def base_url() -> Iterator[str]:
    """The server's OpenAI base URL (.../v1)."""
    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip(f"demo model not prepared at {MODEL_DIR}")
    with server_process("--config", str(ROOT / "config" / "default.yaml"), "--tool-call-parser", "hermes") as s:
        yield f"{s.url}/v1"


def get_weather(city: str) -> str:
    """The current weather in a city."""
    return f"Sunny and 21 degrees Celsius in {city}."
