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

from ferrum.bench.client import ResponseStream, Target, send
from ferrum.bench.errors import BenchError
from ferrum.bench.metrics import RequestRecord, summarize
from ferrum.bench.serve import ServeOptions, run_serve
from ferrum.bench.workload import (
    WARMUP_TEXT,
    BenchRequest,
    LengthRange,
    WorkloadSpec,
    load_prompts,
    make_workload,
    prompt_token_pool,
    shared_prefix,
    warmup_request,
    with_text,
)
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


def _record(
    ttft: float, gaps: tuple[float, ...], tokens: int, prompt: int = 10, error: str | None = None
) -> RequestRecord:
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
                                  "ignore_eos": True, "prefix_len": 0, "dataset": "random",
                                  "num_distinct_prompts": None}
    assert result["engine"]["max_model_len"] == 128
    assert result["elapsed_s"] > 0
    assert result["output_tokens_per_s"] == pytest.approx(result["total_output_tokens"] / result["elapsed_s"])
    assert result["kv_cache_dtype"] == "float32" and result["kv_cache_tokens"] % 16 == 0 < result["kv_cache_tokens"]
    roofline = result["roofline"]  # measured peaks, and one pass at least per step kind the run had
    assert roofline["peak_tflops"] > 0 and roofline["bandwidth_gbs"] > 0
    assert 0 < roofline["seconds"] == pytest.approx(sum(roofline["seconds_by_kind"].values()))
    assert roofline["fraction"] == pytest.approx(roofline["seconds"] / result["elapsed_s"])
    assert roofline["passes"] >= max(r.output_len for r in expected)  # a pass per generated token at least
    assert 0 <= roofline["compute_bound_passes"] <= roofline["passes"]
    assert result["speculation"] is None


def test_bench_offline_reports_the_acceptance(tmp_path: Path, one_thread: None) -> None:
    """With --speculative-config the report counts drafts and kept tokens (random prompts: few of either)."""
    _need_model()
    out = tmp_path / "offline.json"
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "adaptive": False})
    assert _run_cli(["bench", "offline", "--model", str(MODEL_DIR), "--backend", "cpu", "--dtype", "float32",
                     "--kv-cache-memory-gb", "0.05", "--max-model-len", "128", *SHORT, "--speculative-config", spec,
                     "--output-json", str(out)]) == 0
    s = json.loads(out.read_text())["speculation"]
    assert s["num_drafts"] > 0 and 0 <= s["num_accepted_tokens"] <= s["num_draft_tokens"] <= 2 * s["num_drafts"]
    assert len(s["accepted_per_position"]) == 2 and s["mean_accepted_length"] >= 1


@pytest.mark.slow
def test_bench_offline_refuses_requests_longer_than_the_context(capsys: pytest.CaptureFixture[str]) -> None:
    _need_model()
    code = _run_cli(["bench", "offline", "--model", str(MODEL_DIR), "--backend", "cpu", "--dtype", "float32",
                     "--kv-cache-memory-gb", "0.05", "--max-model-len", "64", "--input-len", "60",
                     "--output-len", "10"])
    assert code == 2
    assert "max_model_len is 64" in capsys.readouterr().err


def test_bench_offline_takes_kernel_settings_and_refuses_unknown_ones(capsys: pytest.CaptureFixture[str]) -> None:
    """--kernels is the YAML's engine.kernels as JSON: an unknown key stops the run (exit 2) naming it, before
    any model is read; something other than a JSON object is a usage error."""
    base = ["bench", "offline", "--model", "/nonexistent/model", "--backend", "cpu"]
    assert _run_cli([*base, "--kernels", '{"int4_w8a8_rows": 129, "pld": false}']) == 2
    assert "unknown engine.kernels key(s): pld" in capsys.readouterr().err
    assert _run_cli([*base, "--kernels", "[129]"]) == 2
    assert "expected a JSON object" in capsys.readouterr().err


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


# -- shared prefix ------------------------------------------------------------------------------------

