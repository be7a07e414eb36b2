"""The `ModelRunner` protocol both runners implement, and the step packing they share.

    TorchModelRunner (torch_runner.py)  torch_paged attention, every device; the CPU's runner
    GPUModelRunner   (gpu_runner.py)    triton_paged attention, CUDA graphs for decode, greedy bursts

`ferrum.engine.model_rank.runner_for` picks one by the attention backend's type, which
`select_attention` picked once from the `Device`. A runner owns the model's KV cache and turns a
scheduled step into logits (and, for requests that ask, prompt logprobs: `score_prompts`); one that
can (`max_burst > 0`) also runs greedy decode iterations back to back on the device, and one that can
(`max_draft_rows > 0`) greedy speculative iterations too, drafting on the device (ferrum.engine.draft_bursts).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass
from typing import Protocol

import torch

from ferrum.engine.prompt_logprobs import PromptRows, score_prompt_rows
from ferrum.engine.scheduler import ScheduledSequence
from ferrum.engine.sequence import Sequence
from ferrum.models.attention.layout import KVCacheLayout
from ferrum.models.attention.packed_step import PackedStep, SequenceRows


class GreedyBurst(Protocol):
    """Greedy decode iterations queued on the device (what `launch_greedy` returns; `read_greedy`
    takes back only the runner's own)."""

    @property
    def steps(self) -> int: ...


class DraftedBurst(Protocol):
    """Drafted greedy iterations queued on the device (what `launch_drafted` returns)."""

    @property
    def steps(self) -> int: ...


class ModelRunner(Protocol):
    max_burst: int  # greedy decode iterations one burst may run on the device; 0: no bursts
    max_draft_rows: int  # rows (sequences x (k + 1)) a drafted burst may run; 0: no drafted bursts
    max_verify_rows: int  # rows (sequences and draft tokens) a verify step runs through a graph; 0: every step eager
    step_seconds: dict[int, float]  # device seconds of a decode step by rows, timed at start-up; {}: not timed

    def execute(self, scheduled: list[ScheduledSequence]) -> tuple[torch.Tensor, list[Sequence]]:
        """Runs one forward pass and moves every scheduled sequence's computed tokens on. Returns
        float32 logits [B, V] (on any device; the work may still run there) for the sequences that
        get a new token this step, in order. Sequences that ask for prompt logprobs get the scores
        of the prompt tokens this step computes (`score_prompts`)."""
        ...

    def launch_greedy(
        self, seqs: list[Sequence], steps: int, continue_at: list[int] | None = None
    ) -> GreedyBurst:
        """Queues `steps` greedy decode iterations of `seqs` and returns at once (runners with
        max_burst > 0). `continue_at`: the same sequences carry on at these positions from where
        the burst queued before left them. Block tables are grown by the caller; num_computed_tokens
        is left to the caller (a sequence may stop part-way)."""
        ...

    def read_greedy(self, burst: GreedyBurst) -> list[list[int]]:
        """Waits for a burst; its chosen ids, [iteration][sequence]."""
        ...

    def launch_drafted(self, seqs: list[Sequence], steps: int, k: int) -> DraftedBurst:
        """Queues `steps` greedy iterations of `seqs` that each draft k tokens per sequence (at most the
        speculative_config's; len(seqs) * (k + 1) <= max_draft_rows) by prompt lookup and verify them, and
        returns at once (runners with max_draft_rows > 0). Block tables are grown by the caller for k + 1
        tokens an iteration; num_computed_tokens is left to the caller."""
        ...

    def read_drafted(self, burst: DraftedBurst) -> list[list[list[int]]]:
        """Waits for a drafted burst; the ids each sequence gained, [iteration][sequence][ids]."""
        ...

    def release(self) -> None:
        """Drops the KV cache, graphs and model so that the device memory can be freed."""
        ...


@dataclass(frozen=True)
class StepPlan:
    """A step packed for the model: its tokens (decodes first, then prefills; see PackedStep), the rows
    whose logits are sampled and their sequences (those that finish their pending tokens this step; a
    sequence with a draft once for its last token and once for each draft token, consecutively), and the
    rows that score prompt tokens (only for sequences that ask for prompt logprobs)."""

    step: PackedStep
    sample_rows: list[int]
    sample_seqs: list[Sequence]
    prompt_rows: list[tuple[Sequence, PromptRows]]


def pack_step(
    scheduled: SequenceOf[ScheduledSequence], layout: KVCacheLayout, *, pad_to: int = 0, pad_slot: int = 0
) -> StepPlan:
    ordered = [s for s in scheduled if s.is_decode] + [s for s in scheduled if not s.is_decode]
    num_decode = sum(1 for s in ordered if s.is_decode)
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    rows: list[SequenceRows] = []
    sample_rows: list[int] = []
    sample_seqs: list[Sequence] = []
    prompt_rows: list[tuple[Sequence, PromptRows]] = []
    for s in ordered:
        seq, past, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
        rows.append(SequenceRows(len(ids), n, past, seq.block_table, past >= seq.num_prompt_tokens))
        if seq.scores_prompt:  # positions [first, end) score the prompt tokens after them
            first, end = max(past, seq.num_prompt_scored), min(past + n, seq.num_prompt_tokens - 1)
            if first < end:
                top_k = seq.params.prompt_logprobs or 0
                scored = seq.prompt_token_ids[first + 1 : end + 1]
                prompt_rows.append((seq, PromptRows(len(ids) + first - past, first + 1, scored, top_k)))
        drafted = len(s.draft)
        ids.extend(seq.tokens(past, past + n - drafted))
        ids.extend(s.draft)
        positions.extend(range(past, past + n))
        slots.extend(layout.slots(seq.block_table, past, past + n))
        if drafted:  # the last token and each draft token: the rows a verification reads, one each
            sample_rows.extend(range(len(ids) - drafted - 1, len(ids)))
            sample_seqs.extend([seq] * (drafted + 1))
        elif past + n == seq.num_tokens:
            sample_rows.append(len(ids) - 1)
            sample_seqs.append(seq)
    step = PackedStep(ids, positions, slots, tuple(rows), num_decode, max(pad_to, len(ids)), pad_slot)
    return StepPlan(step, sample_rows, sample_seqs, prompt_rows)


def score_prompts(
    hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor],
    prompt_rows: SequenceOf[tuple[Sequence, PromptRows]],
) -> None:
    """Scores the planned prompt rows (after the step's sampled logits, in plan order: under tensor
    parallelism every rank makes the same head calls) and hands the scores to their sequences."""
    for seq, rows in prompt_rows:
        seq.prompt_scores.append(score_prompt_rows(hidden, compute_logits, rows))
        seq.num_prompt_scored = rows.start + len(rows.token_ids) - 1


def advance(scheduled: SequenceOf[ScheduledSequence]) -> None:
    """Every scheduled sequence's new tokens are computed (their k and v are in the cache)."""
    for s in scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
