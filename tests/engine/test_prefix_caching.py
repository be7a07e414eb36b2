"""Prefix caching: chained block hashes, shared ref-counted blocks, LRU reuse of cached free
blocks, the collision guard and the disabled mode on a real BlockManager/Scheduler driven by
hand; then real engines on a tiny random-weight model (float32), where greedy outputs with
caching must equal those without it.
"""

from __future__ import annotations

import gc
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from ferrum.engine.block_manager import BlockManager
from ferrum.engine.llm_engine import LLMEngine
from ferrum.engine.outputs import RequestOutput
from ferrum.engine.prefix_cache import ROOT_HASH, hash_block, token_bytes
from ferrum.engine.sampling_params import SamplingParams
from ferrum.engine.scheduler import Scheduler, SchedulerOutput
from ferrum.engine.sequence import Sequence
from ferrum.models.attention.layout import KVCacheLayout
from ferrum.models.config import load_model_config
from ferrum.tokenizer import Tokenizer
from tests.engines import local_engine
from tests.tiny_model import make_tiny_llama

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

HAND = SamplingParams(max_tokens=8, temperature=0.0)


def _seq(rid: str, tokens: list[int], params: SamplingParams = HAND) -> Sequence:
    return Sequence(rid, list(tokens), params, 0.0)


def _compute_all(bm: BlockManager, seq: Sequence) -> list[int]:
    """What the scheduler and the model runner do for a whole prompt at once: share its cached
    prefix, compute the rest, register its full blocks. Returns the shared blocks."""
    cached = bm.cached_prefix(seq)
    bm.admit(seq, cached, seq.num_tokens)
    seq.num_computed_tokens = seq.num_tokens
    bm.cache_computed_blocks(seq)
    return cached


# --- hashes -------------------------------------------------------------------------------------


def test_block_hashes_chain_over_the_whole_prefix() -> None:
    assert hash_block(ROOT_HASH, token_bytes((1, 2))) == hash_block(ROOT_HASH, token_bytes((1, 2)))
    assert hash_block(ROOT_HASH, token_bytes((1, 2))) != hash_block(ROOT_HASH, token_bytes((2, 1)))
    # the same block after a different prefix is a different block
    after_12 = hash_block(ROOT_HASH, token_bytes((1, 2)))
    after_34 = hash_block(ROOT_HASH, token_bytes((3, 4)))
    assert hash_block(after_12, token_bytes((5, 6))) != hash_block(after_34, token_bytes((5, 6)))

    bm = BlockManager(num_blocks=16, block_size=2)
    a = _seq("a", [1, 2, 3, 4, 5, 6, 7])
    b = _seq("b", [1, 2, 3, 4, 9, 9, 7])
    c = _seq("c", [0, 2, 3, 4, 5, 6, 7])  # differs only in the first token
    for s in (a, b, c):
        _compute_all(bm, s)
    assert [len(s.block_hashes) for s in (a, b, c)] == [3, 3, 3]  # full blocks only
    assert a.block_hashes[:2] == b.block_hashes[:2] and a.block_hashes[2] != b.block_hashes[2]
    assert not set(a.block_hashes) & set(c.block_hashes)  # one changed token changes every later hash
    assert a.block_hashes[1] == hash_block(hash_block(ROOT_HASH, token_bytes((1, 2))), token_bytes((3, 4)))


# --- sharing and reference counts ----------------------------------------------------------------


def test_admission_shares_cached_blocks_and_counts_hits() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = _seq("a", list(range(1, 13)))  # 3 full blocks
    assert _compute_all(bm, a) == [] and bm.num_cached == 3
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (12, 0)

    b = _seq("b", list(range(1, 13)) + [50, 51])
    cached = bm.cached_prefix(b)
    assert cached == a.block_table
    bm.admit(b, cached, b.num_tokens)
    assert b.block_table[:3] == a.block_table and b.block_table[3] not in a.block_table
    assert b.num_computed_tokens == 12 and b.num_uncomputed_tokens == 2
    assert [bm.ref_count(x) for x in b.block_table] == [2, 2, 2, 1]
    assert (bm.num_used, bm.num_free) == (4, 12)  # shared blocks count once
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (26, 12)

    bm.free(a)  # b still holds the shared blocks
    assert [bm.ref_count(x) for x in b.block_table] == [1, 1, 1, 1] and bm.num_used == 4
    b.num_computed_tokens = b.num_tokens
    bm.free(b)
    assert (bm.num_used, bm.num_free) == (0, 16)
    assert bm.num_cached == 3  # freed blocks keep their KV for later requests


