"""The `ModelRunner` protocol both runners implement, and the step packing they share.

    TorchModelRunner (torch_runner.py)  torch_paged attention, every device; the CPU's runner
    GPUModelRunner   (gpu_runner.py)    triton_paged attention, CUDA graphs for decode, greedy bursts

`ferrum.engine.model_rank.runner_for` picks one by the attention backend's type, which
`select_attention` picked once from the `Device`. A runner owns the model's KV cache and turns a
scheduled step into logits; one that can (`max_burst > 0`) also runs greedy decode iterations back to
back on the device.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import Protocol

import torch

from ferrum.engine.scheduler import ScheduledSequence
from ferrum.engine.sequence import Sequence
from ferrum.models.attention.layout import KVCacheLayout
from ferrum.models.attention.packed_step import PackedStep, SequenceRows


class GreedyBurst(Protocol):
    """Greedy decode iterations queued on the device (what `launch_greedy` returns; `read_greedy`
    takes back only the runner's own)."""

    @property
    def steps(self) -> int: ...


class ModelRunner(Protocol):
    max_burst: int  # greedy decode iterations one burst may run on the device; 0: no bursts

    def execute(self, scheduled: list[ScheduledSequence]) -> tuple[torch.Tensor, list[Sequence]]:
        """Runs one forward pass and moves every scheduled sequence's computed tokens on. Returns
        float32 logits [B, V] (on any device; the work may still run there) for the sequences that
        get a new token this step, in order."""
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

    def release(self) -> None:
        """Drops the KV cache, graphs and model so that the device memory can be freed."""
        ...


def pack_step(
    scheduled: SequenceOf[ScheduledSequence], layout: KVCacheLayout, *, pad_to: int = 0, pad_slot: int = 0
) -> tuple[PackedStep, list[int], list[Sequence]]:
    """The step's tokens packed (decodes first, then prefills; see PackedStep), the rows whose
    logits are sampled and their sequences (those that finish their pending tokens this step)."""
    ordered = [s for s in scheduled if s.is_decode] + [s for s in scheduled if not s.is_decode]
    num_decode = sum(1 for s in ordered if s.is_decode)
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    rows: list[SequenceRows] = []
    sample_rows: list[int] = []
    sample_seqs: list[Sequence] = []
    for s in ordered:
        seq, past, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
        rows.append(SequenceRows(len(ids), n, past, seq.block_table))
        ids.extend(seq.tokens(past, past + n))
        positions.extend(range(past, past + n))
        slots.extend(layout.slots(seq.block_table, past, past + n))
        if past + n == seq.num_tokens:
            sample_rows.append(len(ids) - 1)
            sample_seqs.append(seq)
    step = PackedStep(ids, positions, slots, tuple(rows), num_decode, max(pad_to, len(ids)), pad_slot)
    return step, sample_rows, sample_seqs


def advance(scheduled: SequenceOf[ScheduledSequence]) -> None:
    """Every scheduled sequence's new tokens are computed (their k and v are in the cache)."""
    for s in scheduled:
        s.seq.num_computed_tokens += s.num_new_tokens
