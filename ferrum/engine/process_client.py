"""ProcessEngineClient: the EngineClient whose engine runs in a process of its own.

The engine's Python work (scheduling, sampling, detokenizing) then no longer shares a GIL with the
HTTP server's (parsing, SSE formatting for every stream). The engine process (engine_process.py) is
spawned (never forked: no CUDA context or thread pool of this process goes with it), at launch or,
under `ferrum serve`, before the server's own imports (warm_start.py), and builds LLMEngine itself from
the EngineSpec it is sent first; this side loads the tokenizer from the model's folder for prompts and
chat templates, and checks requests against the limits the engine process reports.

Commands go down one pipe from the event loop. A reader thread receives the engine's messages from
the other and hands them to the event loop with call_soon_threadsafe; the engine's steps, which the
engine process's backend counts, are counted again on this process's backend (`on_operations`), the
one the API reports. When the engine process dies,
the reader sees the pipe close: every waiting request fails with EngineDeadError and is_ready() is
False. Only the event loop's thread touches the Process object (reaping a child from two threads
can lose its exit status).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from ferrum.engine.builder import EngineSpec
from ferrum.engine.engine_loop import AbortRequest, AddRequest, Command, StopLoop
from ferrum.engine.engine_process import (
    Message,
    Ready,
    StartFailed,
    Starting,
    StepFailed,
    Stepped,
)
from ferrum.engine.request_streams import EngineDeadError, RequestStreams
from ferrum.engine.startup import StartupObserver
from ferrum.engine.warm_start import EngineStart, spawn_engine_process, take
from ferrum.tokenizer import Tokenizer

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0  # after StopLoop, before SIGTERM; then as long again before SIGKILL
EXIT_WAIT_S = 5.0  # after the pipe closes: how long the reader waits for the exit code


class ProcessEngineClient(RequestStreams):
    """Made by `launch`, which returns once the engine process is ready."""

    def __init__(
        self,
        process: BaseProcess,
        commands: Connection,
        results: Connection,
        tokenizer: Tokenizer,
        ready: Ready,
        on_operations: Callable[[int], None] | None = None,
    ) -> None:
        super().__init__(tokenizer, ready.limits, ready.stats, ready.weight_load)
        self._process = process
        self._commands = commands
        self._results = results
        self._reader: threading.Thread | None = None
        self._stopping = False
        self._on_operations = on_operations
        self._operations = 0  # the engine process's count, as last reported

    @classmethod
    async def launch(
        cls,
        spec: EngineSpec,
        log_level: int | None = None,
        on_progress: StartupObserver | None = None,
        on_operations: Callable[[int], None] | None = None,
    ) -> ProcessEngineClient:
        """Starts the engine process and waits until its engine is built (`on_progress` hears its
        start-up phases, on this event loop). A failure there raises the same exception here (an
        EngineDeadError if it cannot be carried over), leaving no process behind; so does
        cancelling the wait. `on_operations(n)`: n more engine steps ran (from the reader thread;
        the API process's `ComputeBackend.record_operation`)."""
        level = log_level if log_level is not None else logging.getLogger().getEffectiveLevel()
        started = take() or spawn_engine_process()
        process, commands, results = started.process, started.commands, started.results
        try:
            commands.send(EngineStart(spec, level))
        except OSError:  # it died before it was sent (its exit code says how): as a failed start below
            pass
        loop = asyncio.get_running_loop()
        try:
            first = await loop.run_in_executor(None, _receive_or_none, results)
            while isinstance(first, Starting):
                if on_progress is not None:
                    on_progress(first.progress)
                first = await loop.run_in_executor(None, _receive_or_none, results)
            if isinstance(first, StartFailed):  # what LLMEngine raised there, raised here
                if first.error is not None:
                    raise first.error
                raise EngineDeadError(f"the engine process could not start: {first.message}")
            if not isinstance(first, Ready):
                await _wait_for_exit(process, EXIT_WAIT_S)
                raise EngineDeadError(
                    f"the engine process exited (exit code {process.exitcode}) before it was ready"
                )
            tokenizer = await loop.run_in_executor(None, Tokenizer.from_folder, spec.files.folder)
        except BaseException:
            await _stop_process(process, commands)
            raise
        client = cls(process, commands, results, tokenizer, first, on_operations)
        log.info("engine process %d ready", process.pid)
        return client

    @property
    def pid(self) -> int | None:
        return self._process.pid

    @property
    def exitcode(self) -> int | None:
        """The engine process's exit code; None while it runs (negative: the signal that ended it)."""
        return self._process.exitcode

    async def start(self) -> None:
        """Starts handing the engine's outputs to this event loop (the process runs already)."""
        if self._reader is None and self._error is None:
            loop = asyncio.get_running_loop()
            self._reader = threading.Thread(
                target=self._read, args=(loop,), name="ferrum-engine-reader", daemon=True
            )
            self._reader.start()

    async def shutdown(self) -> None:
        if not self._stopping:
            self._stopping = True
            await _stop_process(self._process, self._commands)
            if self._reader is not None:
                await asyncio.get_running_loop().run_in_executor(None, self._reader.join)
            self._results.close()
        self._fail_all(EngineDeadError("the engine was shut down"), by_shutdown=True)

    def is_ready(self) -> bool:
        return self._reader is not None and self._error is None and self._process.is_alive()

    def _send(self, command: AddRequest | AbortRequest) -> None:
        if self._stopping:
            return
        try:
            self._commands.send(command)
        except OSError as exc:  # the process is gone; the reader reports how
            self._fail_all(EngineDeadError(f"the engine process is not answering: {exc}"))

    # -- the reader thread --------------------------------------------------------------------------
    def _read(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            while True:
                message = _receive_or_none(self._results)
                if isinstance(message, Stepped):
                    self._count(message.operations)
                    loop.call_soon_threadsafe(self._deliver, message.outputs, message.stats)
                elif isinstance(message, StepFailed):
                    loop.call_soon_threadsafe(self._fail_all, EngineDeadError(message.message))
                elif message is None:  # the pipe closed: the process exited
                    wait([self._process.sentinel], EXIT_WAIT_S)
                    loop.call_soon_threadsafe(self._process_gone)
                    return
        except RuntimeError:  # the event loop was closed under us: nobody left to tell
            return

    def _count(self, operations: int) -> None:
        if operations > self._operations and self._on_operations is not None:
            self._on_operations(operations - self._operations)
        self._operations = max(self._operations, operations)

    def _process_gone(self) -> None:
        if not self._stopping:
            _reap_if_exited(self._process)
            code = self._process.exitcode
            log.error("the engine process exited unexpectedly (exit code %s)", code)
            self._fail_all(EngineDeadError(f"the engine process exited unexpectedly (exit code {code})"))


def _receive_or_none(connection: Connection) -> Message | None:
    """The next message, or None once the other end has closed."""
    try:
        message: Message = connection.recv()
    except (EOFError, OSError):
        return None
    return message


async def _wait_for_exit(process: BaseProcess, timeout: float) -> None:
    """Waits up to `timeout` for the process to exit (on a worker thread, without reaping it there),
    then reaps it here on the event loop's thread: its sentinel turns ready as it closes its files,
    a moment before it can be reaped, so that join blocks for that moment only."""
    await asyncio.get_running_loop().run_in_executor(None, wait, [process.sentinel], timeout)
    _reap_if_exited(process)


def _reap_if_exited(process: BaseProcess) -> None:
    if wait([process.sentinel], 0):
        process.join(EXIT_WAIT_S)


async def _stop_process(process: BaseProcess, commands: Connection) -> None:
    """StopLoop, then SIGTERM, then SIGKILL, each after a grace period; closes the command pipe."""
    stop: Command = StopLoop()
    try:
        commands.send(stop)
    except OSError:
        pass
    commands.close()  # the process also stops when it reads the end of the pipe
    await _wait_for_exit(process, STOP_GRACE_S)
    if process.exitcode is None:
        log.warning("the engine process did not stop in %.0fs; terminating it", STOP_GRACE_S)
        process.terminate()
        await _wait_for_exit(process, STOP_GRACE_S)
    if process.exitcode is None:
        process.kill()
        await _wait_for_exit(process, STOP_GRACE_S)