def test_a_fully_cached_prompt_still_computes_its_last_token_in_a_block_of_its_own() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = _seq("a", list(range(1, 9)))  # exactly 2 blocks
    _compute_all(bm, a)

    same = _seq("same", list(range(1, 9)))
    cached = bm.cached_prefix(same)
    assert cached == a.block_table[:1]  # the last block is not shared: its last token must run
    bm.admit(same, cached, same.num_tokens)
    assert same.num_computed_tokens == 4 and same.block_table[1] != a.block_table[1]
    assert bm.ref_count(same.block_table[1]) == 1  # the block the engine writes into is its own

    longer = _seq("longer", list(range(1, 10)))  # one token past the cached blocks: a decode step
    cached = bm.cached_prefix(longer)
    assert cached == a.block_table
    bm.admit(longer, cached, longer.num_tokens)
    assert longer.num_computed_tokens == 8 and longer.num_uncomputed_tokens == 1
    assert bm.ref_count(longer.block_table[2]) == 1


def test_generated_tokens_register_their_blocks_too() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    a = _seq("a", [5, 6, 7])
    bm.admit(a, bm.cached_prefix(a), a.num_tokens)
    a.num_computed_tokens = 3
    a.output_token_ids += [8, 9, 10, 11, 12]  # decoding: tokens computed one by one
    bm.grow(a, 8)
    a.num_computed_tokens = 7
    bm.cache_computed_blocks(a)
    assert bm.num_cached == 1  # block 1 (tokens 4..7) is not complete yet
    a.num_computed_tokens = 8
    bm.cache_computed_blocks(a)
    assert bm.num_cached == 2

    follow_up = _seq("b", [5, 6, 7, 8, 9, 10, 11, 12, 40])  # the earlier conversation, continued
    assert bm.cached_prefix(follow_up) == a.block_table[:2]


# --- LRU reuse of cached free blocks -------------------------------------------------------------


def test_cached_free_blocks_are_reused_least_recently_freed_first() -> None:
    bm = BlockManager(num_blocks=6, block_size=2)
    a = _seq("a", [1, 2, 3, 4, 5])  # blocks: [1 2] [3 4] [5 .]
    _compute_all(bm, a)
    first, second, partial = a.block_table
    bm.free(a)
    assert bm.num_cached == 2 and (bm.num_free, bm.num_used) == (6, 0)

    # 5 blocks wanted: the never-used ones and a's partial (uncached) block go first, then the
    # least recently freed cached block: a's second (freed before its first)
    b = _seq("b", [7, 8, 9, 10, 11, 12, 13, 14, 15])
    bm.admit(b, bm.cached_prefix(b), b.num_tokens)
    assert partial in b.block_table and second in b.block_table and first not in b.block_table
    assert bm.num_cached == 1  # taking a cached block from the free list drops its hash
    assert bm.cached_prefix(_seq("q", [1, 2, 3, 4, 5])) == [first]

    # a hit on a cached free block takes it off the free list: it must fit among the free ones
    c = _seq("c", [1, 2, 9])
    assert bm.cached_prefix(c) == [first] and bm.num_free == 1
    assert not bm.can_admit(c, [first], c.num_tokens)  # 1 revived + 1 new > 1 free
    assert bm.can_admit(c, [first], 2)
    b.num_computed_tokens = b.num_tokens
    bm.free(b)
    bm.admit(c, [first], c.num_tokens)
    assert c.block_table[0] == first and bm.ref_count(first) == 1 and bm.num_used == 2
    bm.free(c)
    assert bm.num_used == 0


