"""`ReplayProposer`: a proposer for measuring speculative decoding's mechanism on random-weight models, whose
outputs no n-gram predicts. It replays each request's recorded greedy output (from a plain run of the same
prompts), each draft token the recorded one with probability `acceptance`, independently per position, else
a token the target refuses (the recorded one plus one): under greedy decoding every position is then kept
with that probability (given the ones before it were). Installed with LLMEngine.use_proposer."""

from __future__ import annotations

import random
from collections.abc import Mapping
from collections.abc import Sequence as SequenceOf

from ferrum.engine.sequence import Sequence


class ReplayProposer:
    def __init__(self, recorded: Mapping[tuple[int, ...], list[int]], acceptance: float, vocab_size: int,
                 seed: int = 0) -> None:
        """`recorded`: each prompt's greedy output tokens, keyed by the prompt's ids."""
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"acceptance must be in [0, 1], got {acceptance}")
        self.recorded = recorded
        self.acceptance = acceptance
        self.vocab_size = vocab_size
        self._rng = random.Random(seed)

    def propose(self, seqs: SequenceOf[Sequence], limits: SequenceOf[int]) -> list[list[int]]:
        drafts = []
        for seq, limit in zip(seqs, limits, strict=True):
            output = self.recorded.get(tuple(seq.prompt_token_ids), [])
            done = len(seq.output_token_ids)
            drafts.append([t if self._rng.random() < self.acceptance else (t + 1) % self.vocab_size
                           for t in output[done : done + limit]])
        return drafts

    def forget(self, request_id: str) -> None:
        """Nothing is kept per request."""
