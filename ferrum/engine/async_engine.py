"""The engine behind the HTTP server: an asyncio front over LLMEngine.

LLMEngine lives on one dedicated thread that steps it back to back while it has
work, so the model never waits for the event loop (and the event loop never waits
for the model; torch releases the GIL while it computes). The event loop sends
new requests and aborts through a thread-safe inbox; each step's deltas come back
with `call_soon_threadsafe` and reach their callers through per-request
asyncio.Queues.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator
from typing import Union

from ferrum.engine.llm_engine import EngineStats, LLMEngine, PromptTooLongError
from ferrum.engine.outputs import RequestOutput
from ferrum.engine.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "EngineDeadError", "EngineStats", "PromptTooLongError"]

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    pass


@dataclasses.dataclass(frozen=True)
class _Add:
    engine_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclasses.dataclass(frozen=True)
class _Abort:
    engine_id: str


class _Stop:
    pass


_Command = Union[_Add, _Abort, _Stop]


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self._inbox: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}  # by engine id
        self._engine_ids: dict[str, str] = {}  # caller's request id -> engine id of its live request
        self._counter = itertools.count()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stats = engine.stats()
        self._error: BaseException | None = None

    async def start(self) -> None:
        if self._thread is None:
            self._loop = asyncio.get_running_loop()
            self._thread = threading.Thread(target=self._run, name="ferrum-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        if self._thread is not None:
            self._inbox.put(_Stop())
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)
            self._thread = None
        self._fail_all(EngineDeadError("the engine was shut down"))

    def is_ready(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._error is None

    def stats(self) -> EngineStats:
        return self._stats

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        self.engine.check_length(len(prompt_token_ids), params.max_tokens)
        if request_id in self._engine_ids:
            raise ValueError(f"request id {request_id!r} is already in use")
        if self._error is not None:
            raise EngineDeadError(f"the engine is not running: {self._error}")
        # The engine sees a unique id: a caller may reuse its id as soon as its stream ends, while
        # the old request's abort and last outputs are still on their way.
        engine_id = f"{request_id}#{next(self._counter)}"
        outputs: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._engine_ids[request_id] = engine_id
        self._queues[engine_id] = outputs
        self._inbox.put(_Add(engine_id, list(prompt_token_ids), params))
        finished = False
        try:
            while True:
                item = await outputs.get()
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
                self._inbox.put(_Abort(engine_id))

    async def abort(self, request_id: str) -> None:
        engine_id = self._engine_ids.get(request_id)
        if engine_id is not None:
            self._inbox.put(_Abort(engine_id))

    # -- event-loop side of the hand-over ---------------------------------------
    def _deliver(self, outputs: list[RequestOutput], stats: EngineStats) -> None:
        self._stats = stats
        for out in outputs:
            target = self._queues.get(out.request_id)
            if target is not None:
                target.put_nowait(out)

    def _fail_all(self, error: BaseException) -> None:
        self._error = self._error or error
        for target in self._queues.values():  # wake every caller still reading
            target.put_nowait(error)

    # -- the engine thread ----------------------------------------------------------
    def _run(self) -> None:
        assert self._loop is not None
        loop = self._loop
        try:
            while True:
                # block for commands only when idle; otherwise take what has arrived and step
                command: _Command | None = self._inbox.get() if not self.engine.has_work else None
                finals: list[RequestOutput] = []
                while True:
                    if command is None:
                        try:
                            command = self._inbox.get_nowait()
                        except queue.Empty:
                            break
                    if isinstance(command, _Stop):
                        return
                    finals.extend(self._apply(command))
                    command = None
                outputs = self.engine.step() if self.engine.has_work else []
                loop.call_soon_threadsafe(self._deliver, finals + outputs, self.engine.stats())
        except Exception as exc:  # the model failed: fail every waiting request; health reports it
            log.exception("engine step failed")
            loop.call_soon_threadsafe(self._fail_all, EngineDeadError(f"engine step failed: {exc}"))

    def _apply(self, command: _Add | _Abort) -> list[RequestOutput]:
        if isinstance(command, _Abort):
            aborted = self.engine.abort_request(command.engine_id)
            # the final "abort" delta ends the stream of a caller still reading (abort())
            return [aborted] if aborted is not None else []
        try:
            self.engine.add_request(command.engine_id, command.prompt_token_ids, command.params)
        except ValueError as exc:
            log.warning("request %s rejected: %s", command.engine_id, exc)
            return [RequestOutput(command.engine_id, "", (), None, True, "abort", len(command.prompt_token_ids), 0)]
        return []