# The first three prompt ids of each request of SHORT_SPEC (rounds 0 and 1) and its warm-up, as drawn
# before the shared prefix existed: prefix_len 0 must keep drawing exactly these.
SHORT_SPEC_IDS = {
    0: [(13839, 13675, 7527), (8930, 44093, 25990), (47878, 14812, 12126), (44412, 4349, 28985),
        (34594, 9457, 34956)],
    1: [(10024, 25720, 14564), (41214, 3787, 13968), (6737, 35525, 36076), (35686, 3756, 9852),
        (34838, 42834, 39983)],
}
SHORT_SPEC_LENGTHS = [(23, 7), (17, 7), (18, 3), (22, 2), (16, 4)]


@pytest.mark.slow
def test_prefix_len_0_draws_the_requests_of_before(tokenizer: Tokenizer) -> None:
    pool = prompt_token_pool(tokenizer)
    for round_index, firsts in SHORT_SPEC_IDS.items():
        requests = make_workload(SHORT_SPEC, pool, round_index)
        assert [r.prompt_token_ids[:3] for r in requests] == firsts
        assert [(r.prompt_len, r.output_len) for r in requests] == SHORT_SPEC_LENGTHS
        assert all(r.prefix_len == 0 and r.text is None for r in requests)
    assert warmup_request(SHORT_SPEC, pool) == BenchRequest((42777, 37857, 43052, 5516), 2)
    assert shared_prefix(SHORT_SPEC, pool) == ()


@pytest.mark.slow
def test_the_shared_prefix_is_the_same_in_every_request_and_round(tokenizer: Tokenizer) -> None:
    pool = prompt_token_pool(tokenizer)
    spec = WorkloadSpec(5, LengthRange(4, 24), LengthRange(2, 8), seed=7, prefix_len=40)
    prefix = shared_prefix(spec, pool)
    assert len(prefix) == 40 and len(set(prefix)) > 30  # random ids, not one repeated
    for round_index in (0, 1):
        plain = make_workload(SHORT_SPEC, pool, round_index)
        with_prefix = make_workload(spec, pool, round_index)
        for a, b in zip(plain, with_prefix, strict=True):
            assert b.prompt_token_ids[:40] == prefix and b.prefix_len == 40
            assert b.prompt_token_ids[40:] == a.prompt_token_ids  # the own part is drawn as without a prefix
            assert (b.prompt_len, b.output_len) == (40 + a.prompt_len, a.output_len)
    assert make_workload(spec, pool, 0)[0].prompt_token_ids != make_workload(spec, pool, 1)[0].prompt_token_ids
    assert shared_prefix(WorkloadSpec(5, seed=8, prefix_len=40), pool) != prefix
    assert warmup_request(spec, pool) == warmup_request(SHORT_SPEC, pool)  # no prefix in the warm-up
    assert spec.longest_request == 40 + 24 + 8
    assert spec.describe_longest() == "prefix 40 + input 24 + output 8"


@pytest.mark.slow
def test_chat_text_keeps_the_prefix_text_shared(tokenizer: Tokenizer) -> None:
    pool = prompt_token_pool(tokenizer)
    spec = WorkloadSpec(3, LengthRange(5, 9), LengthRange(2, 2), seed=1, prefix_len=12)
    head = tokenizer.decode(shared_prefix(spec, pool))
    for r in make_workload(spec, pool):
        text = with_text(r, tokenizer.decode).text
        assert text == head + tokenizer.decode(r.prompt_token_ids[12:])
    listed = BenchRequest((), 4, text="as given")
    assert with_text(listed, tokenizer.decode) is listed


def test_per_level_request_counts() -> None:
    pool = list(range(100, 200))
    spec = WorkloadSpec(4, LengthRange(3, 5), LengthRange(1, 2), seed=2)
    assert len(make_workload(spec, pool)) == 4
    assert len(make_workload(spec, pool, num_requests=9)) == 9
    assert make_workload(spec, pool, num_requests=4) == make_workload(spec, pool)
    options = ServeOptions("http://x", spec, concurrency=(1, 8), requests_per_level=(8, 32))
    assert options.level_sizes == (8, 32)
    assert ServeOptions("http://x", spec, concurrency=(1, 8)).level_sizes == (4, 4)
    for bad in ((8,), (8, 0), (1, 2, 3)):
        with pytest.raises(ValueError, match="requests_per_level"):
            ServeOptions("http://x", spec, concurrency=(1, 8), requests_per_level=bad)
    with pytest.raises(ValueError, match="endpoint"):
        ServeOptions("http://x", spec, endpoint="embeddings")  # type: ignore[arg-type]


