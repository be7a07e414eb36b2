"""Running engine requests: one Job per choice, their outputs merged as they come, collected for
non-streaming responses, and aborted when the client goes away."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Sequence
from contextlib import aclosing
from typing import TypeVar

import anyio
from fastapi import Request

from ferrum.engine.async_engine import EngineClient
from ferrum.engine.limits import PromptTooLongError
from ferrum.engine.outputs import FinishReason, RequestOutput, TokenLogprob
from ferrum.engine.sampling_params import SamplingParams
from ferrum.server.admission import Ticket
from ferrum.server.errors import APIError, bad_request, internal_error
from ferrum.server.metrics import ServerMetrics

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Job:
    """One engine request: one choice of the response."""

    index: int
    prompt_index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclasses.dataclass
class ChoiceResult:
    text: str = ""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # when the job asked for them


async def _next_output(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    return await gen.__anext__()


def _settle(task: asyncio.Task[RequestOutput]) -> None:
    """Marks a finished task's exception as seen so asyncio does not warn about it."""
    if task.done() and not task.cancelled():
        task.exception()


async def run_jobs(
    engine: EngineClient, jobs: Sequence[Job], metrics: ServerMetrics, ticket: Ticket
) -> AsyncGenerator[tuple[Job, RequestOutput], None]:
    """The outputs of all jobs as they come; each is counted in the ticket (`Ticket.handed_on`) once the
    consumer asks for the next. However the consumer stops (return, error, aclose, cancellation), every
    engine generator is closed, which aborts the unfinished requests."""
    gens = [engine.generate(job.request_id, job.prompt_ids, job.params, ticket.priority) for job in jobs]
    pending: dict[asyncio.Task[RequestOutput], int] = {}
    last_token_at: list[float | None] = [None] * len(jobs)

    def observe(i: int, out: RequestOutput) -> None:
        now = time.monotonic()
        ticket.started(i)
        if out.queue_time_s is not None:
            metrics.observe_queue_time(out.queue_time_s)
            ticket.queue_time_s = max(ticket.queue_time_s or 0.0, out.queue_time_s)
        if out.new_token_ids:
            before = last_token_at[i]
            if before is None:
                ticket.first_token_s = ticket.first_token_s or now - ticket.arrived
                metrics.observe_first_token(now - ticket.arrived)
                if len(out.new_token_ids) > 1:
                    metrics.observe_tokens(0.0, len(out.new_token_ids) - 1)
            else:
                metrics.observe_tokens(now - before, len(out.new_token_ids))
            last_token_at[i] = now
        if out.finished:
            ticket.finished(i, out)
            metrics.observe_finished(now - ticket.arrived, out.finish_reason or "stop", out.num_prompt_tokens,
                                     out.num_output_tokens)

    try:
        if len(gens) == 1:
            async for out in gens[0]:
                observe(0, out)
                yield jobs[0], out
                ticket.handed_on(0, out)  # the consumer asks for the next: this one is sent
            return
        pending = {asyncio.create_task(_next_output(g)): i for i, g in enumerate(gens)}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t]):
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                observe(i, out)
                if not out.finished:
                    pending[asyncio.create_task(_next_output(gens[i]))] = i
                yield jobs[i], out
                ticket.handed_on(i, out)
    finally:
        with anyio.CancelScope(shield=True):
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
            for task in pending:
                _settle(task)
            for gen in gens:
                try:
                    await gen.aclose()  # type: ignore[attr-defined]
                except Exception:
                    log.exception("closing an engine request failed")


async def collect(
    engine: EngineClient, jobs: Sequence[Job], metrics: ServerMetrics, ticket: Ticket
) -> list[ChoiceResult]:
    results = [ChoiceResult() for _ in jobs]
    for job, result in zip(jobs, results, strict=True):
        if job.params.logprobs is not None:
            result.logprobs = []
    async with aclosing(run_jobs(engine, jobs, metrics, ticket)) as outputs:
        async for job, out in outputs:
            r = results[job.index]
            r.text += out.new_text
            r.num_prompt_tokens = out.num_prompt_tokens
            r.num_output_tokens = out.num_output_tokens
            if r.logprobs is not None and out.new_logprobs:
                r.logprobs.extend(out.new_logprobs)
            if out.prompt_logprobs is not None:
                r.prompt_logprobs = out.prompt_logprobs
            if out.finished:
                r.finish_reason = out.finish_reason
    return results


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Runs `work`; cancels it (aborting its engine requests) and returns None if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait({task})
    if task.cancelled():
        return None
    return task.result()


def engine_error(exc: BaseException, param: str) -> APIError:
    if isinstance(exc, PromptTooLongError):
        return bad_request(str(exc), param=param, code="context_length_exceeded")
    log.error("request failed", exc_info=exc)
    return internal_error()
