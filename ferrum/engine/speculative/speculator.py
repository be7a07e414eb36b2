"""`Speculator`: the engine's speculation, one per engine: the proposer, the policy, and the counts of
drafts and accepted tokens (the metrics' source)."""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

from ferrum.engine.sequence import Sequence
from ferrum.engine.speculative.config import SpeculativeConfig
from ferrum.engine.speculative.policy import SpeculationPolicy, expected_kept
from ferrum.engine.speculative.proposer import NgramProposer, Proposer
from ferrum.engine.speculative.verify import Draft


@dataclass
class SpeculationStats:
    """Counted as vLLM counts them: drafts verified, their tokens, the tokens kept, and the tokens kept at
    each draft position (position 0 first)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verified draft's step gives its sequence on average: 1 + the accepted ones."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


def proposer_for(config: SpeculativeConfig) -> Proposer:
    return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, proposer: Proposer | None = None,
                 verify_rows: int = 0, step_seconds: dict[int, float] | None = None) -> None:
        """`proposer`: one of the caller's (a public hook, e.g. for benchmarks), else the config's.
        `verify_rows`: the most rows (a row for each sequence, and one for each draft token) a step runs through
        the runner's graphs; drafts are cut to fit (a step past them runs eagerly, like a prefill: 64 ms for
        1,024 rows of the demo model on an H100, against 3 ms for 256 through a graph). 0: no such bound.
        `step_seconds`: the device's time for a step of so many rows, timed at start-up (the policy's prior)."""
        self.config = config
        self.max_model_len = max_model_len
        self.verify_rows = verify_rows
        self.proposer = proposer or proposer_for(config)
        self.policy = SpeculationPolicy(config)
        self.policy.cost.prior = dict(step_seconds or {})
        self.stats = SpeculationStats(accepted_per_position=[0] * config.num_speculative_tokens)

    def prepare(self, running: SequenceOf[Sequence]) -> None:
        """Sets every running sequence's draft for the next step (empty for most)."""
        for seq in running:
            seq.draft_token_ids = []
        if not self.policy.allowed(len(running)):
            return
        decoding = [s for s in running if s.num_uncomputed_tokens == 1 and not s.is_finished and not s.scores_prompt]
        if self.policy.skips(len(decoding)):
            return
        # a draft and the token drawn after it never pass the request's max_tokens nor max_model_len
        each = self.drafts_each(len(running), len(decoding), self.verify_rows)
        if each <= 0:
            return
        limits = [min(each, s.params.max_tokens - len(s.output_token_ids) - 1,
                      self.max_model_len - s.num_tokens - 1) for s in decoding]
        drafts = self.policy.trim(decoding, self.proposer.propose(decoding, limits))
        for seq, draft in zip(decoding, drafts, strict=True):
            seq.draft_token_ids = draft

    @property
    def drafts_on_device(self) -> bool:
        """Whether the proposer's rule also runs on the device (prompt lookup: ferrum.engine.draft_bursts);
        not a caller's own proposer."""
        return type(self.proposer) is NgramProposer

    def drafts_next(self, seqs: SequenceOf[Sequence]) -> bool:
        """Whether the next step may draft for these decoding sequences (k each, or fewer where their rows would
        not fit the graphs: `prepare`'s cut), by the policy's rule; a greedy burst of them ends at its last
        iteration only then (else bursts chain as without speculation)."""
        return self.policy.promising(seqs, self.drafts_each(len(seqs), len(seqs), self.verify_rows))

    def drafts_each(self, num_seqs: int, drafting: int, rows: int) -> int:
        """Drafts a sequence: num_speculative_tokens, or fewer where a step's `num_seqs` rows and `drafting`
        sequences' drafts would pass `rows` (the graphs' rows; 0: no bound). May be 0 or less: none fit."""
        each = self.config.num_speculative_tokens
        return min(each, (rows - num_seqs) // max(drafting, 1)) if rows else each

    def device_drafts(self, running: SequenceOf[Sequence], k: int) -> int:
        """k when the policy says drafting k tokens for each sequence of the running batch pays (it keeps any of
        them), else 0: a drafted burst, or a plain one."""
        if not self.policy.allowed(len(running)) or self.policy.skips(len(running)):
            return 0
        return k if any(self.policy.trim(running, [[0] * k for _ in running])) else 0

    def expected_tokens(self, seqs: SequenceOf[Sequence], k: int) -> float:
        """The tokens a sequence is expected to gain per verified draft of k, at the measured acceptance."""
        return 1.0 + sum(expected_kept(self.policy.rate(s), k) for s in seqs) / max(len(seqs), 1)

    def verified(self, draft: Draft) -> None:
        self.counted(draft.seq, len(draft.tokens), draft.accepted)

    def counted(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A draft of `drafted` tokens of `seq` had its first `accepted` kept."""
        self.policy.verified(seq, drafted, accepted)
        self.stats.num_drafts += 1
        self.stats.num_draft_tokens += drafted
        self.stats.num_accepted_tokens += accepted
        for position in range(accepted):
            self.stats.accepted_per_position[position] += 1

    def observe_step(self, tokens: int, seconds: float) -> None:
        """A step of `tokens` tokens took `seconds` (forward pass and sampling): the policy's cost curve."""
        self.policy.cost.observe(tokens, seconds)

    def forget(self, request_id: str) -> None:
        self.proposer.forget(request_id)