def test_blocks_holding_nothing_cached_are_reused_before_cached_ones() -> None:
    bm = BlockManager(num_blocks=4, block_size=2)
    x = _seq("x", [1, 2, 3, 4])  # two cached blocks
    y = _seq("y", [7, 8, 9])  # one cached block, one partial
    _compute_all(bm, x)
    _compute_all(bm, y)
    y_partial = y.block_table[1]
    bm.free(x)
    bm.free(y)  # y's partial block is freed last, yet it is the one taken first
    assert bm.num_cached == 3
    z = _seq("z", [50])
    bm.admit(z, bm.cached_prefix(z), 1)
    assert z.block_table == [y_partial]
    assert bm.num_cached == 3  # no cached block was overwritten
    assert len(bm.cached_prefix(_seq("x again", [1, 2, 3, 4, 0]))) == 2


def test_a_popular_prefix_survives_while_cold_blocks_are_evicted() -> None:
    bm = BlockManager(num_blocks=8, block_size=2)
    system = [100, 101, 102, 103]  # two blocks every request starts with
    for i in range(20):
        s = _seq(f"r{i}", system + [i, i + 1, i + 2])
        shared = _compute_all(bm, s)
        if i:
            assert len(shared) == 2  # the system prompt stays cached: it is freed last each time
        bm.free(s)
    assert bm.num_used == 0 and bm.num_cached <= bm.num_blocks
    assert (bm.prefix_cache_hits, bm.prefix_cache_queries) == (19 * 4, 20 * 7)


# --- collision guard -------------------------------------------------------------------------------


def test_a_hash_collision_never_serves_another_prefix() -> None:
    def constant(parent: bytes, tokens: bytes) -> bytes:
        return b"same"

    bm = BlockManager(num_blocks=8, block_size=2, block_hasher=constant)
    _compute_all(bm, _seq("a", [1, 2, 3]))
    assert bm.cached_prefix(_seq("b", [9, 9, 3])) == []  # equal hash, other tokens: a miss
    assert len(bm.cached_prefix(_seq("c", [1, 2, 3]))) == 1

    def tokens_only(parent: bytes, tokens: bytes) -> bytes:  # forgets the prefix
        return tokens

    bm = BlockManager(num_blocks=16, block_size=2, block_hasher=tokens_only)
    other = _seq("other", [9, 9, 5, 6, 0])
    _compute_all(bm, other)  # registers [9 9] and, after it, [5 6]
    mine = _seq("mine", [1, 2, 5, 6, 0])
    shared = _compute_all(bm, mine)  # [1 2] is new; its [5 6] collides with other's
    assert shared == []
    again = _seq("again", [1, 2, 5, 6, 0])
    # [1 2] hits; [5 6] names other's block, whose parent is [9 9], not [1 2]: refused
    assert bm.cached_prefix(again) == mine.block_table[:1]


def test_the_index_gives_the_garbage_collector_nothing_to_track() -> None:
    """Thousands of cached blocks add no container objects for the collector to walk: a full
    collection in the engine process would otherwise stall steps as the cache fills."""
    bm = BlockManager(num_blocks=4096, block_size=4)
    seqs = [_seq(f"s{i}", list(range(i * 64, i * 64 + 64)) + [1]) for i in range(60)]
    for seq in seqs[:1]:
        _compute_all(bm, seq)
    gc.collect()
    tracked = len(gc.get_objects())
    for seq in seqs[1:]:
        _compute_all(bm, seq)
    gc.collect()
    assert bm.num_cached >= 59 * 16
    assert len(gc.get_objects()) - tracked < 59 * 4  # a few per sequence (its lists), none per block


# --- disabled -------------------------------------------------------------------------------------