# -- prompt list --------------------------------------------------------------------------------------

PROMPTS = ("What is the capital of France?", "Name three primary colors.", "Why is the sky blue?")


def test_a_prompt_list_is_handed_out_round_robin() -> None:
    spec = WorkloadSpec(7, output_len=LengthRange(3, 6), seed=4, ignore_eos=False, prompts=PROMPTS)
    first, second = make_workload(spec, None, 0), make_workload(spec, None, 1)
    assert [r.text for r in first] == [PROMPTS[i % 3] for i in range(7)]
    assert first == second  # the same texts and max_tokens in every round
    assert all(r.prompt_token_ids == () and 3 <= r.output_len <= 6 for r in first)
    assert [r.text for r in make_workload(spec, None, num_requests=4)] == [*PROMPTS, PROMPTS[0]]
    assert warmup_request(spec, None) == BenchRequest((), 3, text=WARMUP_TEXT)
    assert WARMUP_TEXT not in PROMPTS
    assert (spec.dataset, spec.longest_request) == ("prompt-list", 6)
    with pytest.raises(ValueError, match="prefix"):
        WorkloadSpec(prompts=PROMPTS, prefix_len=8)
    with pytest.raises(ValueError, match="non-empty"):
        WorkloadSpec(prompts=("ok", ""))
    with pytest.raises(ValueError, match="pool"):
        make_workload(WorkloadSpec(2), None)


def test_load_prompts_reads_a_json_list_of_strings(tmp_path: Path) -> None:
    good = tmp_path / "prompts.json"
    good.write_text(json.dumps(list(PROMPTS)))
    assert load_prompts(good) == PROMPTS
    for name, content in (("dict.json", '{"a": "b"}'), ("empty.json", "[]"), ("mixed.json", '["a", 3]'),
                          ("blank.json", '["a", ""]'), ("broken.json", '["a"')):
        path = tmp_path / name
        path.write_text(content)
        with pytest.raises(BenchError, match=name):
            load_prompts(path)
    with pytest.raises(BenchError, match="cannot read"):
        load_prompts(tmp_path / "missing.json")


# -- the chat endpoint: bodies and streams --------------------------------------------------------------


def test_request_bodies_of_both_endpoints() -> None:
    chat = Target("http://h:1", "m", ignore_eos=False, endpoint="chat")
    assert chat.url == "http://h:1/v1/chat/completions"
    assert chat.body(BenchRequest((), 64, text="Hi?")) == {
        "model": "m", "messages": [{"role": "user", "content": "Hi?"}], "max_tokens": 64, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }
    ignoring = Target("http://h:1", "m", endpoint="chat")
    assert ignoring.body(BenchRequest((1, 2), 5, text="x"))["ignore_eos"] is True
    with pytest.raises(ValueError, match="text"):
        chat.body(BenchRequest((1, 2), 5))
    completions = Target("http://h:1", "m")
    assert completions.url == "http://h:1/v1/completions"
    assert completions.body(BenchRequest((1, 2), 5, text="x"))["prompt"] == [1, 2]  # ids when it has them
    assert completions.body(BenchRequest((), 5, text="x"))["prompt"] == "x"


def _chat_chunk(
    content: str | None = None, role: str | None = None, finish: str | None = None
) -> dict[str, Any]:
    delta = {k: v for k, v in (("role", role), ("content", content)) if v is not None}
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_chat_ttft_runs_to_the_first_content_and_tokens_fall_back_to_chunks() -> None:
    request = BenchRequest((), 8, text="q")
    stream = ResponseStream(chat=True)
    stream.take(_chat_chunk("", role="assistant"), 10.5)  # the role chunk carries no output
    stream.take(_chat_chunk("Hel"), 11.0)
    stream.take(_chat_chunk("lo"), 11.25)
    stream.take(_chat_chunk(finish="stop"), 11.5)
    record = stream.record(request, 10.0, 12.0)
    assert (record.ttft_s, record.itl_s, record.latency_s) == (1.0, (0.25,), 2.0)
    assert (record.output_tokens, record.token_source) == (2, "chunks")
    assert (record.text, record.finish_reason) == ("Hello", "stop")
    stream.take({"choices": [], "usage": {"prompt_tokens": 30, "completion_tokens": 3}}, 11.75)
    record = stream.record(request, 10.0, 12.0)
    assert (record.output_tokens, record.token_source, record.prompt_len) == (3, "usage", 30)

    silent = ResponseStream(chat=True)  # an answer without content: TTFT at the first choice
    silent.take(_chat_chunk("", role="assistant"), 10.5)
    silent.take(_chat_chunk(finish="stop"), 10.75)
    record = silent.record(request, 10.0, 11.0)
    assert (record.ok, record.ttft_s, record.itl_s, record.output_tokens) == (True, 0.5, (), 0)
    assert not ResponseStream(chat=True).record(request, 10.0, 11.0).ok


