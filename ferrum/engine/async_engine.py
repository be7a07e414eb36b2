"""The engine behind the HTTP server: the EngineClient interface, and AsyncEngine, its in-process form.

The server only knows EngineClient. AsyncEngine runs LLMEngine on one dedicated thread of the
server's process, stepping it back to back while it has work (ferrum.engine.engine_loop), so the
model never waits for the event loop (and the event loop never waits for the model; torch releases
the GIL while it computes). The event loop sends new requests and aborts through a thread-safe
inbox; each step's deltas come back with `call_soon_threadsafe` and reach their callers through
per-request asyncio.Queues (ferrum.engine.request_streams). ProcessEngineClient
(ferrum.engine.process_client) is the other form: the same loop in a process of its own.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator
from typing import Protocol

from ferrum.engine.engine_loop import AbortRequest, AddRequest, Command, StopLoop, run_engine_loop
from ferrum.engine.limits import PromptTooLongError, RequestLimits
from ferrum.engine.llm_engine import EngineStats, LLMEngine
from ferrum.engine.outputs import RequestOutput
from ferrum.engine.request_streams import EngineDeadError, RequestStreams
from ferrum.engine.sampling_params import SamplingParams
from ferrum.models.loader import WeightLoadReport
from ferrum.tokenizer import Tokenizer

__all__ = ["AsyncEngine", "EngineClient", "EngineDeadError", "EngineStats", "PromptTooLongError"]

log = logging.getLogger(__name__)


class EngineClient(Protocol):
    """What the server needs of an engine, wherever the engine runs."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def limits(self) -> RequestLimits:
        """What one request may ask (the same checks the engine makes)."""
        ...

    @property
    def weight_load(self) -> WeightLoadReport | None:
        """How the model's weights were loaded (source kind, bytes, seconds)."""
        ...

    async def start(self) -> None: ...

    async def shutdown(self) -> None:
        """Stops the engine; every request still waiting fails with EngineDeadError. Idempotent."""

    def is_ready(self) -> bool: ...

    async def wait_dead(self) -> BaseException:
        """Returns why, once the engine stopped by itself; never after shutdown()."""
        ...

    def stats(self) -> EngineStats:
        """The engine's stats after its latest step."""

    def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> AsyncIterator[RequestOutput]:
        """The request's deltas (merged when the reader falls behind). Raises PromptTooLongError,
        ValueError for a request id still in use, EngineDeadError when the engine is gone."""

    async def abort(self, request_id: str) -> None: ...


class AsyncEngine(RequestStreams):
    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(engine.tokenizer, engine.limits, engine.stats(), engine.weight_load)
        self.engine = engine
        self._inbox: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._run, name="ferrum-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        if self._thread is not None:
            self._inbox.put(StopLoop())
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
            self._thread = None
        self._fail_all(EngineDeadError("the engine was shut down"), by_shutdown=True)

    def is_ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    def _send(self, command: AddRequest | AbortRequest) -> None:
        self._inbox.put(command)

    # -- the engine thread ----------------------------------------------------------
    def _run(self) -> None:
        assert self._loop is not None
        loop = self._loop

        def next_command(block: bool) -> Command | None:
            if block:
                return self._inbox.get()
            try:
                return self._inbox.get_nowait()
            except queue.Empty:
                return None

        def emit(outputs: list[RequestOutput], stats: EngineStats) -> None:
            loop.call_soon_threadsafe(self._deliver, outputs, stats)

        try:
            run_engine_loop(self.engine, next_command, emit)
        except Exception as exc:  # the model failed: fail every waiting request; health reports it
            log.exception("engine step failed")
            loop.call_soon_threadsafe(self._fail_all, EngineDeadError(f"engine step failed: {exc}"))