def test_disabled_prefix_caching_shares_nothing_and_keeps_fifo_reuse() -> None:
    bm = BlockManager(num_blocks=6, block_size=2, enable_prefix_caching=False)
    assert not bm.enable_prefix_caching
    a = _seq("a", [1, 2, 3, 4, 5])
    _compute_all(bm, a)
    assert a.block_table == [0, 1, 2] and a.block_hashes == [] and bm.num_cached == 0
    bm.free(a)
    b = _seq("b", [1, 2, 3, 4, 5])
    assert bm.cached_prefix(b) == []
    _compute_all(bm, b)
    assert b.block_table == [3, 4, 5]  # freed blocks go to the back, in table order
    c = _seq("c", [1, 2, 3, 4, 5])
    _compute_all(bm, c)
    assert c.block_table == [0, 1, 2]
    assert (bm.prefix_cache_queries, bm.prefix_cache_hits) == (0, 0)


# --- the scheduler, driven by hand ---------------------------------------------------------------


def _check_blocks(bm: BlockManager, sched: Scheduler, plan: SchedulerOutput) -> None:
    """Every block's ref count is the number of running sequences holding it, and every token a
    step computes goes into a block held by its sequence alone."""
    holders = [0] * bm.num_blocks
    for seq in sched.running:
        for block in seq.block_table:
            holders[block] += 1
    assert [bm.ref_count(b) for b in range(bm.num_blocks)] == holders
    assert bm.num_used == sum(1 for h in holders if h)
    assert all(not s.block_table for s in sched.waiting)
    for s in plan.scheduled:
        first, last = s.seq.num_computed_tokens, s.seq.num_computed_tokens + s.num_new_tokens - 1
        for index in range(first // bm.block_size, last // bm.block_size + 1):
            assert bm.ref_count(s.seq.block_table[index]) == 1


def _advance(plan: SchedulerOutput) -> None:
    for s in plan.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
        if s.seq.num_computed_tokens == s.seq.num_tokens:
            s.seq.output_token_ids.append(7 + len(s.seq.output_token_ids))


def test_scheduler_admits_after_the_cached_prefix() -> None:
    bm = BlockManager(num_blocks=32, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=8)
    a = _seq("a", list(range(1, 15)))
    sched.add(a)
    for _ in range(2):  # 8 + 6 prompt tokens
        _advance(sched.schedule())
    b = _seq("b", list(range(1, 15)) + [90])
    sched.add(b)
    plan = sched.schedule()
    # a decodes; b shares a's three full blocks (the third completed by a's last chunk) and
    # prefills only its last 3 tokens
    assert [(s.seq.request_id, s.num_new_tokens) for s in plan.scheduled] == [("a", 1), ("b", 3)]
    assert b.num_computed_tokens == 12 and b.block_table[:3] == a.block_table[:3]
    _check_blocks(bm, sched, plan)
    assert bm.prefix_cache_hits == 12


def test_blocks_completed_by_the_last_step_are_cached_when_a_sequence_leaves() -> None:
    bm = BlockManager(num_blocks=16, block_size=4)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64)
    finished, aborted = _seq("finished", list(range(1, 9))), _seq("aborted", list(range(20, 32)))
    sched.add(finished)
    sched.add(aborted)
    _advance(sched.schedule())  # both prompts computed in one step, never scheduled again
    assert bm.num_cached == 0  # registration happens at the next schedule() ...
    sched.remove(finished)
    sched.remove(aborted)  # ... or when the blocks are given back
    assert bm.num_cached == 2 + 3 and bm.num_used == 0
    assert len(bm.cached_prefix(_seq("again", list(range(1, 9)) + [0]))) == 2
    assert len(bm.cached_prefix(_seq("again", list(range(20, 32)) + [0]))) == 3


def test_scheduler_preemption_and_aborts_with_shared_blocks_leak_nothing() -> None:
    bm = BlockManager(num_blocks=12, block_size=4)  # the longest sequence (22 + 10) needs 8 blocks
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=12)
    rng = random.Random(0)
    system = [rng.randrange(100, 200) for _ in range(13)]
    params = SamplingParams(max_tokens=10, temperature=0.0)
    seqs = [_seq(f"s{i}", system + [rng.randrange(100, 200) for _ in range(n)], params)
            for i, n in enumerate([3, 9, 0, 5, 1, 7])]
    for s in seqs:
        sched.add(s)
    steps = preempted = 0
    aborted = seqs[4]
    while sched.has_work:
        steps += 1
        assert steps < 300
        plan = sched.schedule()
        preempted += plan.num_preempted
        _check_blocks(bm, sched, plan)
        assert sum(s.num_new_tokens for s in plan.scheduled) <= 12
        _advance(plan)
        if steps == 6 and aborted in sched.running:
            sched.remove(aborted)
        for s in list(sched.running):
            if len(s.output_token_ids) >= s.params.max_tokens:
                sched.remove(s)
    assert bm.num_used == 0 and bm.num_free == bm.num_blocks
    assert preempted > 0 and bm.prefix_cache_hits > 0
    assert all(len(s.output_token_ids) == 10 for s in seqs if s is not aborted)