def test_completions_ttft_counts_a_choice_without_text() -> None:
    stream = ResponseStream(chat=False)
    stream.take({"choices": [{"index": 0, "text": ""}]}, 10.5)  # a token that decodes to no text yet
    stream.take({"choices": [{"index": 0, "text": "ab", "finish_reason": "length"}]}, 11.0)
    record = stream.record(BenchRequest((1, 2, 3), 2), 10.0, 11.0)
    assert (record.ttft_s, record.itl_s, record.output_tokens, record.token_source) == (0.5, (0.5,), 1, "chunks")
    assert record.prompt_len == 3


def test_levels_count_token_sources_and_finish_reasons() -> None:
    records = [RequestRecord(5, 4, 4, 0.1, (), 0.2, token_source="usage", finish_reason="length"),
               RequestRecord(5, 4, 2, 0.1, (), 0.2, token_source="chunks", finish_reason="stop"),
               RequestRecord(5, 4, 3, 0.1, (), 0.2, token_source="usage", finish_reason="stop"),
               RequestRecord(5, 4, 0, 0.0, (), 0.1, "HTTP 500")]
    r = summarize(records, 1.0, 2)
    assert r.token_sources == {"chunks": 1, "usage": 2}
    assert r.finish_reasons == {"length": 1, "stop": 2}


# -- live: chat, prompt list, per-level counts, prefix cache --------------------------------------------


