"""The served model's quantization on GET /v1/models and the methods each backend runs on
GET /v1/backends: from the app with a stand-in engine (no model loaded), and from `ferrum serve
--quantization int8` on a tiny model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from ferrum.backends.cpu import CPUBackend
from ferrum.engine.llm_engine import EngineStats
from ferrum.models.loader import WeightLoadReport
from ferrum.server.api import backend_card, create_app
from ferrum.weights.quantization.scheme import QuantizationConfig
from tests.live_server import server_process
from tests.tiny_model import make_tiny_llama


class ReadyEngine:
    """What the model routes ask of an engine."""

    max_model_len = 64
    weight_load: WeightLoadReport | None = None
    kv_cache_dtype = "bfloat16"

    def is_ready(self) -> bool:
        return True

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0, 8, 0, 0, 0, 0, kv_cache_dtype=self.kv_cache_dtype)


async def _get(quantization: QuantizationConfig | None, path: str, engine: ReadyEngine | None = None) -> Any:
    app = create_app(engine or ReadyEngine(), "tiny", quantization=quantization,  # type: ignore[arg-type]
                     backends=lambda: [backend_card(CPUBackend(), True)])
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
        response = await client.get(path)
    assert response.status_code == 200, response.text
    return response.json()


async def test_models_show_the_served_quantization() -> None:
    assert (await _get(None, "/v1/models"))["data"][0]["quantization"] is None
    int4 = (await _get(QuantizationConfig("int4"), "/v1/models"))["data"][0]["quantization"]
    assert int4 == {"method": "int4", "group_size": 128, "symmetric": False, "skip": ["lm_head"], "checkpoint": None,
                    "chosen": None}
    int8 = (await _get(QuantizationConfig("int8", skip=()), "/v1/models/tiny"))["quantization"]
    assert int8 == {"method": "int8", "group_size": None, "symmetric": True, "skip": [], "checkpoint": None,
                    "chosen": None}


async def test_models_show_a_published_checkpoints_format() -> None:
    """A checkpoint stored quantized: its format as loaded, with or without --quantization naming it."""
    engine = ReadyEngine()
    engine.weight_load = WeightLoadReport("file", 1, 0.1, quantization="gptq (4-bit, group 128, symmetric, gptq)",
                                          published="gptq")
    for flag in (None, QuantizationConfig("gptq")):
        card = (await _get(flag, "/v1/models/tiny", engine))["quantization"]
        assert card == {"method": "gptq", "group_size": None, "symmetric": None, "skip": [],
                        "checkpoint": "gptq (4-bit, group 128, symmetric, gptq)", "chosen": None}


async def test_models_show_what_quantization_auto_picked() -> None:
    engine = ReadyEngine()
    engine.weight_load = WeightLoadReport("file", 1, 0.1, quantization="int4 (group 32, asymmetric)",
                                          chosen="quantization auto on cpu: ...",
                                          on_load=QuantizationConfig("int4", group_size=32))
    engine.kv_cache_dtype = "int8"
    model = await _get(QuantizationConfig("auto"), "/v1/models/tiny", engine)
    card = model["quantization"]
    assert model["kv_cache_dtype"] == "int8"
    assert card == {"method": "int4", "group_size": 32, "symmetric": False, "skip": ["lm_head"], "checkpoint": None,
                    "chosen": "quantization auto on cpu: ..."}


async def test_backends_show_the_methods_they_run() -> None:
    card = (await _get(None, "/v1/backends"))["data"][0]
    assert card["name"] == "cpu" and card["capabilities"]["quantization"] == ["fp8", "int4", "int8"]
    assert card["capabilities"]["quantization_needs"] == {}


@pytest.mark.slow
def test_a_server_quantized_on_load_says_so(tmp_path: Path) -> None:
    tiny = make_tiny_llama(tmp_path / "tiny")
    with server_process("--model", str(tiny), "--backend", "cpu", "--dtype", "float32", "--max-model-len", "64",
                        "--kv-cache-memory-gb", "0.01", "--quantization", "int8",
                        env={"OMP_NUM_THREADS": "1"}) as server:
        card = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"][0]
        assert card["quantization"] == {"method": "int8", "group_size": None, "symmetric": True, "skip": ["lm_head"],
                                         "checkpoint": None, "chosen": None}
        body = {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 3, response.text
