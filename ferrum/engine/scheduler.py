"""Decides, each step, which sequences run and how many of their tokens, and for how many greedy
decode iterations the device may run on by itself (a burst).

A step has a token budget. Running sequences go first (one token each when decoding, a chunk when
their prompt is still being prefilled); waiting sequences are admitted with what budget and free
KV blocks remain, their prompts chunked to fit. When a running sequence cannot get a block, the
most recently admitted running sequence is preempted: its blocks are freed and it goes back to
the front of the queue, to be recomputed later. With a sliding window on every layer, each running
sequence first gives back the blocks behind its window.

With prefix caching, a sequence being admitted starts after the leading full blocks whose KV is
already cached (shared with whoever holds them); the blocks a step computes are registered by
`register_computed` while the device runs that step.

Speculative decoding: a decoding sequence with a draft (Sequence.draft_token_ids) is scheduled with its
last token and the draft, as many draft tokens as the budget and the free blocks allow (a draft never
preempts); such a step is an ordinary one, never a burst. Where the runner drafts on the device, a greedy batch runs
drafted bursts instead (`drafts_on_device`, `plan_drafted`): several iterations of drafting and verifying,
the block tables grown for the most tokens they can add and truncated by the engine after.

Greedy bursts (runners that can run decode iterations back to back on the device, up to
`max_burst`): while every scheduled sequence decodes greedily without logprobs, penalties, logit bias or
a grammar, the
plan may say to run several iterations at once, the block tables already grown for them. Only
one iteration while a request waits for a free slot (it is admitted next step), and never past
max_model_len. A small batch's burst also ends at the first sequence's max_tokens; a batch of at
least `BurstLimits.full_from` sequences runs the burst's whole length, a sequence that reached its
max_tokens riding along (its rows past it dropped when read): at such a batch the host's turn-around
at a burst's end (reading, detokenizing, scheduling and launching a few hundred sequences: 7-9 ms on
an H100's host) costs more device time than a few finished rows, and with every sequence's end a
turn-around the device waited at most of them. While a burst runs, the engine may have the next one
queued behind it (`extend_burst`) when no sequence can have stopped in it (`burst_continues`).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Iterable
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

from ferrum.engine.block_manager import BlockManager
from ferrum.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledSequence:
    """`draft`: tokens drafted after the sequence's last one (speculative decoding), computed with it this
    step (num_new_tokens counts them) and verified after it."""

    seq: Sequence
    num_new_tokens: int
    draft: tuple[int, ...] = ()

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1 and self.seq.num_computed_tokens == self.seq.num_tokens - 1

    @property
    def completes_pending(self) -> bool:
        """This step computes the sequence's last pending token: it is sampled (or its draft verified) after
        the step."""
        return self.seq.num_computed_tokens + self.num_new_tokens - len(self.draft) == self.seq.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: tuple[ScheduledSequence, ...]
    num_preempted: int
    burst: int = 0  # > 0: every scheduled sequence decodes greedily this many iterations on the device

    @property
    def empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class BurstLimits:
    """What bounds a greedy burst: the runner's most iterations per burst (0: no bursts), the
    sequence length limit, the tokens that stop a sequence unless it ignores EOS, and the batch size
    from which a burst is not cut short at a sequence's max_tokens (0: it always is)."""

    max_steps: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    full_from: int = 0


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        bursts: BurstLimits | None = None,
    ) -> None:
        self.blocks = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.bursts = bursts or BurstLimits(0, 0, frozenset())
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queues `seq` behind every waiting sequence of its priority or a more urgent one (a lower
        number), ahead of the less urgent ones."""
        if not self.waiting or self.waiting[-1].priority <= seq.priority:
            self.waiting.append(seq)
            return
        for i, queued in enumerate(self.waiting):
            if queued.priority > seq.priority:
                self.waiting.insert(i, seq)
                return

    def remove(self, seq: Sequence) -> None:
        """Drops a finished or aborted sequence and frees its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)

    def register_computed(self, seqs: Iterable[Sequence]) -> None:
        """Offers the blocks these sequences' computed tokens fill to the prefix cache (called while
        the device runs the step that computes them: the host's hashing overlaps it)."""
        for seq in seqs:
            self.blocks.cache_computed_blocks(seq)

    # -- one step ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """The next step."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledSequence] = []
        preempted = 0

        for seq in self.running:
            self.blocks.cache_computed_blocks(seq)  # anything not registered while its step ran
            self.blocks.release_before_window(seq)  # a sliding window's blocks behind it

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            draft = self._draft(seq, budget)
            n += len(draft)
            while not self.blocks.can_grow(seq, seq.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted += 1
                if victim is seq:
                    break
            else:
                self.blocks.grow(seq, seq.num_computed_tokens + n)
                scheduled.append(ScheduledSequence(seq, n, draft))
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
                break  # the engine guarantees one sequence's peak (BlockManager.peak_tokens) fits an empty cache
            self.waiting.popleft()
            self.blocks.admit(seq, cached, start + n)
            if seq.first_scheduled is None:
                seq.first_scheduled = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSequence(seq, n))
            budget -= n

        burst = self._plan_burst(scheduled) if scheduled and not preempted else 0
        return SchedulerOutput(tuple(scheduled), preempted, burst)

    def _draft(self, seq: Sequence, budget: int) -> tuple[int, ...]:
        """A decoding sequence's draft (Sequence.draft_token_ids, set by the engine's speculator), as much
        of it as the step's token budget and the free blocks take: a draft never preempts anyone."""
        if not seq.draft_token_ids or seq.num_uncomputed_tokens != 1:
            return ()
        m = min(len(seq.draft_token_ids), budget - 1)
        while m > 0 and not self.blocks.can_grow(seq, seq.num_computed_tokens + 1 + m):
            m -= 1
        return tuple(seq.draft_token_ids[:m])

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    # -- greedy bursts ----------------------------------------------------------------------------
    def _plan_burst(self, scheduled: SequenceOf[ScheduledSequence]) -> int:
        """Decode iterations to run on the device in one go (0: an ordinary step): only when every
        sequence decodes greedily without logprobs or penalties; one while a request could be
        admitted; else as many as every sequence may take and the free blocks allow."""
        if not self.bursts.max_steps or len(scheduled) > self.max_num_seqs:
            return 0
        if not all(s.is_decode and _burstable(s.seq) for s in scheduled):
            return 0
        if self.admission_pending():
            return 1
        seqs = [s.seq for s in scheduled]
        computed = [seq.num_computed_tokens for seq in seqs]
        steps = self._room(seqs, [len(seq.output_token_ids) for seq in seqs], computed)
        return max(self._grow_for(seqs, computed, steps), 1)

    def extend_burst(self, seqs: SequenceOf[Sequence], ahead: int) -> int:
        """Iterations of a burst that would follow the `ahead` ones queued but not yet counted,
        with the block tables grown for them; 0 when the sequences' limits or the free blocks
        leave no room (nothing grown). A sliding window's blocks behind the sequences go back first (as
        at every schedule: bursts queued back to back never pass through it)."""
        for seq in seqs:
            self.blocks.release_before_window(seq)
        computed = [seq.num_computed_tokens + ahead for seq in seqs]
        room = self._room(seqs, [len(seq.output_token_ids) + ahead for seq in seqs], computed)
        return self._grow_for(seqs, computed, room)

    def burst_continues(self, seqs: SequenceOf[Sequence], rows: list[list[int]]) -> bool:
        """Whether every sequence is sure to run on after the burst whose chosen ids are `rows`
        ([iteration][sequence]), judged without detokenizing (not aborted, no stop token, not at
        its length limits, no stop strings), and no request waits for a free slot."""
        if self.admission_pending():
            return False
        return all(self.keeps_going(seq, [row[i] for row in rows]) for i, seq in enumerate(seqs))

    def admission_pending(self) -> bool:
        """A request waits and a running slot is free for it (with every slot taken, it waits for a
        sequence to finish, which ends a burst anyway)."""
        return bool(self.waiting) and len(self.running) < self.max_num_seqs

    def _room(self, seqs: SequenceOf[Sequence], outputs: list[int], computed: list[int]) -> int:
        limits = self.bursts
        steps = limits.max_steps
        full = 0 < limits.full_from <= len(seqs)  # finished sequences ride along to the burst's end
        for seq, out, done in zip(seqs, outputs, computed, strict=True):
            room = limits.max_model_len - done
            if not full:
                room = min(room, seq.params.max_tokens - out)
            steps = min(steps, room)
        return steps

    def _grow_for(self, seqs: SequenceOf[Sequence], computed: list[int], steps: int) -> int:
        blocks = self.blocks
        if steps < 1:
            return 0
        if sum(blocks.blocks_needed(q, c + steps) for q, c in zip(seqs, computed, strict=True)) > blocks.num_free:
            return 0
        for q, c in zip(seqs, computed, strict=True):
            blocks.grow(q, c + steps)
        return steps

    # -- drafted bursts (ferrum.engine.draft_bursts) --------------------------------------------------------
    def drafts_on_device(self, k: int, max_rows: int) -> bool:
        """Whether the running batch may run a drafted burst of k drafts a sequence: every sequence decodes
        greedily as for a plain burst, no request waits for a free slot, and the rows fit the runner's."""
        seqs = self.running
        return (bool(seqs) and self.bursts.max_steps > 0 and len(seqs) * (k + 1) <= max_rows
                and not self.admission_pending()
                and all(seq.num_uncomputed_tokens == 1 and not seq.scores_prompt and _burstable(seq) for seq in seqs))

    def plan_drafted(self, k: int, per_iteration: float, longest: int) -> int:
        """Iterations of a drafted burst of the running batch, its block tables grown for k + 1 tokens an
        iteration (the most a sequence gains): as many as the first sequence to reach its max_tokens needs at
        `per_iteration` tokens an iteration, at most `longest` and the bursts' max_steps, fewer where
        max_model_len or the free blocks leave less room; 0: none (nothing grown)."""
        seqs = self.running
        for seq in seqs:
            self.blocks.cache_computed_blocks(seq)
            self.blocks.release_before_window(seq)
        width = k + 1
        computed = [seq.num_computed_tokens for seq in seqs]
        need = min(seq.params.max_tokens - len(seq.output_token_ids) for seq in seqs)
        steps = min(self.bursts.max_steps, longest, max(1, math.ceil(need / max(per_iteration, 1.0))))
        steps = min([steps] + [(self.bursts.max_model_len - done) // width for done in computed])
        if steps < 1 or not self._grow_for(seqs, computed, steps * width):
            return 0
        return steps

    def keeps_going(self, seq: Sequence, tokens: list[int]) -> bool:
        """Whether `seq` is sure to run on after `tokens` (judged from the ids: no stop token, below its
        length limits; False for a finished sequence or one with stop strings, which need the text)."""
        p = seq.params
        if seq.is_finished or p.stop:
            return False
        stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | self.bursts.eos_token_ids
        if stops.intersection(tokens):
            return False
        return (len(seq.output_token_ids) + len(tokens) < p.max_tokens
                and seq.num_tokens + len(tokens) < self.bursts.max_model_len)


def _burstable(seq: Sequence) -> bool:
    p = seq.params
    return (p.greedy and p.logprobs is None and p.repetition_penalty == 1.0
            and not p.presence_penalty and not p.frequency_penalty
            and not p.logit_bias and p.structured is None)  # a mask or a bias per token: sampled on the host