@pytest.mark.slow
def test_bench_serve_chat_with_a_prompts_file_and_per_level_counts(
    server_url: str, tmp_path: Path, tokenizer: Tokenizer, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts_file, out = tmp_path / "prompts.json", tmp_path / "chat.json"
    prompts_file.write_text(json.dumps(list(PROMPTS)))
    code = _run_cli([
        "bench", "serve", "--url", server_url, "--endpoint", "chat", "--prompts-file", str(prompts_file),
        "--no-ignore-eos", "--output-len", "6", "--concurrency", "1,2", "--requests-per-level", "2,4",
        "--output-json", str(out), "--save-requests",
    ])
    assert code == 0
    text = capsys.readouterr().out
    assert "/v1/chat/completions" in text and "prompt list (3 prompts)" in text
    assert "Output tokens counted from:" in text
    result: dict[str, Any] = json.loads(out.read_text())
    assert (result["endpoint"], result["tokenizer"]) == ("chat", None)
    assert result["workload"]["dataset"] == "prompt-list"
    assert result["workload"]["num_distinct_prompts"] == 3
    assert result["workload"]["prompts_file"] == str(prompts_file)
    assert result["warmup"]["error"] is None and result["warmup"]["output_tokens"] >= 1
    counts = [(lv["concurrency"], lv["num_requests"], lv["completed"]) for lv in result["levels"]]
    assert counts == [(1, 2, 2), (2, 4, 4)]
    for level in result["levels"]:
        n = level["num_requests"]
        assert level["output_token_sources"] == {"usage": n}
        assert sum(level["finish_reasons"].values()) == n
        for i, r in enumerate(level["requests"]):
            chat = tokenizer.encode_chat([{"role": "user", "content": PROMPTS[i % 3]}])
            assert r["prompt_len"] == len(chat)  # the server's count of the templated prompt
            assert 1 <= r["output_tokens"] <= 6 and r["text"]
            assert r["token_source"] == "usage"
            assert r["finish_reason"] == ("length" if r["output_tokens"] == 6 else "stop")
            assert 0 < r["ttft_ms"] <= r["latency_ms"]
        assert level["total_input_tokens"] == sum(r["prompt_len"] for r in level["requests"])
    # greedy and one at a time: the first level's answer to a prompt is also the second level's
    first = result["levels"][0]["requests"]
    assert result["levels"][1]["requests"][0]["text"] == first[0]["text"]


@pytest.mark.slow
def test_run_serve_chat_on_random_ids_with_a_prefix(server_url: str, tokenizer: Tokenizer) -> None:
    spec = WorkloadSpec(3, LengthRange(4, 8), LengthRange(3, 3), seed=21, prefix_len=16)
    options = ServeOptions(server_url, spec, concurrency=(2,), tokenizer=str(MODEL_DIR), endpoint="chat")
    result = asyncio.run(run_serve(options))
    assert result.endpoint == "chat" and result.tokenizer == str(MODEL_DIR)
    assert result.warmup is not None and result.warmup.ok
    (level,) = result.levels
    pool = prompt_token_pool(tokenizer)
    for request, record in zip(make_workload(spec, pool), level.records, strict=True):
        assert record.ok, record.error
        assert (record.output_tokens, record.token_source) == (3, "usage")  # ignore_eos holds on chat
        chat = tokenizer.encode_chat([{"role": "user", "content": with_text(request, tokenizer.decode).text}])
        assert record.prompt_len == len(chat)
    assert level.result.total_output_tokens == level.result.requested_output_tokens == 9


def _prefix_cache_hits(url: str) -> float:
    import httpx

    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("ferrum_prefix_cache_hits"):
            return float(line.split()[-1])
    raise AssertionError("no ferrum_prefix_cache_hits in /metrics")


@pytest.mark.slow
def test_the_shared_prefix_is_new_in_the_first_round_and_cached_in_the_next(
    server_url: str, tmp_path: Path, tokenizer: Tokenizer
) -> None:
    out = tmp_path / "prefix.json"
    before = _prefix_cache_hits(server_url)
    code = _run_cli([
        "bench", "serve", "--url", server_url, "--tokenizer", str(MODEL_DIR), "--concurrency", "1,2",
        "--num-prompts", "2", "--prefix-len", "48", "--input-len", "4:12", "--output-len", "2", "--seed", "31",
        "--output-json", str(out),
    ])
    assert code == 0
    # 48 tokens = 3 full blocks of 16: missed by the first request, then hit by the second of round 0
    # and by both of round 1 (whose own parts are new), so 3 hits of 48 tokens.
    assert _prefix_cache_hits(server_url) - before == 3 * 48
    result: dict[str, Any] = json.loads(out.read_text())
    assert result["workload"]["prefix_len"] == 48
    spec = WorkloadSpec(2, LengthRange(4, 12), LengthRange(2, 2), seed=31, prefix_len=48)
    expected = make_workload(spec, prompt_token_pool(tokenizer))
    for level in result["levels"]:
        assert level["total_input_tokens"] == sum(r.prompt_len for r in expected)
        assert level["total_output_tokens"] == 4


@pytest.mark.slow
def test_bench_serve_refuses_a_prefix_that_does_not_fit(
    server_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code = _run_cli(["bench", "serve", "--url", server_url, "--tokenizer", str(MODEL_DIR), "--prefix-len", "100",
                     "--input-len", "20", "--output-len", "10"])
    assert code == 2
    assert "130 tokens (prefix 100 + input 20 + output 10)" in capsys.readouterr().err


@pytest.mark.slow
def test_a_model_the_server_does_not_serve_fails_the_warm_up(server_url: str) -> None:
    options = ServeOptions(server_url, SHORT_SPEC, concurrency=(1,), model="no-such-model",
                           tokenizer=str(MODEL_DIR))
    with pytest.raises(BenchError, match="warm-up request failed: HTTP 404"):
        asyncio.run(run_serve(options))


def test_spec_counters_read_ferrum_and_vllm_pages() -> None:
    from ferrum.bench.serve import spec_counters

    page = ('# HELP x\nferrum_spec_decode_num_drafts_total{model_name="m"} 10.0\n'
            'ferrum_spec_decode_num_draft_tokens_total{model_name="m"} 40.0\n'
            'ferrum_spec_decode_num_accepted_tokens_total{model_name="m"} 25.0\n')
    assert spec_counters(page) == (10.0, 40.0, 25.0)
    assert spec_counters(page.replace("ferrum_", "vllm:")) == (10.0, 40.0, 25.0)
    assert spec_counters("ferrum_generation_tokens_total 5\n") is None
