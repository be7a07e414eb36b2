"""The engine process: its entry point and the messages it sends back.

Started by ProcessEngineClient with multiprocessing's "spawn" context. It builds LLMEngine from the
EngineConfig it is given, reports Ready (or StartFailed), then runs the engine loop over two
one-way pipes: commands (AddRequest, AbortRequest, StopLoop) in, one Stepped message per round out.
It ignores SIGINT (Ctrl-C in a terminal reaches the whole process group; the server stops it with
StopLoop) and exits by itself when the server's end of either pipe goes away.
"""

from __future__ import annotations

import logging
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from ferrum.engine.config import EngineConfig
from ferrum.engine.engine_loop import Command, run_engine_loop
from ferrum.engine.llm_engine import EngineStats, LLMEngine
from ferrum.engine.outputs import RequestOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ready:
    max_model_len: int
    stats: EngineStats


@dataclass(frozen=True)
class StartFailed:
    message: str  # "<type>: <message>"
    error: BaseException | None  # the exception itself, when it survives pickling (the server re-raises it)


@dataclass(frozen=True)
class Stepped:
    outputs: list[RequestOutput]
    stats: EngineStats


@dataclass(frozen=True)
class StepFailed:
    message: str


Message = Ready | StartFailed | Stepped | StepFailed


def run_engine_process(
    config: EngineConfig, commands: Connection, results: Connection, log_level: int
) -> None:
    """The process's target. Exit code 0 after StopLoop or when the server is gone, 1 after a failure."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine process]: %(message)s"
    )
    try:
        engine = LLMEngine(config)
    except Exception as exc:
        log.debug("the engine could not start", exc_info=True)
        results.send(StartFailed(f"{type(exc).__name__}: {exc}", _portable(exc)))
        sys.exit(1)
    results.send(Ready(engine.max_model_len, engine.stats()))

    def next_command(block: bool) -> Command | None:
        if not block and not commands.poll():
            return None
        command: Command = commands.recv()
        return command

    def emit(outputs: list[RequestOutput], stats: EngineStats) -> None:
        results.send(Stepped(outputs, stats))

    try:
        run_engine_loop(engine, next_command, emit)
    except (EOFError, BrokenPipeError):  # the server is gone: nobody to serve
        return
    except Exception as exc:
        log.exception("engine step failed")
        results.send(StepFailed(f"engine step failed: {exc}"))
        sys.exit(1)


def _portable(exc: Exception) -> Exception | None:
    """`exc` if a copy of it made by pickling is of the same type and message (so the server raises
    what an in-process engine would have), with this process's traceback as a note; else None."""
    try:
        copy = pickle.loads(pickle.dumps(exc))
    except Exception:
        return None
    if type(copy) is not type(exc) or str(copy) != str(exc):
        return None
    copy.add_note("in the engine process:\n" + "".join(traceback.format_exception(exc)).rstrip())
    return copy