# --- real engines on a tiny random-weight model ----------------------------------------------------

BLOCK = 4
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("prefix-cache") / "tiny")


@pytest.fixture(scope="module")
def tokenizer(tiny_folder: Path) -> Tokenizer:
    return Tokenizer.from_folder(tiny_folder)


EngineFactory = Callable[..., LLMEngine]


@pytest.fixture(scope="module")
def make_engine(tiny_folder: Path, tokenizer: Tokenizer) -> EngineFactory:
    bytes_per_block = KVCacheLayout.of(load_model_config(tiny_folder), torch.float32, BLOCK).bytes_per_block

    def build(caching: bool, num_blocks: int = 512, max_model_len: int = 256, budget: int = 1024) -> LLMEngine:
        engine = local_engine(
            tiny_folder, dtype="float32", block_size=BLOCK, max_model_len=max_model_len,
            kv_cache_memory_gb=(num_blocks + 0.5) * bytes_per_block / 2**30,
            max_num_batched_tokens=budget, enable_prefix_caching=caching,
        )
        assert engine.block_manager.num_blocks == num_blocks
        assert engine.block_manager.enable_prefix_caching is caching
        return engine

    return build


@pytest.fixture(scope="module")
def plain(make_engine: EngineFactory) -> LLMEngine:
    """Caching off: the reference every cached run must match."""
    return make_engine(caching=False)


Reply = tuple[list[int], list[float]]  # greedy tokens, their logprobs


def _collect(outputs: list[RequestOutput], replies: dict[str, Reply]) -> None:
    for out in outputs:
        tokens, logprobs = replies.setdefault(out.request_id, ([], []))
        tokens.extend(out.new_token_ids)
        logprobs.extend(lp.logprob for lp in out.new_logprobs or ())


def _alone(engine: LLMEngine, prompt: list[int], params: SamplingParams = GREEDY) -> Reply:
    replies: dict[str, Reply] = {}
    engine.add_request("alone", prompt, params)
    while engine.has_work:
        _collect(engine.step(), replies)
    assert engine.stats().kv_blocks_used == 0
    return replies["alone"]


def _assert_same(got: Reply, want: Reply) -> None:
    assert got[0] == want[0]
    assert got[1] == pytest.approx(want[1], abs=1e-4)


@pytest.fixture(scope="module")
def shared_prefix() -> list[int]:
    rng = random.Random(1)
    return [rng.randrange(3, 49152) for _ in range(37)]  # 9 full blocks and one token


def _tail(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 49152) for _ in range(n)]


def test_sequential_prompts_match_uncached_outputs_and_hit_what_they_should(
    make_engine: EngineFactory, plain: LLMEngine, shared_prefix: list[int]
) -> None:
    engine = make_engine(caching=True)
    bm = engine.block_manager
    p0 = shared_prefix + _tail(10, 5)  # 42 tokens
    o0 = _alone(plain, p0)[0]
    cases = [
        ("first", p0, 0),
        ("same system prompt, other question", shared_prefix + _tail(11, 11), 36),
        ("entirely cached, 8 full blocks", shared_prefix[:32], 28),  # the last block is recomputed
        ("cached but for its last token", shared_prefix[:33], 32),  # a one-token (decode) step
        ("a repeat", p0, 40),
        ("continues first's output", p0 + o0[:10] + _tail(12, 3), 52),  # 42 + 12 tokens computed
    ]
    for name, prompt, expected_hits in cases:
        hits_before, queries_before = bm.prefix_cache_hits, bm.prefix_cache_queries
        _assert_same(_alone(engine, prompt), _alone(plain, prompt))
        assert bm.prefix_cache_hits - hits_before == expected_hits, name
        assert bm.prefix_cache_queries - queries_before == len(prompt), name
    assert engine.stats().kv_blocks_used == 0 and bm.num_cached > 0
    assert (plain.block_manager.prefix_cache_queries, plain.block_manager.num_cached) == (0, 0)


