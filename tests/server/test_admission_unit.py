"""Admission control without a model: limits on requests and waiting prompt tokens, refusals with
Retry-After, deadlines and the shutdown that end tickets, and the engine's priority queue."""

from __future__ import annotations

import asyncio

import pytest

from ferrum.config.server_settings import LimitsConfig
from ferrum.engine.block_manager import BlockManager
from ferrum.engine.sampling_params import SamplingParams
from ferrum.engine.scheduler import Scheduler
from ferrum.engine.sequence import Sequence
from ferrum.server.admission import Admission
from ferrum.server.errors import APIError


def make(limits: LimitsConfig, running: int = 2) -> tuple[Admission, list[str], list[str]]:
    aborted: list[str] = []
    rejected: list[str] = []
    return Admission(limits, lambda: running, aborted.append, rejected.append), aborted, rejected


async def test_requests_past_running_plus_waiting_are_refused_with_retry_after() -> None:
    admission, _, rejected = make(LimitsConfig(max_waiting_requests=3, retry_after_s=2))
    tickets = [admission.admit([f"r{i}"], [10], arrived=0.0) for i in range(5)]  # 2 running + 3 waiting
    with pytest.raises(APIError) as info:
        admission.admit(["r5"], [10], arrived=0.0)
    assert info.value.status_code == 429 and info.value.headers == {"Retry-After": "2"}
    assert info.value.code == "server_overloaded" and "limit is 5" in info.value.message
    assert rejected == ["max_requests"]
    admission.release(tickets[0])
    with pytest.raises(APIError):  # n counts: a request of 2 choices needs 2 places, 1 is free
        admission.admit(["a", "b"], [1, 1], arrived=0.0)
    admission.release(tickets[1])
    admission.admit(["a", "b"], [1, 1], arrived=0.0)  # now they fit
    assert admission.in_flight == 5


async def test_waiting_prompt_tokens_are_limited_and_leave_the_count_when_started() -> None:
    admission, _, rejected = make(LimitsConfig(max_waiting_tokens=100, overload_status=503))
    first = admission.admit(["a"], [60], arrived=0.0)
    with pytest.raises(APIError) as info:
        admission.admit(["b"], [50], arrived=0.0)
    assert info.value.status_code == 503 and "Retry-After" in (info.value.headers or {})
    assert rejected == ["max_waiting_tokens"]
    first.started(0)  # its first output: no longer waiting
    assert admission.waiting_tokens == 0
    admission.admit(["b"], [50], arrived=0.0)


async def test_a_deadline_ends_the_ticket_and_aborts_its_engine_requests() -> None:
    admission, aborted, _ = make(LimitsConfig(request_timeout_s=0.05))
    default = admission.admit(["x-0", "x-1"], [1, 1], arrived=0.0)
    own = admission.admit(["y"], [1], arrived=0.0, timeout_s=10.0)  # its own timeout wins over the default
    await asyncio.sleep(0.2)
    assert default.end_reason == "deadline" and aborted == ["x-0", "x-1"]
    error = default.end_error()
    assert error is not None and error.status_code == 408 and error.code == "request_timeout"
    assert "0.05 s" in error.message
    assert own.end_reason is None and own.end_error() is None
    admission.release(own)
    admission.release(default)


async def test_drain_waits_for_admitted_work_then_ends_the_rest() -> None:
    admission, aborted, rejected = make(LimitsConfig())
    quick = admission.admit(["quick"], [1], arrived=0.0)
    slow = admission.admit(["slow"], [1], arrived=0.0)
    admission.close("shutting_down")
    with pytest.raises(APIError) as info:
        admission.admit(["new"], [1], arrived=0.0)
    assert info.value.status_code == 503 and info.value.code == "server_shutting_down"
    assert rejected == ["shutting_down"]

    async def handlers() -> None:
        await asyncio.sleep(0.05)
        admission.release(quick)  # finishes within the timeout
        while slow.end_reason is None:
            await asyncio.sleep(0.01)
        admission.release(slow)  # its stream ended once aborted

    task = asyncio.create_task(handlers())
    ended = await admission.drain(0.3)
    await task
    assert ended == 1 and aborted == ["slow"] and quick.end_reason is None
    error = slow.end_error()
    assert error is not None and error.status_code == 503 and "shutting down" in error.message
    assert admission.in_flight == 0


def test_the_engine_admits_lower_priority_values_first() -> None:
    scheduler = Scheduler(BlockManager(64, 4, enable_prefix_caching=False), max_num_seqs=1, max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=1)
    seqs = {name: Sequence(name, [1, 2], params, float(i), priority=p)
            for i, (name, p) in enumerate([("a", 0), ("b", 5), ("c", -1), ("d", 0), ("e", 5)])}
    for seq in seqs.values():
        scheduler.add(seq)
    assert [s.request_id for s in scheduler.waiting] == ["c", "a", "d", "b", "e"]  # then arrival order
    out = scheduler.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["c"]
    assert seqs["c"].first_scheduled is not None
