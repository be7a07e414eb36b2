"""The event-loop side shared by both engine clients: one asyncio.Queue per request, fed with the
engine's deltas, read by `generate`. Subclasses say how a command reaches the engine (`_send`).

Request ids: the engine sees a unique id per request (the caller's id plus a counter), so a caller
may reuse its id as soon as its stream ends, while the old request's abort and last outputs are
still on their way: those are addressed to the old engine id and dropped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator

from ferrum.engine.engine_loop import AbortRequest, AddRequest
from ferrum.engine.limits import RequestLimits
from ferrum.engine.llm_engine import EngineStats
from ferrum.engine.outputs import RequestOutput, merge_outputs
from ferrum.engine.sampling_params import SamplingParams
from ferrum.models.loader import WeightLoadReport
from ferrum.tokenizer import Tokenizer


class EngineDeadError(RuntimeError):
    """The engine stopped (shut down, a failed step, or its process died); requests fail with it."""


class RequestStreams(ABC):
    def __init__(
        self,
        tokenizer: Tokenizer,
        limits: RequestLimits,
        stats: EngineStats,
        weight_load: WeightLoadReport | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.weight_load = weight_load
        self._stats = stats
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}  # by engine id
        self._engine_ids: dict[str, str] = {}  # caller's request id -> engine id of its live request
        self._counter = itertools.count()
        self._error: BaseException | None = None
        self._died = asyncio.Event()  # the engine stopped by itself (not by shutdown)

    @abstractmethod
    def _send(self, command: AddRequest | AbortRequest) -> None:
        """Hands a command to the engine without blocking the event loop for long."""

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    def stats(self) -> EngineStats:
        return self._stats

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """The request's deltas. A reader slower than the engine gets the deltas that piled up
        merged into one, so it is never more than one item behind. Closing the generator before
        the request finished aborts it. Raises PromptTooLongError or ValueError (RequestLimits)."""
        self.limits.check(prompt_token_ids, params.max_tokens)
        if request_id in self._engine_ids:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self._error is not None:
            raise EngineDeadError(f"the engine is not running: {self._error}")
        engine_id = f"{request_id}#{next(self._counter)}"
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._engine_ids[request_id] = engine_id
        self._queues[engine_id] = outputs
        finished = False
        try:
            self._send(AddRequest(engine_id, list(prompt_token_ids), params, priority))
            while True:
                pending = [await outputs.get()]
                while not outputs.empty():
                    pending.append(outputs.get_nowait())
                error = next((item for item in pending if isinstance(item, BaseException)), None)
                deltas = [item for item in pending if isinstance(item, RequestOutput)]
                if deltas:
                    merged = merge_outputs(deltas)
                    yield dataclasses.replace(merged, request_id=request_id)
                    if merged.finished:
                        finished = True
                        return
                if error is not None:
                    raise error
        finally:
            self._queues.pop(engine_id, None)
            self._engine_ids.pop(request_id, None)
            if not finished and self._error is None:
                self._send(AbortRequest(engine_id))

    async def abort(self, request_id: str) -> None:
        engine_id = self._engine_ids.get(request_id)
        if engine_id is not None:
            self._send(AbortRequest(engine_id))

    # -- called on the event loop with what the engine sent ---------------------------------------
    def _deliver(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        self._stats = stats
        for out in outputs:
            target = self._queues.get(out.request_id)
            if target is not None:
                target.put_nowait(out)

    async def wait_dead(self) -> BaseException:
        """Returns why, once the engine stopped by itself (a failed step, its process or a
        tensor-parallel rank gone); never after a shutdown()."""
        await self._died.wait()
        assert self._error is not None
        return self._error

    def _fail_all(self, error: BaseException, by_shutdown: bool = False) -> None:
        if self._error is None and not by_shutdown:
            self._died.set()
        self._error = self._error or error
        for target in self._queues.values():  # wake every caller still reading
            target.put_nowait(error)
