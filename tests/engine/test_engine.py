"""The engine: KV block accounting, scheduling (token budget, chunked prefill,
preemption), aborts, stop conditions, streaming, seeds, and the asyncio front.

Scheduler unit tests drive a real Scheduler + BlockManager by hand (advancing
num_computed_tokens as the model runner does); everything else runs the demo
model (SmolLM2-135M-Instruct) through real LLMEngine instances.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from ferrum.engine.async_engine import AsyncEngine
from ferrum.engine.block_manager import BlockManager
from ferrum.engine.llm_engine import LLMEngine, PromptTooLongError
from ferrum.engine.outputs import RequestOutput
from ferrum.engine.sampling_params import SamplingParams
from ferrum.engine.scheduler import Scheduler
from ferrum.engine.sequence import Sequence, SequenceStatus
from tests.engines import local_engine

MODEL = Path(__file__).resolve().parents[2] / "models" / "SmolLM2-135M-Instruct"
pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
needs_model = pytest.mark.skipif(not (MODEL / "model.safetensors").is_file(), reason="demo model not present")

GREEDY = SamplingParams(max_tokens=16, temperature=0.0)


def _seq(rid: str, n_prompt: int, params: SamplingParams = GREEDY) -> Sequence:
    return Sequence(rid, list(range(1, n_prompt + 1)), params, 0.0)


# --- BlockManager --------------------------------------------------------------------------


def test_block_manager_blocks_needed_grow_and_free() -> None:
    bm = BlockManager(num_blocks=10, block_size=4)
    a, b = _seq("a", 5), _seq("b", 5)
    assert (bm.num_free, bm.num_used) == (10, 0)
    assert [bm.blocks_needed(a, n) for n in (0, 1, 4, 5, 8, 9, 40, 41)] == [0, 1, 1, 2, 2, 3, 10, 11]

    bm.grow(a, 5)
    assert len(a.block_table) == 2 and (bm.num_free, bm.num_used) == (8, 2)
    assert bm.blocks_needed(a, 8) == 0 and bm.blocks_needed(a, 9) == 1 and bm.blocks_needed(a, 3) == 0
    bm.grow(a, 8)  # still fits in the two blocks
    assert len(a.block_table) == 2 and bm.num_free == 8
    bm.grow(a, 9)
    assert len(a.block_table) == 3 and bm.num_free == 7

    bm.grow(b, 16)
    assert len(b.block_table) == 4 and bm.num_used == 7
    assert not set(a.block_table) & set(b.block_table)  # no block handed out twice

    assert bm.can_grow(b, 28) and not bm.can_grow(b, 29)  # 3 free: up to 7 blocks = 28 tokens
    with pytest.raises(RuntimeError, match="out of KV blocks"):
        bm.grow(b, 29)
    assert len(b.block_table) == 4 and bm.num_free == 3  # a failed grow changes nothing

    a.num_computed_tokens = 9
    freed = list(a.block_table)
    bm.free(a)
    assert a.block_table == [] and a.num_computed_tokens == 0
    assert (bm.num_free, bm.num_used) == (6, 4)
    bm.free(b)
    assert (bm.num_free, bm.num_used) == (10, 0)
    # freed blocks are handed out again, every one of them exactly once
    c = _seq("c", 40)
    bm.grow(c, 40)
    assert sorted(c.block_table) == list(range(10)) and set(freed) <= set(c.block_table)
    assert bm.num_free == 0 and not bm.can_grow(_seq("d", 1), 1)


def test_block_manager_needs_a_block() -> None:
    with pytest.raises(ValueError):
        BlockManager(num_blocks=0, block_size=16)


# --- Scheduler (driven by hand) ------------------------------------------------------------


def _advance(plan) -> None:
    """What the model runner and sampler do to a scheduled batch: compute the tokens, and give
    each sequence whose pending tokens are all computed its next token."""
    for s in plan.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
        if s.seq.num_computed_tokens == s.seq.num_tokens:
            s.seq.output_token_ids.append(7)


def _plan(plan) -> list[tuple[str, int]]:
    return [(s.seq.request_id, s.num_new_tokens) for s in plan.scheduled]


def test_scheduler_budget_chunking_and_admission_order() -> None:
    bm = BlockManager(num_blocks=100, block_size=4)
    sched = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=10)
    a, b, c = _seq("a", 25), _seq("b", 3), _seq("c", 4)
    for s in (a, b, c):
        sched.add(s)

    p = sched.schedule()
    assert _plan(p) == [("a", 10)]  # a's prompt is chunked to the budget; nothing else fits
    assert not p.scheduled[0].is_decode and a.status is SequenceStatus.RUNNING
    assert len(a.block_table) == 3  # blocks for the 10 scheduled tokens only
    _advance(p)
    p = sched.schedule()
    assert _plan(p) == [("a", 10)]
    _advance(p)
    p = sched.schedule()
    assert _plan(p) == [("a", 5), ("b", 3)]  # a's last chunk, then b; c waits: max_num_seqs=2
    _advance(p)
    assert a.output_token_ids == [7] and b.output_token_ids == [7]
    p = sched.schedule()
    assert _plan(p) == [("a", 1), ("b", 1)] and all(s.is_decode for s in p.scheduled)
    assert list(sched.waiting) == [c]
    _advance(p)

    sched.remove(a)  # a finishes: its blocks come back and c gets its seat
    assert a.block_table == [] and bm.num_used == len(b.block_table)
    p = sched.schedule()
    assert _plan(p) == [("b", 1), ("c", 4)]
    _advance(p)
    sched.remove(b)
    sched.remove(c)
    assert not sched.has_work and bm.num_used == 0


def test_scheduler_never_exceeds_the_budget_or_the_cache() -> None:
    bm = BlockManager(num_blocks=8, block_size=4)  # the longest sequence (13 + 10) needs 6 blocks
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=7)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    seqs = [_seq(f"s{i}", n, params) for i, n in enumerate([9, 2, 13, 5, 1, 8])]
    for s in seqs:
        sched.add(s)
    steps = 0
    preempted = 0
    while sched.has_work:
        steps += 1
        assert steps < 200
        p = sched.schedule()
        preempted += p.num_preempted
        assert sum(s.num_new_tokens for s in p.scheduled) <= 7
        assert len(sched.running) <= 4
        assert bm.num_used <= 8
        for item in p.scheduled:
            assert 1 <= item.num_new_tokens <= item.seq.num_uncomputed_tokens
            assert len(item.seq.block_table) * 4 >= item.seq.num_computed_tokens + item.num_new_tokens
        _advance(p)
        for s in list(sched.running):
            if len(s.output_token_ids) >= s.params.max_tokens:
                sched.remove(s)
    assert all(len(s.output_token_ids) == 10 for s in seqs)
    assert bm.num_used == 0 and preempted > 0  # 8 blocks cannot hold four growing sequences at once


def test_scheduler_preempts_the_latest_admitted_and_requeues_it_first() -> None:
    bm = BlockManager(num_blocks=3, block_size=4, enable_prefix_caching=False)  # recompute in full
    sched = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64)
    a, b, c = _seq("a", 4), _seq("b", 4), _seq("c", 4)
    for s in (a, b, c):
        sched.add(s)
    p = sched.schedule()
    assert _plan(p) == [("a", 4), ("b", 4), ("c", 4)] and bm.num_free == 0
    _advance(p)  # each now has 5 tokens: the 5th needs a second block
    p = sched.schedule()
    # a needs a block: c (latest) is preempted; then b needs one: b itself is preempted
    assert p.num_preempted == 2 and _plan(p) == [("a", 1)]
    assert list(sched.waiting) == [b, c] and sched.running == [a]
    assert b.block_table == [] and b.num_computed_tokens == 0 and b.status is SequenceStatus.WAITING
    assert b.output_token_ids == [7]  # outputs are kept; the tokens are recomputed later
    _advance(p)
    sched.remove(a)
    p = sched.schedule()
    assert _plan(p) == [("b", 5)]  # recompute prompt + output; c does not fit yet (needs 2 more blocks)
    assert p.scheduled[0].is_decode is False


# --- engines on the demo model -------------------------------------------------------------



@pytest.fixture(scope="module")
def chunked(engine: LLMEngine) -> LLMEngine:
    return local_engine(MODEL, dtype="float32", kv_cache_memory_gb=0.1, max_model_len=1024, max_num_batched_tokens=16)


SMALL_BLOCKS = 4


@pytest.fixture(scope="module")
def small(engine: LLMEngine) -> LLMEngine:
    """A KV cache of exactly 4 blocks of 16 tokens: one max_model_len=64 sequence fits, few more;
    and at most 12 tokens a step."""
    layout = dataclasses.replace(engine.layout, dtype=torch.float32, block_size=16)
    gb = (SMALL_BLOCKS + 0.5) * layout.bytes_per_block / 2**30
    # a small token budget too: recomputing a preempted sequence is itself a chunked prefill
    e = local_engine(MODEL, dtype="float32", kv_cache_memory_gb=gb, max_model_len=64, block_size=16,
                     max_num_batched_tokens=12)
    assert e.stats().kv_blocks_total == SMALL_BLOCKS
    return e


def _chat(engine: LLMEngine, question: str) -> list[int]:
    return engine.tokenizer.encode_chat([{"role": "user", "content": question}])


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    deltas: list[RequestOutput] = field(default_factory=list)


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, Result]:
    """Runs requests to completion through add_request/step, collecting every delta."""
    results = {rid: Result() for rid in requests}
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    steps = 0
    while engine.has_work:
        steps += 1
        assert steps < 2000, "engine did not finish"
        for out in engine.step():
            r = results[out.request_id]
            assert r.finish_reason is None, "a delta after the final one"
            r.deltas.append(out)
            r.tokens.extend(out.new_token_ids)
            r.text += out.new_text
            if out.finished:
                r.finish_reason = out.finish_reason
    assert engine.stats().kv_blocks_used == 0
    return results


def _one(engine: LLMEngine, prompt: list[int], params: SamplingParams) -> Result:
    return _run(engine, {"one": (prompt, params)})["one"]


FRANCE = "What is the capital of France?"
QUESTIONS = [FRANCE, "Name three primary colors.", "Write a haiku about the sea."]
RAW = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The quick brown fox",
    "In 1492, Columbus",
]


@pytest.fixture(scope="module")
def france(engine: LLMEngine) -> Result:
    """The greedy answer to FRANCE: 'The capital of France is Paris.' then EOS."""
    r = _one(engine, _chat(engine, FRANCE), SamplingParams(max_tokens=24, temperature=0.0))
    assert r.finish_reason == "stop" and r.tokens[-1] in engine.tokenizer.eos_token_ids
    assert r.text == "The capital of France is Paris."
    return r


# --- chunked prefill -----------------------------------------------------------------------


@needs_model
def test_chunked_prefill_gives_the_same_greedy_output(engine, chunked, monkeypatch) -> None:
    prompts = [_chat(engine, q) for q in QUESTIONS]
    assert all(len(p) > 2 * 16 for p in prompts)  # each prompt needs at least three chunks
    params = SamplingParams(max_tokens=12, temperature=0.0)
    expected = [_one(engine, p, params).tokens for p in prompts]

    plans: list[list[tuple[str, int, int]]] = []
    real_schedule = chunked.scheduler.schedule

    def spy(**kwargs):
        out = real_schedule(**kwargs)
        plans.append([(s.seq.request_id, s.num_new_tokens, s.seq.num_computed_tokens) for s in out.scheduled])
        return out

    monkeypatch.setattr(chunked.scheduler, "schedule", spy)
    alone = _one(chunked, prompts[0], params)
    assert alone.tokens == expected[0]
    assert [n for _, n, _ in (step[0] for step in plans[:3])] == [16, 16, len(prompts[0]) - 32]

    plans.clear()
    got = _run(chunked, {f"c{i}": (p, params) for i, p in enumerate(prompts)})
    assert [got[f"c{i}"].tokens for i in range(3)] == expected
    assert all(sum(n for _, n, _ in step) <= 16 for step in plans)  # the token budget holds
    assert any(past > 0 and n > 1 for step in plans for _, n, past in step)  # chunks resumed mid-prompt
    assert chunked.stats().kv_blocks_used == 0


# --- preemption ----------------------------------------------------------------------------


@needs_model
def test_preemption_with_a_tiny_kv_cache_keeps_outputs(engine, small) -> None:
    tok = engine.tokenizer
    prompts = [tok.encode(t) for t in RAW[:3]]  # 4 to 6 tokens: one block each at first, two by the end
    greedy = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    seeded = [SamplingParams(max_tokens=16, temperature=1.0, seed=s, ignore_eos=True) for s in (11, 12)]
    requests = {f"g{i}": (p, greedy) for i, p in enumerate(prompts)}
    requests |= {f"s{i}": (prompts[i], sp) for i, sp in enumerate(seeded)}
    # run alone (on the roomy engine): no batching, no preemption
    alone = {rid: _one(engine, p, sp) for rid, (p, sp) in requests.items()}

    before = small.stats().num_preemptions
    got = _run(small, requests)
    stats = small.stats()
    assert stats.num_preemptions > before, "a 4-block cache should have forced preemptions"
    for rid, r in got.items():
        assert r.finish_reason == "length" and len(r.tokens) == 16, rid
        assert r.tokens == alone[rid].tokens, f"{rid}: preempted output differs from the output alone"
        assert r.text == alone[rid].text
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
    print(f"preemptions: {stats.num_preemptions - before}")


# --- aborts --------------------------------------------------------------------------------


@needs_model
def test_abort_frees_blocks(engine) -> None:
    tok = engine.tokenizer
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
    engine.add_request("ab-1", tok.encode(RAW[0]), params)
    engine.add_request("ab-2", tok.encode(RAW[1]), params)
    for _ in range(3):
        engine.step()
    used = engine.stats().kv_blocks_used
    assert used >= 2 and engine.stats().num_running == 2

    out = engine.abort_request("ab-1")
    assert out is not None and out.finished and out.finish_reason == "abort"
    assert out.num_output_tokens == 3
    assert engine.stats().kv_blocks_used == used - 1 and engine.stats().num_running == 1
    assert engine.abort_request("ab-1") is None  # already gone
    assert engine.abort_request("never-seen") is None

    # aborting a request still waiting (never scheduled) works too
    engine.add_request("ab-3", tok.encode(RAW[2]), params)
    assert engine.stats().num_waiting == 1
    out = engine.abort_request("ab-3")
    assert out is not None and out.finish_reason == "abort" and out.new_token_ids == ()
    assert engine.stats().num_waiting == 0

    engine.abort_request("ab-2")
    stats = engine.stats()
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and not engine.has_work
    assert engine.step() == []


# --- stop conditions -----------------------------------------------------------------------


@needs_model
@pytest.mark.parametrize(
    "stop, include, text",
    [
        (("Paris",), False, "The capital of France is "),
        (("Paris",), True, "The capital of France is Paris"),
        (("Par",), False, "The capital of France is "),  # the stop string ends mid-token
        (("is Pa",), True, "The capital of France is Pa"),  # spans two tokens
        (("of France is",), False, "The capital "),  # spans three tokens: " of" must not be streamed early
        ((" of France", "capital"), False, "The "),  # the first one to appear wins
        (("capital", "The capital of"), True, "The capital"),
    ],
)
def test_stop_strings(engine, france, stop, include, text) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0, stop=stop, include_stop_str_in_output=include)
    r = _one(engine, _chat(engine, FRANCE), params)
    assert r.finish_reason == "stop"
    assert r.text == text
    # generation stops at the token that completes the stop string
    assert r.tokens == france.tokens[: len(r.tokens)]
    assert len(r.tokens) < len(france.tokens)
    assert "".join(d.new_text for d in r.deltas) == text


@needs_model
def test_stop_string_not_generated_runs_to_the_end(engine, france) -> None:
    r = _one(engine, _chat(engine, FRANCE), SamplingParams(max_tokens=24, temperature=0.0, stop=("London",)))
    assert r.finish_reason == "stop" and r.tokens == france.tokens and r.text == france.text


@needs_model
def test_stop_token_ids(engine, france) -> None:
    stop_at = 3
    token = france.tokens[stop_at]
    assert token not in france.tokens[:stop_at]
    params = SamplingParams(max_tokens=24, temperature=0.0, stop_token_ids=(token,))
    r = _one(engine, _chat(engine, FRANCE), params)
    assert r.finish_reason == "stop"
    assert r.tokens == france.tokens[: stop_at + 1]  # the stop token is the last token id...
    assert r.text == engine.tokenizer.decode(france.tokens[:stop_at])  # ...but its text is not output


@needs_model
def test_max_tokens_finishes_with_length(engine, france) -> None:
    r = _one(engine, _chat(engine, FRANCE), SamplingParams(max_tokens=3, temperature=0.0))
    assert r.finish_reason == "length" and r.tokens == france.tokens[:3]
    assert r.text == engine.tokenizer.decode(france.tokens[:3])


@needs_model
def test_eos_stops_and_ignore_eos_generates_exactly_max_tokens(engine, france) -> None:
    eos_at = len(france.tokens) - 1
    assert eos_at < 20
    r = _one(engine, _chat(engine, FRANCE), SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert r.finish_reason == "length" and len(r.tokens) == 20
    assert r.tokens[: eos_at + 1] == france.tokens  # EOS generated, then generation went on
    assert r.text.startswith(france.text)


@needs_model
def test_generation_stops_at_max_model_len(small) -> None:
    prompt = _chat(small, "Write a haiku about the sea.")
    small.limits.check(prompt, 64 - len(prompt))
    with pytest.raises(PromptTooLongError):
        small.limits.check(prompt, 64 - len(prompt) + 1)
    r = _one(small, prompt, SamplingParams(max_tokens=64 - len(prompt), temperature=0.0, ignore_eos=True))
    assert r.finish_reason == "length" and len(prompt) + len(r.tokens) == 64


@needs_model
def test_logprobs_arrive_with_their_tokens(engine, france) -> None:
    r = _one(engine, _chat(engine, FRANCE), SamplingParams(max_tokens=24, temperature=0.0, logprobs=3))
    assert r.tokens == france.tokens
    for d in r.deltas:
        assert d.new_logprobs is not None and len(d.new_logprobs) == len(d.new_token_ids)
        for lp, token in zip(d.new_logprobs, d.new_token_ids, strict=True):
            assert lp.token_id == token and len(lp.top) == 3
            assert lp.top[0].token_id == token  # greedy: the chosen token is the most likely one
            assert lp.logprob == pytest.approx(lp.top[0].logprob) and lp.logprob <= 0.0
            assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
            assert lp.token == engine.tokenizer.decode([token], skip_special_tokens=False)
    paris = [lp for d in r.deltas for lp in d.new_logprobs or () if lp.token.strip() == "Paris"]
    assert len(paris) == 1 and paris[0].logprob > -0.5  # the model is sure of its answer
    plain = _one(engine, _chat(engine, FRANCE), SamplingParams(max_tokens=4, temperature=0.0))
    assert all(d.new_logprobs is None for d in plain.deltas)


# --- streaming -----------------------------------------------------------------------------


@needs_model
@pytest.mark.parametrize("stop", [(), ("\n\n", "zzz")])
def test_streaming_deltas_concatenate_to_the_full_text(engine, stop) -> None:
    prompt = _chat(engine, "Write a haiku about the sea.")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, stop=stop)
    r = _one(engine, prompt, params)
    if not stop:
        (offline,) = engine.generate([prompt], params)
        assert r.tokens == offline
    assert len(r.deltas) > 5  # streamed, not one lump
    assert [d.finished for d in r.deltas] == [False] * (len(r.deltas) - 1) + [True]
    assert [d.num_output_tokens for d in r.deltas] == sorted({d.num_output_tokens for d in r.deltas})
    assert r.deltas[-1].num_output_tokens == len(r.tokens)
    full = engine.tokenizer.decode(r.tokens)
    if r.finish_reason == "length":
        assert r.text == full
    else:  # stopped at "\n\n": the text is the decode up to the stop string
        assert full.startswith(r.text) and full[len(r.text) :].startswith("\n\n")
    assert "\n" in r.text  # a multi-line haiku: a non-trivial check of newline handling


# --- seeds ---------------------------------------------------------------------------------


@needs_model
def test_seed_reproducible_alone_and_batched(engine) -> None:
    tok = engine.tokenizer
    prompt = _chat(engine, "Write a haiku about the sea.")
    seeded = SamplingParams(max_tokens=12, temperature=1.0, seed=1234)
    a = _one(engine, prompt, seeded).tokens
    b = _one(engine, prompt, seeded).tokens
    assert a == b
    others = {
        "other-unseeded": (tok.encode(RAW[0]), SamplingParams(max_tokens=20, temperature=1.0)),
        "other-seeded": (prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=99)),
        "other-greedy": (tok.encode(RAW[2]), SamplingParams(max_tokens=5, temperature=0.0)),
    }
    torch.manual_seed(777)  # the global RNG must not matter to seeded requests
    batched = _run(engine, {"mine": (prompt, seeded), **others})
    assert batched["mine"].tokens == a
    other_seeds = [SamplingParams(max_tokens=12, temperature=1.0, seed=s) for s in (1, 2)]
    different = {tuple(_one(engine, prompt, sp).tokens) for sp in other_seeds}
    assert len(different | {tuple(a)}) == 3, "different seeds should give different samples"


# --- AsyncEngine ---------------------------------------------------------------------------


class _Running:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = AsyncEngine(engine)

    async def __aenter__(self) -> AsyncEngine:
        await self.engine.start()
        assert self.engine.is_ready()
        return self.engine

    async def __aexit__(self, *exc) -> None:
        await self.engine.shutdown()


async def _collect(aengine: AsyncEngine, rid: str, prompt: list[int], params: SamplingParams) -> Result:
    r = Result()
    async for out in aengine.generate(rid, prompt, params):
        assert out.request_id == rid and r.finish_reason is None
        r.deltas.append(out)
        r.tokens.extend(out.new_token_ids)
        r.text += out.new_text
        if out.finished:
            r.finish_reason = out.finish_reason
    return r


async def _wait_idle(aengine: AsyncEngine, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = aengine.stats()
        if s.kv_blocks_used == 0 and s.num_running == 0 and s.num_waiting == 0:
            return s
        await asyncio.sleep(0.02)
    raise AssertionError(f"engine not idle after {timeout}s: {aengine.stats()}")


@needs_model
async def test_async_generate_streams_to_completion(engine, france) -> None:
    async with _Running(engine) as aengine:
        r = await asyncio.wait_for(
            _collect(aengine, "a-1", _chat(engine, FRANCE), SamplingParams(max_tokens=24, temperature=0.0)),
            60,
        )
        assert r.tokens == france.tokens and r.text == france.text and "Paris" in r.text
        assert r.finish_reason == "stop" and len(r.deltas) > 1
        await _wait_idle(aengine)


@needs_model
async def test_async_eight_concurrent_requests(engine) -> None:
    tok = engine.tokenizer
    prompts = [tok.encode(t) for t in RAW] + [_chat(engine, q) for q in QUESTIONS]
    assert len(prompts) == 8
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = engine.generate(prompts, params)
    finished_before = engine.stats().requests_finished
    async with _Running(engine) as aengine:
        results = await asyncio.wait_for(
            asyncio.gather(*(_collect(aengine, f"c-{i}", p, params) for i, p in enumerate(prompts))), 120
        )
        stats = await _wait_idle(aengine)
    assert [r.tokens for r in results] == expected
    assert all(r.finish_reason == "length" and len(r.tokens) == 8 for r in results)
    assert stats.requests_finished == finished_before + 8


@needs_model
async def test_async_closing_a_generator_aborts_and_frees_blocks(engine) -> None:
    prompt = engine.tokenizer.encode(RAW[1])
    async with _Running(engine) as aengine:
        before = aengine.stats()
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        gen = aengine.generate("close-me", prompt, long)
        assert isinstance(gen, AsyncGenerator)  # closing it aborts the request
        seen = 0
        async for out in gen:
            seen += len(out.new_token_ids)
            if seen >= 2:
                break
        assert aengine.stats().kv_blocks_used > 0
        await gen.aclose()
        stats = await _wait_idle(aengine)
        assert stats.requests_finished == before.requests_finished  # aborted, not finished
        assert stats.generation_tokens_total - before.generation_tokens_total < 200
        assert not engine.has_work
        # the id can be used again once the first request is gone
        r = await asyncio.wait_for(
            _collect(aengine, "close-me", prompt, SamplingParams(max_tokens=3, temperature=0.0)), 60
        )
        assert r.finish_reason == "length" and len(r.tokens) == 3


@needs_model
async def test_async_abort_ends_the_stream(engine) -> None:
    prompt = engine.tokenizer.encode(RAW[2])
    async with _Running(engine) as aengine:
        outs: list[RequestOutput] = []

        async def consume() -> None:
            long = SamplingParams(max_tokens=200, ignore_eos=True)
            async for out in aengine.generate("abort-me", prompt, long):
                outs.append(out)
                if len(outs) == 2:
                    await aengine.abort("abort-me")

        await asyncio.wait_for(consume(), 20)
        assert outs[-1].finished and outs[-1].finish_reason == "abort"
        assert outs[-1].num_output_tokens < 200
        await _wait_idle(aengine)


@needs_model
async def test_async_prompt_too_long(engine) -> None:
    async with _Running(engine) as aengine:
        prompt = [1] * 1000
        with pytest.raises(PromptTooLongError, match="maximum context length is 1024"):
            async for _ in aengine.generate("too-long", prompt, SamplingParams(max_tokens=25)):
                pass
        # exactly at the limit is accepted by the check
        engine.limits.check([1] * 1000, 24)
        s = aengine.stats()
        assert s.num_running == 0 and s.num_waiting == 0
        # the engine still serves requests afterwards
        short = SamplingParams(max_tokens=2, temperature=0.0)
        r = await asyncio.wait_for(_collect(aengine, "after", [1, 2, 3], short), 60)
        assert len(r.tokens) == 2


@needs_model
async def test_async_request_id_reusable_right_after_closing(engine) -> None:
    """A client that disconnects and retries at once with the same request id (X-Request-Id) gets
    a normal generation: the old request's pending abort and late outputs do not reach the new one."""
    prompt = engine.tokenizer.encode(RAW[3])
    async with _Running(engine) as aengine:
        long = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        gen = aengine.generate("retry", prompt, long)
        assert isinstance(gen, AsyncGenerator)
        await anext(gen)
        with pytest.raises(ValueError, match="already in use"):  # not while the first one is live
            await anext(aengine.generate("retry", prompt, SamplingParams(max_tokens=4)))
        await gen.aclose()  # the abort is queued, not yet applied: the engine is busy stepping
        short = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        r = await asyncio.wait_for(_collect(aengine, "retry", prompt, short), 60)
        # only the new request's tokens: none of the old one's late outputs, and no spurious abort
        assert r.finish_reason == "length" and len(r.tokens) == 4
        assert [d.num_output_tokens for d in r.deltas] == [1, 2, 3, 4]
        await _wait_idle(aengine)
        assert not engine.has_work
