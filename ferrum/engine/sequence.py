"""One request as the engine sees it: tokens, progress, KV blocks, output state."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ferrum.engine.outputs import FinishReason, TokenLogprob
from ferrum.engine.prompt_logprobs import PromptScores
from ferrum.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from ferrum.engine.structured import Guide
    from ferrum.tokenizer.incremental import IncrementalDecoder


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose k/v are in the cache
    block_table: list[int] = field(default_factory=list)
    # prefix caching (kept by the block manager): the chained hashes of the token blocks
    # hashed so far (full blocks only; they stay valid after a preemption, tokens are never
    # changed), and how many leading blocks of block_table the prefix cache already knows
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    # a sliding window: the leading entries of block_table given back (BlockManager.FREED)
    num_released_blocks: int = 0
    # speculative decoding: the tokens drafted for the next step, and this sequence's per-position acceptance
    # rate (None until a draft of it was verified) from its decayed counts of draft positions kept and tried
    draft_token_ids: list[int] = field(default_factory=list)
    spec_acceptance: float | None = None
    spec_kept: float = 0.0
    spec_tried: float = 0.0
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None  # set when the request has a seed
    priority: int = 0  # lower is served first (as vLLM); equal priorities in arrival order
    first_scheduled: float | None = None  # time.monotonic() when it first left the waiting queue
    queue_time_sent: bool = False
    # output text bookkeeping (filled by the output processor)
    output_text: str = ""
    num_text_sent: int = 0
    num_tokens_sent: int = 0
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    decoder: IncrementalDecoder | None = None
    guide: Guide | None = None  # the grammar's state when the request asked for structured output
    # prompt logprobs (SamplingParams.prompt_logprobs): the prompt tokens scored so far (they are never
    # scored twice, not even when a preempted sequence is recomputed), the runner's scores not yet
    # decoded, the decoded ones (prompt tokens 1, 2, ...), and whether they went out
    num_prompt_scored: int = 0
    prompt_scores: list[PromptScores] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs_sent: bool = False

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_at(self, position: int) -> int:
        n = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < n else self.output_token_ids[position - n]

    def tokens(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def scores_prompt(self) -> bool:
        """Asks for prompt logprobs and not every prompt token is scored yet."""
        return self.params.prompt_logprobs is not None and self.num_prompt_scored < len(self.prompt_token_ids) - 1

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
