"""The engine process: its entry point and the messages it sends back.

Spawned (warm_start.py: at launch, or ahead of it by `ferrum serve`), it imports the engine's modules
and waits for its first message, the EngineSpec to build (warm_start.EngineStart). From that it
rebuilds the backend registry, takes the backend the API process selected, probes its `Device` here
(a GPU's CUDA context belongs to this process alone) and builds LLMEngine on it; it reports Ready
(or StartFailed), then runs the engine loop over two one-way pipes: commands (AddRequest,
AbortRequest, StopLoop) in, one Stepped message per round out (with the steps its backend has
counted, for the API process's backend: GET /v1/backends). It ignores SIGINT
(Ctrl-C in a terminal reaches the whole process group; the server stops it with StopLoop), exits
by itself when the server's end of either pipe goes away, and frees the device through its
backend's shutdown before it exits.
"""

from __future__ import annotations

import logging
import pickle
import signal
import sys
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

from ferrum.engine.builder import EngineSpec, build_engine
from ferrum.engine.engine_loop import Command, run_engine_loop
from ferrum.engine.heap import freeze_startup_heap
from ferrum.engine.limits import RequestLimits
from ferrum.engine.llm_engine import EngineStats
from ferrum.engine.outputs import RequestOutput
from ferrum.engine.startup import StartupProgress
from ferrum.models.loader import WeightLoadReport, run_sync

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Starting:
    progress: StartupProgress


@dataclass(frozen=True)
class Ready:
    limits: RequestLimits
    stats: EngineStats
    weight_load: WeightLoadReport | None = None


@dataclass(frozen=True)
class StartFailed:
    message: str  # "<type>: <message>"
    error: BaseException | None  # the exception itself, when it survives pickling (the server re-raises it)


@dataclass(frozen=True)
class Stepped:
    outputs: list[RequestOutput]
    stats: EngineStats
    operations: int = 0  # the engine's steps so far, as this process's backend counted them


@dataclass(frozen=True)
class StepFailed:
    message: str


Message = Starting | Ready | StartFailed | Stepped | StepFailed


def run_engine_process(spec: EngineSpec, commands: Connection, results: Connection, log_level: int) -> None:
    """The process's target. Exit code 0 after StopLoop or when the server is gone, 1 after a failure."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=log_level, format="%(asctime)s %(levelname)s %(name)s [engine process]: %(message)s"
    )
    try:
        engine, backend = build_engine(spec, on_progress=lambda p: results.send(Starting(p)))
    except Exception as exc:
        log.debug("the engine could not start", exc_info=True)
        results.send(StartFailed(f"{type(exc).__name__}: {exc}", _portable(exc)))
        sys.exit(1)
    freeze_startup_heap()
    results.send(Ready(engine.limits, engine.stats(), engine.weight_load))

    def next_command(block: bool) -> Command | None:
        if not block and not commands.poll():
            return None
        command: Command = commands.recv()
        return command

    def emit(outputs: list[RequestOutput], stats: EngineStats) -> None:
        results.send(Stepped(outputs, stats, backend.operations_completed))

    failed = False
    try:
        run_engine_loop(engine, next_command, emit)
    except (EOFError, BrokenPipeError):  # the server is gone: nobody to serve
        pass
    except Exception as exc:
        failed = True
        log.exception("engine step failed")
        results.send(StepFailed(f"engine step failed: {exc}"))
    finally:
        try:
            run_sync(backend.shutdown())  # the release hooks free the model, KV cache and graphs
        except Exception:
            log.exception("freeing the device failed")
    if failed:
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
