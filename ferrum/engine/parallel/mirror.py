"""Keeping the ranks in step: rank 0's runner (`MirroredRunner`) sends every call (a step, a greedy
burst, its read) to the workers first, as a small snapshot of the sequences, then runs it on its
own runner; each worker replays it on its runner (`serve_commands`), and the collectives inside the
model keep the ranks together."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ferrum.engine.parallel.group import RankGroup
from ferrum.engine.runner import DraftedBurst, GreedyBurst, ModelRunner
from ferrum.engine.sampling_params import SamplingParams
from ferrum.engine.scheduler import ScheduledSequence
from ferrum.engine.sequence import Sequence

# A sequence as a worker's runner needs it: id, tokens computed, total tokens, the tokens from the
# first uncomputed one on, the block table, and while it scores its prompt (prompt logprobs): top k,
# prompt tokens, prompt tokens scored (the worker's runner then makes the same head calls).
Scoring = tuple[int, int, int]
Snapshot = tuple[str, int, int, list[int], list[int], Scoring | None]


def snapshot(seq: Sequence) -> Snapshot:
    start = seq.num_computed_tokens
    scoring = None
    if seq.scores_prompt:
        scoring = (seq.params.prompt_logprobs or 0, seq.num_prompt_tokens, seq.num_prompt_scored)
    return (seq.request_id, start, seq.num_tokens, seq.tokens(start, seq.num_tokens), list(seq.block_table),
            scoring)


_MIRROR_PARAMS = SamplingParams(max_tokens=1)


def mirror(snap: Snapshot) -> Sequence:
    """A stand-in Sequence on a worker: right counts, block table and uncomputed tokens (the
    computed ones are in the KV cache and never read again), and the prompt scoring still to do."""
    request_id, computed, total, tokens, block_table, scoring = snap
    prompt = [0] * computed + tokens
    prompt += [0] * (total - len(prompt))
    if scoring is None:
        seq = Sequence(request_id, prompt, _MIRROR_PARAMS, 0.0)
    else:
        top_k, num_prompt, scored = scoring
        params = SamplingParams(max_tokens=1, prompt_logprobs=top_k)
        seq = Sequence(request_id, prompt[:num_prompt], params, 0.0, output_token_ids=prompt[num_prompt:])
        seq.num_prompt_scored = scored
    seq.num_computed_tokens = computed
    seq.block_table = block_table
    return seq


@dataclass(frozen=True)
class _Burst:
    inner: GreedyBurst
    id: int

    @property
    def steps(self) -> int:
        return self.inner.steps


class MirroredRunner:
    """Rank 0's runner: each call replayed on every worker's runner, then run here."""

    def __init__(self, local: ModelRunner, group: RankGroup) -> None:
        self.local = local
        self.group = group
        self.max_burst = local.max_burst
        self.max_draft_rows = 0  # drafted bursts are not replayed on the workers: verify steps instead
        self.max_verify_rows = local.max_verify_rows
        self.step_seconds: dict[int, float] = {}  # not timed across ranks: the policy measures its steps
        self._next_burst = 0

    def execute(self, scheduled: list[ScheduledSequence]) -> tuple[torch.Tensor, list[Sequence]]:
        self.group.send(("execute", [(snapshot(s.seq), s.num_new_tokens, s.draft) for s in scheduled]))
        return self.local.execute(scheduled)

    def launch_greedy(self, seqs: list[Sequence], steps: int, continue_at: list[int] | None = None) -> GreedyBurst:
        self._next_burst += 1
        self.group.send(("launch", self._next_burst, [snapshot(s) for s in seqs], steps, continue_at))
        return _Burst(self.local.launch_greedy(seqs, steps, continue_at), self._next_burst)

    def read_greedy(self, burst: GreedyBurst) -> list[list[int]]:
        assert isinstance(burst, _Burst)
        self.group.send(("read", burst.id))
        return self.local.read_greedy(burst.inner)

    def launch_drafted(self, seqs: list[Sequence], steps: int, k: int) -> DraftedBurst:
        raise NotImplementedError("drafted bursts are not run under tensor parallelism (max_draft_rows is 0)")

    def read_drafted(self, burst: DraftedBurst) -> list[list[list[int]]]:
        raise NotImplementedError("drafted bursts are not run under tensor parallelism (max_draft_rows is 0)")

    def release(self) -> None:
        self.group.send(("release",))
        self.local.release()
        self.group.close()


def serve_commands(recv: Callable[[], tuple[Any, ...]], runner: ModelRunner) -> None:
    """A worker's loop: replays rank 0's runner calls until told to stop."""
    bursts: dict[int, GreedyBurst] = {}
    while True:
        command = recv()
        kind = command[0]
        if kind == "execute":
            runner.execute([ScheduledSequence(mirror(snap), n, draft) for snap, n, draft in command[1]])
        elif kind == "launch":
            _, burst_id, snaps, steps, continue_at = command
            bursts[burst_id] = runner.launch_greedy([mirror(s) for s in snaps], steps, continue_at)
        elif kind == "read":
            runner.read_greedy(bursts.pop(command[1]))
        elif kind == "release":
            runner.release()
        elif kind == "stop":
            return
