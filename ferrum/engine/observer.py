"""Step observers: the public hook through which benchmarks and diagnostics see what the engine
did, step by step, without reaching into it (`LLMEngine.add_observer`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

StepKind = Literal["prefill", "mixed", "decode", "burst", "verify"]  # verify: decodes, some with drafts


@dataclass(frozen=True)
class StepRecord:
    """One engine step. `logits`: the rows sampled this step, float32 [len(request_ids), vocab], on
    the device (ordinary steps only; a burst's choices never leave the device as logits)."""

    kind: StepKind
    num_seqs: int  # sequences that ran
    num_tokens: int  # tokens the model ran (prompt tokens, and one per decode; a burst: per iteration)
    num_generated: int  # tokens handed to requests this step
    started: float  # time.perf_counter() when the step began
    finished: float
    request_ids: tuple[str, ...] = ()
    logits: torch.Tensor | None = None
    iterations: int = 1  # forward passes the step stands for: a burst's decode iterations read, else 1
    cached_tokens: int = 0  # the step's sequences' tokens already in the cache when its first pass began
    attended_keys: int = 0  # over every token the first pass ran, the cached keys its attention read (its own too)


StepObserver = Callable[[StepRecord], None]
