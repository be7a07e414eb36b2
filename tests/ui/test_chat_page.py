"""The chat page at `/`, in a real browser: Debian's Chromium, headless, driven by Playwright against
`ferrum serve` on the demo model. A question streams an answer, a long answer stops mid-stream (and the
server runs nothing after), regenerate, the sampling settings reach the request, an over-long prompt's error
shows on the page, the conversation survives a reload, and a keyed server's page asks for the key."""

from __future__ import annotations

import json
import re
import shutil
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.deploy.tools import tool
from tests.live_server import MODEL_DIR, live_server

pytestmark = pytest.mark.slow
CHROMIUM_ARGS = ["--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]


def _chromium() -> str:
    path = shutil.which("chromium") or tool("chromium")
    return path


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip(f"demo model not prepared at {MODEL_DIR}")
    with live_server("--model", str(MODEL_DIR), "--backend", "cpu", "--max-model-len", "1024") as url:
        yield url


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    executable = _chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=executable, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any, server: str) -> Iterator[Any]:
    context = browser.new_context()
    page = context.new_page()
    page.goto(server + "/")
    page.wait_for_function("document.querySelectorAll('#model option').length > 0")
    yield page
    context.close()


def _ask(page: Any, text: str) -> None:
    page.fill("#prompt", text)
    page.click("#send")


def _last_answer(page: Any) -> Any:
    return page.locator(".message.assistant .content").last


def _wait_idle(page: Any, timeout_ms: int = 120_000) -> None:
    """Until the answer asked for last has ended (the page sets data-busy while a request runs)."""
    page.wait_for_selector('body[data-busy="0"]', state="attached", timeout=timeout_ms)


def _running(server: str) -> float:
    metrics = httpx.get(f"{server}/metrics", timeout=10).text
    found = re.search(r"^ferrum_num_requests_running(?:\{[^}]*\})? (\S+)$", metrics, re.M)
    assert found is not None
    return float(found.group(1))


def test_question_streams_an_answer_with_its_speed(page: Any) -> None:
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "40")
    _ask(page, "What is the capital of France?")
    _wait_idle(page)
    assert "Paris" in _last_answer(page).inner_text()
    stats = page.locator(".message.assistant .stats").last.inner_text()
    assert re.search(r"\d+ tokens · [\d.]+ tok/s · TTFT \d+ ms", stats), stats


def test_stop_mid_stream_and_regenerate(page: Any, server: str) -> None:
    page.fill("#temperature", "0")
    page.fill("#max_tokens", "400")
    _ask(page, "Write a very long story about a dragon who learns to cook.")
    page.wait_for_function("document.querySelector('.message.assistant:last-child .content')?.innerText.length > 20")
    page.click("#stop-button")
    _wait_idle(page, 10_000)
    assert "stopped" in page.locator(".message.assistant .stats").last.inner_text()
    deadline = time.monotonic() + 10
    while _running(server) != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _running(server) == 0  # the server ended the request when the page stopped reading
    page.fill("#max_tokens", "12")
    bodies: list[dict] = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data)) if r.url.endswith("/v1/chat/completions")
            else None)
    page.click("#regenerate")
    _wait_idle(page)
    assert len(bodies) == 1 and bodies[0]["max_tokens"] == 12
    assert bodies[0]["messages"][-1]["role"] == "user"  # the stopped answer was replaced, not continued
    assert page.locator(".message.assistant").count() == 1


def test_settings_reach_the_request(page: Any) -> None:
    bodies: list[dict] = []
    page.on("request", lambda r: bodies.append(json.loads(r.post_data)) if r.url.endswith("/v1/chat/completions")
            else None)
    page.fill("#temperature", "1.3")
    page.fill("#top_k", "7")
    page.fill("#seed", "42")
    page.fill("#max_tokens", "5")
    page.fill("#system", "Answer in French.")
    _ask(page, "Hello")
    _wait_idle(page)
    body = bodies[-1]
    assert (body["temperature"], body["top_k"], body["seed"], body["max_tokens"]) == (1.3, 7, 42, 5)
    assert body["messages"][0] == {"role": "system", "content": "Answer in French."} and body["stream"] is True


def test_json_schema_mode(page: Any) -> None:
    page.fill("#max_tokens", "40")
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    page.fill("#temperature", "0")
    page.check("#json-mode")
    page.fill("#json-schema", json.dumps(schema))
    _ask(page, "Name the capital of France as JSON.")
    _wait_idle(page)
    assert json.loads(_last_answer(page).inner_text())["city"]


def test_an_over_long_prompt_shows_the_servers_error(page: Any) -> None:
    page.fill("#max_tokens", "16")
    _ask(page, "word " * 1500)  # over the server's 1024-token context
    page.wait_for_selector("#error:not([hidden])", timeout=30_000)
    text = page.inner_text("#error")
    assert text.startswith("400") and "maximum context length is 1024 tokens" in text


def test_conversation_survives_a_reload(page: Any) -> None:
    page.fill("#max_tokens", "8")
    _ask(page, "Remember the word ferrum.")
    _wait_idle(page)
    before = page.locator(".message").count()
    page.reload()
    page.wait_for_selector(".message.user")
    assert page.locator(".message").count() == before
    assert "Remember the word ferrum." in page.locator(".message.user").last.inner_text()


def test_keyed_server_asks_for_the_key_and_markdown_is_sanitised(browser: Any) -> None:
    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip(f"demo model not prepared at {MODEL_DIR}")
    with live_server("--model", str(MODEL_DIR), "--backend", "cpu", "--api-key", "sesame") as url:
        assert httpx.get(url + "/").status_code == 200 and httpx.get(url + "/ui/app.js").status_code == 200
        assert httpx.get(url + "/v1/models").status_code == 401
        context = browser.new_context()
        page = context.new_page()
        asked: list[str] = []

        def answer(dialog: Any) -> None:
            asked.append(dialog.message)
            dialog.accept("sesame")

        page.on("dialog", answer)
        page.goto(url + "/")
        page.wait_for_function("document.querySelectorAll('#model option').length > 0")
        assert asked and "API key" in asked[0]
        assert page.evaluate("sessionStorage.getItem('ferrum.apiKey')") == "sesame"
        assert page.evaluate("localStorage.getItem('ferrum.apiKey')") is None
        html = page.evaluate("renderMarkdown('**bold** <img src=x onerror=alert(1)><script>alert(2)</script>')")
        assert "<strong>bold</strong>" in html and "onerror" not in html and "<script" not in html
        context.close()


def test_no_ui_turns_the_page_off() -> None:
    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip(f"demo model not prepared at {MODEL_DIR}")
    with live_server("--model", str(MODEL_DIR), "--backend", "cpu", "--no-ui") as url:
        assert httpx.get(url + "/").status_code == 404
        assert httpx.get(url + "/ui/app.js").status_code == 404
