"""The engine behind the HTTP server: an asyncio front over LLMEngine.

All engine state is touched by one worker thread only. The event loop queues
new requests and aborts; a loop task hands them to the worker together with the
next step, so the event loop never waits on the model and the engine never
sees two threads. Each request's deltas reach its caller through an
asyncio.Queue.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

from ferrum.engine.llm_engine import EngineStats, LLMEngine, PromptTooLongError
from ferrum.engine.outputs import RequestOutput
from ferrum.engine.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "EngineStats", "PromptTooLongError"]

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ferrum-engine")
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}  # by engine id
        self._engine_ids: dict[str, str] = {}  # caller's request id -> engine id of its live request
        self._counter = itertools.count()
        self._new: list[tuple[str, list[int], SamplingParams]] = []
        self._aborts: list[str] = []
        self._wake = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self._stats = engine.stats()
        self._error: BaseException | None = None

    async def start(self) -> None:
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._run(), name="ferrum-engine-loop")

    async def shutdown(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            try:
                await self._loop_task
            except asyncio.CancelledError:
                pass
            self._loop_task = None
        self._executor.shutdown(wait=True)
        self._error = self._error or EngineDeadError("the engine was shut down")
        for queue in self._queues.values():  # wake every caller still reading
            queue.put_nowait(EngineDeadError("the engine was shut down"))

    def is_ready(self) -> bool:
        return self._loop_task is not None and not self._loop_task.done() and self._error is None

    def stats(self) -> EngineStats:
        return self._stats

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        self.engine.check_length(len(prompt_token_ids), params.max_tokens)
        if request_id in self._engine_ids:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self._error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self._error}")
        # The engine sees a unique id: a caller may reuse its id as soon as its stream ends, while
        # the old request's abort and last outputs are still on their way.
        engine_id = f"{request_id}#{next(self._counter)}"
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._engine_ids[request_id] = engine_id
        self._queues[engine_id] = queue
        self._new.append((engine_id, list(prompt_token_ids), params))
        self._wake.set()
        finished = False
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield dataclasses.replace(item, request_id=request_id)
                if item.finished:
                    finished = True
                    return
        finally:
            self._queues.pop(engine_id, None)
            self._engine_ids.pop(request_id, None)
            if not finished:
                self._aborts.append(engine_id)
                self._wake.set()

    async def abort(self, request_id: str) -> None:
        engine_id = self._engine_ids.get(request_id)
        if engine_id is not None:
            self._aborts.append(engine_id)
            self._wake.set()

    # -- the loop ---------------------------------------------------------
    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not (self._new or self._aborts or self.engine.has_work):
                self._wake.clear()
                await self._wake.wait()
            new, self._new = self._new, []
            aborts, self._aborts = self._aborts, []
            try:
                outputs, stats = await loop.run_in_executor(self._executor, self._work, new, aborts)
            except Exception as exc:  # the model failed: fail every waiting request, stay up for health to report
                log.exception("engine step failed")
                self._error = exc
                for queue in self._queues.values():
                    queue.put_nowait(EngineDeadError(f"engine step failed: {exc}"))
                return
            self._stats = stats
            for out in outputs:
                queue = self._queues.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)

    def _work(
        self, new: list[tuple[str, list[int], SamplingParams]], aborts: list[str]
    ) -> tuple[list[RequestOutput], EngineStats]:
        rejected: list[RequestOutput] = []
        for request_id, prompt, params in new:
            try:
                self.engine.add_request(request_id, prompt, params)
            except ValueError as exc:
                log.warning("request %s rejected: %s", request_id, exc)
                rejected.append(
                    RequestOutput(request_id, "", (), None, True, "abort", len(prompt), 0)
                )
        for request_id in aborts:
            aborted = self.engine.abort_request(request_id)
            if aborted is not None:  # the final "abort" delta ends the stream of a caller still reading
                rejected.append(aborted)
        outputs = self.engine.step() if self.engine.has_work else []
        return rejected + outputs, self.engine.stats()