def test_concurrent_requests_share_the_blocks_of_running_ones(
    make_engine: EngineFactory, plain: LLMEngine, shared_prefix: list[int]
) -> None:
    engine = make_engine(caching=True, budget=16)  # prompts are chunked as well
    bm = engine.block_manager
    long_run = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    p0 = shared_prefix + _tail(20, 5)
    o0 = _alone(plain, p0, long_run)[0]
    later = {
        "b": shared_prefix + _tail(21, 7),
        "c": shared_prefix[:32],
        "d": shared_prefix[:33],
        "e": p0 + o0[:10] + _tail(22, 2),  # a prefix still being generated by the running "a"
    }
    expected = {"a": _alone(plain, p0, long_run)} | {rid: _alone(plain, p) for rid, p in later.items()}

    max_shared = 0
    real_schedule = engine.scheduler.schedule

    def checked_schedule(**kwargs) -> SchedulerOutput:
        nonlocal max_shared
        plan = real_schedule(**kwargs)
        _check_blocks(bm, engine.scheduler, plan)
        max_shared = max([max_shared] + [bm.ref_count(b) for s in engine.scheduler.running for b in s.block_table])
        return plan

    engine.scheduler.schedule = checked_schedule  # type: ignore[method-assign]
    replies: dict[str, Reply] = {}
    engine.add_request("a", p0, long_run)
    steps = 0
    while engine.has_work:
        steps += 1
        assert steps < 500
        a_out = len(replies.get("a", ([], []))[0])
        if a_out == 2:  # a's prompt is computed: b, c and d arrive while it decodes
            for rid in ("b", "c", "d"):
                if rid not in replies and rid not in engine.sequences:
                    engine.add_request(rid, later[rid], GREEDY)
        if a_out == 12 and "e" not in engine.sequences and "e" not in replies:
            engine.add_request("e", later["e"], GREEDY)
        _collect(engine.step(), replies)
    for rid, want in expected.items():
        _assert_same(replies[rid], want)
    assert max_shared >= 4  # a's first blocks were held by a, b, c and d at once
    assert engine.stats().kv_blocks_used == 0
    assert bm.prefix_cache_hits == 36 + 28 + 32 + 52  # b, c, d, e as when run one at a time


def test_a_tiny_cache_evicts_and_preempts_yet_outputs_match(
    make_engine: EngineFactory, plain: LLMEngine, shared_prefix: list[int]
) -> None:
    engine = make_engine(caching=True, num_blocks=16, max_model_len=64, budget=16)
    bm = engine.block_manager
    first = _tail(30, 21)
    _assert_same(_alone(engine, first), _alone(plain, first))
    assert len(bm.cached_prefix(_seq("probe", first + [5]))) == 5

    prompts = {f"r{i}": shared_prefix[:20] + _tail(40 + i, 2 + 3 * i) for i in range(5)}
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=0)
    expected = {rid: _alone(plain, p, params) for rid, p in prompts.items()}
    preemptions = engine.stats().num_preemptions
    replies: dict[str, Reply] = {}
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    while engine.has_work:
        _collect(engine.step(), replies)
    for rid, want in expected.items():
        _assert_same(replies[rid], want)
    stats = engine.stats()
    assert stats.num_preemptions > preemptions, "16 blocks for five growing sequences must preempt"
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0
    assert bm.prefix_cache_hits > 0 and bm.num_cached <= bm.num_blocks
    # the busy run overwrote the first prompt's blocks; it still gives the same answer
    assert len(bm.cached_prefix(_seq("probe", first + [5]))) < 5
    _assert_same(_alone(engine, first), _alone(plain, first))
