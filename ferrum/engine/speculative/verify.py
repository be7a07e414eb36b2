"""Verifying a step's drafts against the target model's logits: each sequence gets the tokens a plain
decode would have given it, in distribution (greedy: the very same tokens).

The step's forward pass gives, for a sequence with draft d_1 .. d_m, the target's logits at m + 1
positions: after its last token, then after each draft token. Position by position (every sequence at that
position at once), the logits go through exactly what a plain decode's sampling does with the sequence as
it stands then: penalties over its output so far (the accepted drafts included), logit bias, its grammar's
mask after the accepted drafts, temperature, top-k / top-p / min-p (ferrum.engine.sampler.target). Then:

    greedy    d_j is kept when it is the arg-max; the first one that is not is replaced by the arg-max
    sampled   d_j is kept with probability p(d_j) (the proposer's distribution is d_j alone, so that is
              min(1, p/q)); a refused d_j is replaced by a token drawn from p with d_j taken out,
              renormalised: every token then comes out with probability p (rejection sampling)
    all kept  one more token is drawn at the last position (the bonus)

Each kept or drawn token is appended through the output processor one at a time, so that stop tokens,
stop strings, max_tokens, the grammar's end and logprobs act inside a run as they act on single tokens; a
sequence that stops takes nothing after. A seeded request draws its acceptances and tokens from its own
generator, so a run repeats itself exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrum.engine.output_processor import OutputProcessor
from ferrum.engine.sampler import SampleResult, draw, plain_greedy, target
from ferrum.engine.sequence import Sequence
from ferrum.engine.structured import Guides


@dataclass
class Draft:
    """One sequence's draft in a verify step, and the target's logits for it [len(tokens) + 1, V]."""

    seq: Sequence
    tokens: list[int]
    logits: torch.Tensor
    accepted: int = 0
    appended: int = 0
    open: bool = True


class Verifier:
    def __init__(self, outputs: OutputProcessor, guides: Guides) -> None:
        self.outputs = outputs
        self.guides = guides

    def verify(self, drafts: list[Draft]) -> None:
        """Appends each sequence's tokens (its kept drafts and one drawn token, fewer where it stops); each
        Draft's `accepted` and `appended` say how many."""
        if all(plain_greedy(d.seq.params) and d.seq.params.structured is None for d in drafts):
            self._verify_greedy(drafts)
            return
        position = 0
        while True:
            live = [d for d in drafts if d.open and not d.seq.is_finished and position < d.logits.shape[0]]
            if not live:
                return
            seqs = [d.seq for d in live]
            masks = self.guides.start_masks(seqs)
            dist = target(torch.stack([d.logits[position] for d in live]), seqs,
                          masks.for_rows(seqs) if masks is not None else None)
            greedy = dict(zip(dist.greedy_rows, dist.greedy_ids.tolist(), strict=True))
            sampled = {row: i for i, row in enumerate(dist.sampled_rows)}
            for row, d in enumerate(live):
                proposed = d.tokens[position] if position < len(d.tokens) else None
                token, kept = self._choose(d.seq, proposed, greedy.get(row), dist.probs, sampled.get(row))
                self.outputs.append([d.seq], SampleResult([token], [dist.logprobs(row, token)]))
                d.appended += 1
                if kept:
                    d.accepted += 1
                else:
                    d.open = False
            position += 1

    def _verify_greedy(self, drafts: list[Draft]) -> None:
        """Every sequence greedy on the raw logits: each row's arg-max, all rows' in one transfer, then the
        same walk as `verify` on the host."""
        rows = torch.cat([d.logits for d in drafts]) if len(drafts) > 1 else drafts[0].logits
        chosen = rows.argmax(dim=-1).tolist()
        start = 0
        for d in drafts:
            for position in range(d.logits.shape[0]):
                if d.seq.is_finished:
                    break
                token = chosen[start + position]
                self.outputs.append([d.seq], SampleResult([token], [None]))
                d.appended += 1
                if position == len(d.tokens) or token != d.tokens[position]:
                    break
                d.accepted += 1
            d.open = False
            start += d.logits.shape[0]

    @staticmethod
    def _choose(seq: Sequence, proposed: int | None, greedy: int | None, probs: torch.Tensor,
                row: int | None) -> tuple[int, bool]:
        """(the token for this position, whether it is the proposed one kept)."""
        if greedy is not None:
            return greedy, proposed is not None and greedy == proposed
        assert row is not None
        p = probs[row]
        if proposed is None:  # the bonus: a plain draw
            return int(draw(p[None], [seq.generator])[0]), False
        u = float(torch.rand(1, generator=seq.generator)) if seq.generator is not None else float(torch.rand(1))
        if u < float(p[proposed]):
            return proposed, True
        rest = p.clone()
        rest[proposed] = 0.0
        total = float(rest.sum())
        rest = rest / total if total > 0 else p  # (p(proposed) = 1 is always kept: u < 1)
        return int(draw(rest[None], [seq.generator])[0]), False
