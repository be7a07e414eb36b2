"""Greedy bursts planned by the scheduler and block manager (not the engine): how many decode
iterations the device may run in one go, block tables grown for them, when a burst may be followed
by the next one, and the prefix cache's registration while a step runs."""

from __future__ import annotations

import pytest

from ferrum.engine.block_manager import BlockManager
from ferrum.engine.sampling_params import SamplingParams
from ferrum.engine.scheduler import BurstLimits, Scheduler
from ferrum.engine.sequence import Sequence

EOS = 99
GREEDY = SamplingParams(max_tokens=50, temperature=0.0)


def _decoding(rid: str, prompt: int = 5, params: SamplingParams = GREEDY) -> Sequence:
    return Sequence(rid, list(range(1, prompt + 1)), params, 0.0)


def _scheduler(num_blocks: int = 64, max_steps: int = 8, max_num_seqs: int = 4, max_model_len: int = 200,
               full_from: int = 0) -> Scheduler:
    bm = BlockManager(num_blocks, 4, enable_prefix_caching=False)
    return Scheduler(bm, max_num_seqs, 256, BurstLimits(max_steps, max_model_len, frozenset({EOS}), full_from))


def _running(sched: Scheduler, *seqs: Sequence) -> None:
    """Puts `seqs` in the running set, their prompts computed and a first token sampled (as after
    their prefill step): each now decodes from one uncomputed token."""
    for seq in seqs:
        sched.add(seq)
    plan = sched.schedule()
    for s in plan.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
        s.seq.output_token_ids.append(7)


def test_greedy_decodes_run_in_bursts_with_their_blocks_grown() -> None:
    sched = _scheduler()
    a, b = _decoding("a"), _decoding("b")
    _running(sched, a, b)
    plan = sched.schedule()
    assert plan.burst == 8 and [s.seq for s in plan.scheduled] == [a, b]
    for seq in (a, b):  # room for the burst's 8 new tokens, from position num_computed_tokens
        assert len(seq.block_table) * 4 >= seq.num_computed_tokens + 8
    assert sched.extend_burst([a, b], ahead=8) == 8  # the next burst, behind this one
    assert len(a.block_table) * 4 >= a.num_computed_tokens + 16


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=50, temperature=0.7),
        SamplingParams(max_tokens=50, temperature=0.0, logprobs=2),
        SamplingParams(max_tokens=50, temperature=0.0, repetition_penalty=1.2),
        SamplingParams(max_tokens=50, temperature=0.0, presence_penalty=0.5),
    ],
    ids=["sampled", "logprobs", "repetition", "presence"],
)
def test_a_sequence_the_host_must_sample_keeps_the_batch_to_single_steps(params: SamplingParams) -> None:
    sched = _scheduler()
    _running(sched, _decoding("a"), _decoding("b", params=params))
    assert sched.schedule().burst == 0


def test_a_runner_without_bursts_gets_none() -> None:
    sched = _scheduler(max_steps=0)
    _running(sched, _decoding("a"))
    assert sched.schedule().burst == 0


def test_a_request_waiting_for_a_free_slot_keeps_bursts_to_one_iteration() -> None:
    sched = _scheduler()
    _running(sched, _decoding("a"))
    sched.add(Sequence("w", [1, 2, 3], GREEDY, 0.0))
    plan = sched.schedule()
    assert plan.burst == 0 and len(plan.scheduled) == 2  # the waiting request is admitted: a mixed step
    assert sched.schedule().burst == 0  # w's first decode needs its prefill's token first
    full = _scheduler(max_num_seqs=1)
    _running(full, _decoding("a"))
    full.add(Sequence("w", [1, 2, 3], GREEDY, 0.0))  # waits for a slot no burst frees: bursts go on
    assert full.schedule().burst == 8


def test_bursts_stop_at_length_limits_and_at_the_free_blocks() -> None:
    sched = _scheduler(max_model_len=12)
    a = _decoding("a", params=SamplingParams(max_tokens=4, temperature=0.0))  # one output so far: 3 to go
    _running(sched, a)
    assert sched.schedule().burst == 3
    tight = _scheduler(max_model_len=8)
    _running(tight, _decoding("b"))  # 5 positions computed: 5, 6 and 7 are the last below the limit
    assert tight.schedule().burst == 3
    starved = _scheduler(num_blocks=2)  # the prompt's two blocks are all there is
    _running(starved, _decoding("c", prompt=6))
    assert starved.schedule().burst == 1 and starved.extend_burst(starved.running, ahead=1) == 0


def test_a_large_batch_runs_whole_bursts_past_a_sequence_s_max_tokens() -> None:
    """From `full_from` sequences a burst is not cut short at max_tokens (the finished rows ride along),
    still never past max_model_len; a smaller batch's is."""
    short = SamplingParams(max_tokens=4, temperature=0.0)  # one output so far: 3 to go
    sched = _scheduler(full_from=2, max_model_len=12)
    a, b = _decoding("a", params=short), _decoding("b")
    _running(sched, a, b)
    assert sched.schedule().burst == 7  # 5 positions computed: 5..11 are below max_model_len 12
    assert len(a.block_table) * 4 >= a.num_computed_tokens + 7  # grown for the rows it rides along
    alone = _scheduler(full_from=2)
    _running(alone, _decoding("c", params=short))
    assert alone.schedule().burst == 3  # one sequence: below full_from


def test_a_burst_is_followed_only_when_no_sequence_can_have_stopped() -> None:
    sched = _scheduler()
    a, b = _decoding("a"), _decoding("b", params=SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    _running(sched, a, b)
    # rows: [iteration][sequence]
    assert sched.burst_continues([a, b], [[1, 2], [3, 4]])
    assert not sched.burst_continues([a, b], [[1, 2], [EOS, 4]])  # a met EOS
    assert sched.burst_continues([a, b], [[1, EOS], [3, 4]])  # b ignores EOS
    sched.add(Sequence("w", [1, 2, 3], GREEDY, 0.0))
    assert not sched.burst_continues([a, b], [[1, 2], [3, 4]])  # a request waits for a free slot
    stopping = _decoding("c", params=SamplingParams(max_tokens=50, temperature=0.0, stop_token_ids=(5,)))
    strings = _decoding("d", params=SamplingParams(max_tokens=50, temperature=0.0, stop=("x",)))
    short = _decoding("e", params=SamplingParams(max_tokens=3, temperature=0.0))
    other = _scheduler()
    _running(other, stopping, strings, short)
    assert not other.burst_continues([stopping], [[5]])
    assert not other.burst_continues([strings], [[1]])  # stop strings need the text
    assert not other.burst_continues([short], [[1], [2]])  # at max_tokens after them
    assert other.burst_continues([short], [[1]])


def test_computed_blocks_are_registered_while_the_step_runs() -> None:
    """register_computed (called right after the runner launched a step) offers the full blocks
    the step computes to the prefix cache at once, not at the next schedule()."""
    bm = BlockManager(32, 4)
    sched = Scheduler(bm, 4, 256)
    seq = Sequence("a", list(range(1, 11)), GREEDY, 0.0)
    sched.add(seq)
    plan = sched.schedule()
    for s in plan.scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
    assert bm.num_cached == 0
    sched.register_computed([seq])
    assert bm.num_cached == 2  # 10 tokens: two full blocks of 4
