"""The engine process started ahead of its model: `ferrum serve` spawns it first thing (`prestart`), and it
imports the engine's modules (torch among them) while the server's own process is still importing and
resolving the model; ProcessEngineClient.launch then takes it (`take`) and sends it the EngineSpec.
Spawned only at launch, the engine process imported them after the server process had, one after the
other: on a 2-core VM the server process took about 3.6 s to its first log line and the engine process
2.5 s more to its first (benchmarks/cpu-serve.md).

It is spawned as any engine process is, so nothing of the server process (no CUDA context, no thread
pool) is copied into it; it sees the environment as it was when `prestart` ran. Until it is given a spec it
ignores SIGINT as the engine process does, and it exits when the server process goes away (its pipe
closes) or exits (it is a daemon). Where nothing called `prestart` (tests, library use) every engine
process is spawned at launch.
"""

from __future__ import annotations

import multiprocessing
import signal
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ferrum.engine.builder import EngineSpec

F_SETPIPE_SZ = 1031  # Linux fcntl


@dataclass(frozen=True)
class EngineStart:
    """The first message down every engine process's command pipe: what to build."""

    spec: EngineSpec
    log_level: int


@dataclass(frozen=True)
class EngineProcess:
    """An engine process and this side's ends of its pipes: commands down, results up."""

    process: BaseProcess
    commands: Connection
    results: Connection


class _Waiting:
    process: EngineProcess | None = None


_waiting = _Waiting()


def widen_pipe(connection: Connection, size: int = 1 << 20) -> None:
    """Grows a pipe from Linux's 64 KiB to 1 MiB, so that the engine never blocks on sending a step's
    outputs while the server process's reader thread waits its turn for the GIL (up to the interpreter's
    5 ms switch interval when the event loop is busy with many streams)."""
    try:
        import fcntl

        fcntl.fcntl(connection.fileno(), F_SETPIPE_SZ, size)
    except (ImportError, OSError):  # not Linux, or above /proc/sys/fs/pipe-max-size: keep the default
        pass


def spawn_engine_process() -> EngineProcess:
    """A spawned engine process (wait_for_spec), with widened pipes."""
    ctx = multiprocessing.get_context("spawn")
    child_commands, commands = ctx.Pipe(duplex=False)  # (receiving end, sending end)
    results, child_results = ctx.Pipe(duplex=False)
    for pipe in (results, commands):
        widen_pipe(pipe)
    process = ctx.Process(
        target=wait_for_spec,
        args=(child_commands, child_results),
        name="ferrum-engine",
        daemon=True,  # never outlives an interpreter that exits without shutdown()
    )
    process.start()
    child_commands.close()  # the child's ends, closed here: the pipes close when the child exits
    child_results.close()
    return EngineProcess(process, commands, results)


def prestart() -> None:
    """Spawns the engine process now, to import while this process does; the next launch takes it."""
    if _waiting.process is None:
        _waiting.process = spawn_engine_process()


def take() -> EngineProcess | None:
    """The prestarted engine process, if one is waiting and alive (once)."""
    waiting, _waiting.process = _waiting.process, None
    if waiting is not None and not waiting.process.is_alive():
        waiting.commands.close()
        waiting.results.close()
        return None
    return waiting


def wait_for_spec(commands: Connection, results: Connection) -> None:
    """Every engine process's target: the engine's imports, then the engine its first message names (at once
    when spawned at launch; once the server process has resolved the model when prestarted)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from ferrum.engine.engine_process import run_engine_process

    try:
        start = commands.recv()
    except (EOFError, OSError):  # the server process is gone before it had a model for us
        return
    if isinstance(start, EngineStart):
        run_engine_process(start.spec, commands, results, start.log_level)


def discard() -> None:
    """Lets a prestarted engine process that no launch will take exit: its command pipe closes."""
    waiting = take()
    if waiting is not None:
        waiting.commands.close()
        waiting.results.close()
