"""`ferrum bench`: the workload, the metrics math, and both commands end to end (offline on the demo
model in this process, serve against a real `ferrum serve` subprocess)."""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from ferrum.bench.client import Target, send
from ferrum.bench.metrics import RequestRecord, summarize
from ferrum.bench.workload import BenchRequest, LengthRange, WorkloadSpec, make_workload, prompt_token_pool
from ferrum.cli import main
from ferrum.tokenizer import Tokenizer
from tests.live_server import MODEL_DIR, live_server

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SHORT = ["--num-prompts", "5", "--input-len", "4:24", "--output-len", "2:8", "--seed", "7"]
SHORT_SPEC = WorkloadSpec(5, LengthRange(4, 24), LengthRange(2, 8), seed=7)


def _need_model() -> None:
    if not (MODEL_DIR / "config.json").is_file():
        pytest.skip(f"demo model not prepared at {MODEL_DIR} (run `make serve` or scripts/prepare_demo_model.py)")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    _need_model()
    return Tokenizer.from_folder(MODEL_DIR)


def _run_cli(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    code = exited.value.code
    return code if isinstance(code, int) else 1


# -- workload -----------------------------------------------------------------------------------------


def test_length_range_parses_one_value_or_a_range() -> None:
    assert LengthRange.parse("128") == LengthRange(128, 128)
    assert LengthRange.parse("100:1024") == LengthRange(100, 1024)
    assert str(LengthRange(100, 1024)) == "100:1024"
    for bad in ("", "a:b", "1:2:3", "0:4", "9:3"):
        with pytest.raises(ValueError):
            LengthRange.parse(bad)


@pytest.mark.slow
def test_workload_lengths_cover_the_inclusive_ranges(tokenizer: Tokenizer) -> None:
    spec = WorkloadSpec(300, LengthRange(2, 4), LengthRange(5, 7), seed=3)
    requests = make_workload(spec, prompt_token_pool(tokenizer))
    assert len(requests) == 300
    assert {r.prompt_len for r in requests} == {2, 3, 4}
    assert {r.output_len for r in requests} == {5, 6, 7}


@pytest.mark.slow
def test_workload_is_reproducible_from_its_seed(tokenizer: Tokenizer) -> None:
    pool = prompt_token_pool(tokenizer)
    spec = WorkloadSpec(20, LengthRange(10, 50), LengthRange(1, 9), seed=11)
    assert make_workload(spec, pool) == make_workload(spec, pool)
    other = WorkloadSpec(20, LengthRange(10, 50), LengthRange(1, 9), seed=12)
    assert make_workload(other, pool) != make_workload(spec, pool)


@pytest.mark.slow
def test_rounds_share_lengths_but_not_prompts(tokenizer: Tokenizer) -> None:
    pool = prompt_token_pool(tokenizer)
    first, second = make_workload(SHORT_SPEC, pool, 0), make_workload(SHORT_SPEC, pool, 1)
    assert [(r.prompt_len, r.output_len) for r in first] == [(r.prompt_len, r.output_len) for r in second]
    assert all(a.prompt_token_ids != b.prompt_token_ids for a, b in zip(first, second, strict=True))


@pytest.mark.slow
def test_prompt_ids_are_in_the_vocabulary_and_never_special(tokenizer: Tokenizer) -> None:
    special = set(tokenizer.special_token_ids) | set(tokenizer.eos_token_ids) | {tokenizer.bos_token_id}
    assert special, "the demo tokenizer has special tokens; this test needs some"
    pool = prompt_token_pool(tokenizer)
    assert not special.intersection(pool.tolist())
    assert len(pool) == tokenizer.vocab_size - len(special - {None})
    requests = make_workload(WorkloadSpec(50, LengthRange(200, 400), LengthRange(1, 1), seed=1), pool)
    drawn = {t for r in requests for t in r.prompt_token_ids}
    assert not special.intersection(drawn)
    assert all(0 <= t < tokenizer.vocab_size for t in drawn)


@pytest.mark.slow
def test_prompt_pool_stays_below_a_smaller_model_vocabulary(tokenizer: Tokenizer) -> None:
    pool = prompt_token_pool(tokenizer, vocab_size=1000)
    assert pool.max() < 1000


# -- metrics ------------------------------------------------------------------------------------------


def _record(ttft: float, gaps: tuple[float, ...], tokens: int, prompt: int = 10, error: str | None = None) -> RequestRecord:
    return RequestRecord(prompt, tokens, tokens, ttft, gaps, ttft + sum(gaps), error)


def test_level_figures_from_hand_made_timings() -> None:
    records = [
        _record(0.100, (0.010, 0.030), tokens=3, prompt=10),  # TPOT 20 ms
        _record(0.300, (0.020,), tokens=2, prompt=20),  # TPOT 20 ms
        _record(0.200, (), tokens=1, prompt=30),  # one token: no TPOT, no ITL
        RequestRecord(40, 9, 0, 0.0, (), 0.5, "HTTP 400: too long"),
        RequestRecord(50, 9, 0, 0.0, (), 0.5, "HTTP 500: later"),
    ]
    r = summarize(records, duration_s=2.0, concurrency=4)
    assert (r.num_requests, r.completed, r.failed, r.first_error) == (5, 3, 2, "HTTP 400: too long")
    assert (r.total_input_tokens, r.total_output_tokens, r.requested_output_tokens) == (60, 6, 6)
    assert r.request_throughput == pytest.approx(1.5)
    assert r.output_throughput == pytest.approx(3.0)
    assert r.total_token_throughput == pytest.approx(33.0)
    assert math.isinf(r.request_rate)
    assert (r.ttft.mean_ms, r.ttft.median_ms) == (pytest.approx(200.0), pytest.approx(200.0))
    assert r.ttft.p99_ms == pytest.approx(200.0 + 0.98 * 100.0)  # linear between 200 and 300
    assert (r.tpot.count, r.tpot.mean_ms, r.tpot.median_ms) == (2, pytest.approx(20.0), pytest.approx(20.0))
    assert r.itl.count == 3  # pooled over requests
    assert (r.itl.mean_ms, r.itl.median_ms) == (pytest.approx(20.0), pytest.approx(20.0))
    assert r.itl.p99_ms == pytest.approx(20.0 + 0.98 * 10.0)
    assert r.e2el.mean_ms == pytest.approx((140.0 + 320.0 + 200.0) / 3)


def test_tpot_needs_two_tokens_and_empty_levels_have_no_latencies() -> None:
    assert _record(0.1, (), tokens=1).tpot_s is None
    assert _record(0.1, (0.05, 0.07), tokens=5).tpot_s == pytest.approx(0.12 / 4)
    r = summarize([RequestRecord(5, 5, 0, 0.0, (), 0.1, "refused")], duration_s=1.0, concurrency=1)
    assert (r.completed, r.output_throughput, r.ttft.median_ms, r.itl.p99_ms) == (0, 0.0, None, None)


# -- ferrum bench offline -----------------------------------------------------------------------------


@pytest.mark.slow
def test_bench_offline_on_the_demo_model(tmp_path: Path, one_thread: None, tokenizer: Tokenizer) -> None:
    out = tmp_path / "offline.json"
    code = _run_cli([
        "bench", "offline", "--model", str(MODEL_DIR), "--backend", "cpu", "--dtype", "float32",
        "--kv-cache-memory-gb", "0.05", "--max-model-len", "128", *SHORT, "--output-json", str(out),
    ])
    assert code == 0
    result: dict[str, Any] = json.loads(out.read_text())
    expected = make_workload(SHORT_SPEC, prompt_token_pool(tokenizer))
    assert result["kind"] == "offline"
    assert (result["device"], result["backend"], result["dtype"]) == ("cpu", "cpu", "float32")
    assert result["device_name"]
    assert result["num_requests"] == 5
    assert result["total_input_tokens"] == sum(r.prompt_len for r in expected)
    assert result["total_output_tokens"] == result["requested_output_tokens"] == sum(r.output_len for r in expected)
    assert result["output_tokens_as_requested"] is True
    assert result["workload"] == {"num_prompts": 5, "input_len": [4, 24], "output_len": [2, 8], "seed": 7,
                                  "ignore_eos": True}
    assert result["engine"]["max_model_len"] == 128
    assert result["elapsed_s"] > 0
    assert result["output_tokens_per_s"] == pytest.approx(result["total_output_tokens"] / result["elapsed_s"])


@pytest.mark.slow
def test_bench_offline_refuses_requests_longer_than_the_context(capsys: pytest.CaptureFixture[str]) -> None:
    _need_model()
    code = _run_cli(["bench", "offline", "--model", str(MODEL_DIR), "--backend", "cpu", "--dtype", "float32",
                     "--kv-cache-memory-gb", "0.05", "--max-model-len", "64", "--input-len", "60",
                     "--output-len", "10"])
    assert code == 2
    assert "max_model_len is 64" in capsys.readouterr().err


# -- ferrum bench serve -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server_url() -> Iterator[str]:
    _need_model()
    with pytest.MonkeyPatch.context() as env:
        env.setenv("OMP_NUM_THREADS", "1")  # see conftest's one_thread: 1 thread is faster on 2 shared cores
        with live_server("--model", str(MODEL_DIR), "--backend", "cpu", "--dtype", "float32",
                         "--max-model-len", "128", "--kv-cache-memory-gb", "0.05") as url:
            yield url


@pytest.mark.slow
def test_bench_serve_at_two_concurrency_levels(server_url: str, tmp_path: Path, tokenizer: Tokenizer) -> None:
    out, plot = tmp_path / "serve.json", tmp_path / "serve.png"
    code = _run_cli([
        "bench", "serve", "--url", server_url, "--tokenizer", str(MODEL_DIR), "--concurrency", "1,4", *SHORT,
        "--output-json", str(out), "--plot", str(plot), "--save-requests",
    ])
    assert code == 0
    result: dict[str, Any] = json.loads(out.read_text())
    expected = make_workload(SHORT_SPEC, prompt_token_pool(tokenizer))
    assert (result["kind"], result["model"], result["max_model_len"]) == ("serve", MODEL_DIR.name, 128)
    assert result["request_rate"] == "inf"
    assert [level["concurrency"] for level in result["levels"]] == [1, 4]
    for level in result["levels"]:
        assert (level["num_requests"], level["completed"], level["failed"], level["first_error"]) == (5, 5, 0, None)
        assert level["total_input_tokens"] == sum(r.prompt_len for r in expected)
        assert level["total_output_tokens"] == level["requested_output_tokens"] == sum(r.output_len for r in expected)
        assert [r["output_tokens"] for r in level["requests"]] == [r.output_len for r in expected]
        assert [r["prompt_len"] for r in level["requests"]] == [r.prompt_len for r in expected]
        for name in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
            stats = level[name]
            assert set(stats) == {"mean", "median", "p99"}
            assert 0 < stats["median"] <= stats["p99"]
        assert level["request_throughput"] == pytest.approx(5 / level["duration_s"])
        assert level["output_throughput"] == pytest.approx(level["total_output_tokens"] / level["duration_s"])
        for r in level["requests"]:
            assert r["error"] is None
            assert 0 < r["ttft_ms"] <= r["latency_ms"]
            assert len(r["itl_ms"]) <= r["output_tokens"] - 1
    assert plot.read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.slow
def test_a_refused_request_is_recorded_with_the_server_message(server_url: str) -> None:
    async def one() -> RequestRecord:
        async with aiohttp.ClientSession() as session:
            return await send(session, Target(server_url, MODEL_DIR.name), BenchRequest((100, 200, 300), 500))

    record = asyncio.run(one())
    assert not record.ok
    assert record.error is not None and record.error.startswith("HTTP 400:")
    assert "maximum context length is 128" in record.error
    assert record.output_tokens == 0
