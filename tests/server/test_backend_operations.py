"""GET /v1/backends counts the serving backend's operations (its engine's steps) as requests run,
with the engine on a thread of the server and in a process of its own (where the engine process's
backend counts them and the server's mirrors the count)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.live_server import server_process
from tests.tiny_model import make_tiny_llama

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("ops") / "tiny")


def _serving(url: str) -> dict[str, Any]:
    cards = httpx.get(f"{url}/v1/backends", timeout=10).json()["data"]
    selected = [card for card in cards if card["selected"]]
    assert len(selected) == 1, cards
    return selected[0]


@pytest.mark.parametrize("engine_process", ["off", "on"])
def test_operations_rise_with_the_engine_steps(tiny: Path, engine_process: str) -> None:
    with server_process("--model", str(tiny), "--backend", "cpu", "--dtype", "float32", "--max-model-len",
                        "64", "--kv-cache-memory-gb", "0.01", "--engine-process", engine_process,
                        env={"OMP_NUM_THREADS": "1"}) as server:
        before = _serving(server.url)
        assert before["name"] == "cpu" and before["status"]["operations_completed"] == 0
        counts = []
        for max_tokens in (3, 5):
            body = {"prompt": [5, 6, 7], "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
            r = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            counts.append(_serving(server.url)["status"]["operations_completed"])
    # one request at a time: its prefill step gives the first token, one decode step each further one;
    # every step is counted before its outputs reach the server
    assert counts == [3, 3 + 5], counts
