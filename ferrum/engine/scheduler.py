"""Decides, each step, which sequences run and how many of their tokens.

A step has a token budget. Running sequences go first (one token each when
decoding, a chunk when their prompt is still being prefilled); waiting
sequences are admitted with what budget and free KV blocks remain, their
prompts chunked to fit. When a running sequence cannot get a block, the most
recently admitted running sequence is preempted: its blocks are freed and it
goes back to the front of the queue, to be recomputed later.

With prefix caching, each step first registers the blocks the last step
completed, and a sequence being admitted starts after the leading full blocks
whose KV is already cached (shared with whoever holds them).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ferrum.engine.block_manager import BlockManager
from ferrum.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1 and self.seq.num_computed_tokens == self.seq.num_tokens - 1


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSequence, ...]
    num_preempted: int

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Drops a finished or aborted sequence and frees its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted = 0

        for seq in self.running:
            self.blocks.cache_computed_blocks(seq)  # what the last step computed can now be shared

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            while not self.blocks.can_grow(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            else:
                self.blocks.grow(seq, seq.num_computed_tokens + n)
                scheduled.append(ScheduledSequence(seq, n))
                budget -= n
                i += 1
                continue
            break  # seq itself was preempted

        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            seq = self.waiting[0]
            cached = self.blocks.cached_prefix(seq)
            start = seq.num_computed_tokens + len(cached) * self.blocks.block_size
            n = min(seq.num_tokens - start, budget)
            if not self.blocks.can_admit(seq, cached, start + n):
                break  # the engine guarantees one max-length sequence fits in an empty cache
            self.waiting.popleft()
            self.blocks.admit(seq, cached, start + n)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSequence(seq, n))
            budget -= n

        return SchedulerOutput(tuple(scheduled), preempted)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
