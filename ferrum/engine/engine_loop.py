"""The loop that drives an LLMEngine, wherever it runs: on AsyncEngine's thread or in the engine process.

It blocks for a command only when the engine is idle; otherwise it takes the commands that have
arrived, applies them, and steps. Each round ends with one `emit` of that round's deltas (aborts and
rejections first, then the step's outputs) and the engine's stats.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ferrum.engine.llm_engine import EngineStats, LLMEngine
from ferrum.engine.outputs import RequestOutput
from ferrum.engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AddRequest:
    engine_id: str  # unique per request: the caller's id plus a counter (see RequestStreams.generate)
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0


@dataclass(frozen=True)
class AbortRequest:
    engine_id: str


@dataclass(frozen=True)
class StopLoop:
    pass


Command = AddRequest | AbortRequest | StopLoop
NextCommand = Callable[[bool], Command | None]  # block? -> a command, or None if none is waiting
Emit = Callable[[list[RequestOutput], EngineStats], None]


def run_engine_loop(engine: LLMEngine, next_command: NextCommand, emit: Emit) -> None:
    """Runs until a StopLoop command. Errors from the engine (a failed step) propagate."""
    while True:
        command = next_command(True) if not engine.has_work else None
        finals: list[RequestOutput] = []
        while True:
            if command is None:
                command = next_command(False)
                if command is None:
                    break
            if isinstance(command, StopLoop):
                return
            finals.extend(apply_command(engine, command))
            command = None
        outputs = engine.step() if engine.has_work else []
        emit(finals + outputs, engine.stats())


def apply_command(engine: LLMEngine, command: AddRequest | AbortRequest) -> list[RequestOutput]:
    """The deltas a command produces at once: an abort's final delta (it ends the stream of a
    caller still reading), or a rejected request's "abort" delta."""
    if isinstance(command, AbortRequest):
        aborted = engine.abort_request(command.engine_id)
        return [aborted] if aborted is not None else []
    try:
        engine.add_request(command.engine_id, command.prompt_token_ids, command.params, command.priority)
    except ValueError as exc:  # PromptTooLongError too: the client checked the same limits
        log.warning("request %s rejected: %s", command.engine_id, exc)
        n_prompt = len(command.prompt_token_ids)
        return [RequestOutput(command.engine_id, "", (), None, True, "abort", n_prompt, 0)]
    return []
