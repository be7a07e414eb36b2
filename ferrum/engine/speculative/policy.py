"""When to draft and how much, so that speculation is never slower than plain decoding.

A verify step of B decoding sequences with M draft tokens in all processes B + M tokens and yields each
sequence 1 + (its accepted drafts) tokens. Whether that pays depends on two measured things:

    acceptance   each sequence's per-position acceptance rate a (the chance a draft token is kept given the
                 one before it was): the positions kept over the positions tried in its verified drafts
                 (each draft's kept ones and the refused one), older drafts' counts decaying by 0.9 a draft,
                 with the rate of every sequence (likewise counted, from a prior of 0.5) counting as two
                 positions tried; a draft's j-th token is then kept with chance a^j. (A first draft of 4 kept
                 in full moves the overall rate from 0.5 to 0.83, and its sequence's to 0.94.)
    step cost    t(T), the seconds a step of T tokens takes, measured on every step the engine runs whose
                 sequences all decode (plain or with drafts: a prefill's tokens cost otherwise), from its
                 start to its outputs (drafting and verification included; a greedy burst's iterations
                 each count as a step of its sequences): the median of the last 5 steps of each token
                 count (one slow step, a first call's set-up say, does not decide), made non-decreasing in
                 T and interpolated between counts (`StepCost`); where no step of about T tokens has run,
                 the device's time for a decode graph of T rows, timed at start-up (the prior; GPU only),
                 scaled by the nearest measured count (t(64) measured at 1.3 ms and the device's 256 rows
                 2.8x its 64: t(256) is taken as 3.6 ms until a step of 256 runs)

The rule: with t' = (t(B + M) - t(B)) / M the cost of one more token in the step and G = B + (expected
accepted) the tokens the step yields, a draft position j of a sequence is worth its cost when a^j / G >= t' /
t(B + M), i.e. when the throughput it adds is at least the time it adds, and a^j is at least 0.1 (a position
kept less often is not worth the host's and the verification's work however cheap its token). Each sequence
keeps its positions from the first while they pass (a^j falls with j); then the step as a whole must promise
5% more than a plain one, (B + expected kept) / t(B + M kept) >= 1.05 B / t(B), or nothing is drafted. So a
memory-bound step (t' near 0: large models at small batch) drafts everything the proposer offers, while a
compute-bound one (the CPU, large batches) drafts only where acceptance is high, and nothing when it is low.
Until t(B + M) has been measured (or is given by the prior) the policy drafts (that measures it); until 4
draft positions have been verified (the acceptance unknown), a batch of up to 8 sequences drafts (that
measures it), while larger ones are judged at the prior acceptance of 0.5 (a step of 64 sequences' drafts cost
an H100 7-18 ms of host work, of proposing and verifying, whatever the drafts' rows); t(B) itself must have
been measured on a plain step of B sequences (else this step is one; the prior scaled from the drafted steps'
times misjudged a plain step of one sequence, whose fused one-row chain the device runs far faster than the
rows of a draft), and is measured again after every 32 verify steps of that size, since a step's time drifts
as the contexts grow; likewise, after 32 steps of one batch size class (each size up to 8, then by 16s) whose
drafts the rule refused, one step drafts again (in between, the proposer is not even asked), so that t(B + M)
is measured again too (a refusal must not rest on an old measurement for ever); each such retry the rule
refuses again doubles the wait before the next (up to 1024 steps), so that where speculation does not pay
(large batches) the retries cost next to nothing. A greedy burst ends at its last iteration, so that the
proposer can draft before the next step, only where the rule would draft for its sequences now (`promising`);
elsewhere bursts chain, and small batches' are queued ahead, as without speculation (on an H100 with the demo
model, bursts ended for drafts the rule then refused cost 15-20% of the throughput at 64 and 256 requests at
once: the host's detokenizing no longer overlapped the next burst). `disable_by_batch_size` turns drafting off
from that many running sequences on, whatever the measurements; `adaptive: false` drafts whatever the proposer
offers.
"""

from __future__ import annotations

import bisect
import statistics
from collections import deque
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass, field

from ferrum.engine.sequence import Sequence
from ferrum.engine.speculative.config import SpeculativeConfig

PRIOR_ACCEPTANCE = 0.5  # before any sequence has been verified
DECAY = 0.9  # the weight of a verified draft's counts of positions tried and kept, a draft later
PRIOR_WEIGHT = 2.0  # positions tried that the prior counts as (0.5 overall; every sequence's rate for one)
RECENT_STEPS = 5  # a token count's step time: the median of its last this many steps
MIN_KEEP_CHANCE = 0.1  # a draft position kept less often than this is not tried, however cheap its token
MARGIN = 0.05  # a verify step must promise this much more throughput than a plain one (the measurements' noise)
REMEASURE_EVERY = 32  # verify steps of one batch size between two plain ones (t(B) drifts as contexts grow),
# and refused steps before one that drafts anyway (t(B + M) too), doubled after each refused retry
MAX_RETRY_WAIT = 1024
MIN_EVIDENCE = 4.0  # positions tried (decayed) below which the acceptance is not known: drafts are verified
EXPLORE_SEQS = 8  # ... at batches of up to this many sequences (larger ones take the prior acceptance)


@dataclass
class StepCost:
    """t(T): the median of the last RECENT_STEPS steps' seconds, by the steps' token count; where no step
    of about T tokens has run yet, the prior (the device's time for T rows, timed at start-up) scaled to the
    measured steps."""

    samples: dict[int, deque[float]] = field(default_factory=dict)
    prior: dict[int, float] = field(default_factory=dict)  # rows -> device seconds (GPUModelRunner.step_seconds)

    def observe(self, tokens: int, seconds: float) -> None:
        self.samples.setdefault(tokens, deque(maxlen=RECENT_STEPS)).append(seconds)

    @property
    def seconds(self) -> dict[int, float]:
        return {count: statistics.median(recent) for count, recent in self.samples.items()}

    def estimate(self, tokens: int) -> float | None:
        """t(tokens) from the measured counts made non-decreasing (a step of more tokens never takes less:
        each count's time is at least the largest of the smaller counts'), interpolated linearly between
        the nearest. Beyond the measured range, the nearest measured count's time times the prior's ratio
        of the two counts (a first step of 64 sequences' drafts is weighed by the 64-sequence steps run, and
        by how much more the device takes for the drafts' rows); the prior alone where nothing is measured;
        None where neither covers it."""
        seconds = self.seconds  # (medians: computed once)
        measured = _interpolate(seconds, tokens)
        if measured is not None:
            return measured
        prior = _interpolate(self.prior, tokens)
        if prior is None or not seconds:
            return prior
        counts = sorted(seconds)
        nearest = counts[-1] if tokens > counts[-1] else counts[0]
        base, prior_base = _interpolate(seconds, nearest), _interpolate(self.prior, nearest)
        if base is None or not prior_base:  # (base is never None: nearest is measured)
            return None
        return base * prior / prior_base

    def curve(self) -> list[tuple[int, float]]:
        """The measured (tokens, seconds) points, by token count."""
        return sorted(self.seconds.items())


def _interpolate(points: dict[int, float], tokens: int) -> float | None:
    """The value at `tokens` of the points made non-decreasing, linear between neighbours; None outside them."""
    counts = sorted(points)
    envelope, highest = [], 0.0
    for count in counts:
        highest = max(highest, points[count])
        envelope.append(highest)
    i = bisect.bisect_left(counts, tokens)
    if i < len(counts) and counts[i] == tokens:
        return envelope[i]
    if i == 0 or i == len(counts):
        return None
    lo, hi = counts[i - 1], counts[i]
    return envelope[i - 1] + (envelope[i] - envelope[i - 1]) * (tokens - lo) / (hi - lo)


class SpeculationPolicy:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.cost = StepCost()
        self.acceptance = PRIOR_ACCEPTANCE  # every sequence's rate (see verified)
        self._kept = self._tried = 0.0
        self._since_plain: dict[int, int] = {}  # batch size -> verify steps since its last plain step
        self._refused: dict[int, int] = {}  # size class -> steps whose drafts were refused since one drafted
        self._retry_after: dict[int, int] = {}  # size class -> refusals before drafting again (doubling)

    def rate(self, seq: Sequence) -> float:
        return seq.spec_acceptance if seq.spec_acceptance is not None else self.acceptance

    def allowed(self, running: int) -> bool:
        """Whether any sequence may draft this step, `running` sequences decoding or prefilling."""
        limit = self.config.disable_by_batch_size
        return limit is None or running < limit

    def refusing(self, batch: int) -> bool:
        """Whether the rule refused the last drafts offered at this batch size (the engine then chains greedy
        bursts as without speculation, until a step drafts again)."""
        return self.config.adaptive and self._refused.get(_size_class(batch), 0) > 0

    def skips(self, batch: int) -> bool:
        """Whether this step's drafts at this batch size are refused without being proposed: the rule refused
        the last ones and the retry is not due yet. Counts the refusal. (The proposer's search over hundreds
        of sequences costs the host milliseconds a step, for drafts the rule would refuse.)"""
        size = _size_class(batch)
        refused = self._refused.get(size, 0)
        if not self.config.adaptive or not refused or refused >= self._retry_after.get(size, REMEASURE_EVERY):
            return False
        self._refused[size] = refused + 1
        return True

    def trim(self, seqs: SequenceOf[Sequence], drafts: list[list[int]]) -> list[list[int]]:
        """The drafts worth verifying this step (see the module docstring), each a prefix of the proposed."""
        if not self.config.adaptive or not any(drafts):
            return drafts
        batch = len(seqs)
        none: list[list[int]] = [[] for _ in drafts]
        t0 = self.cost.estimate(batch) if batch in self.cost.samples else None  # measured at this very size
        if t0 is None or self._since_plain.get(batch, 0) >= REMEASURE_EVERY:
            self._since_plain[batch] = 0
            return none  # a plain step, which measures (again) what drafting is weighed against
        kept = self._judge(seqs, drafts, t0)
        size = _size_class(batch)
        if kept is None:
            self._refused[size] = self._refused.get(size, 0) + 1
            wait = self._retry_after.get(size, REMEASURE_EVERY)
            if self._refused[size] <= wait:
                return none
            self._retry_after[size] = min(2 * wait, MAX_RETRY_WAIT)
            self._refused[size] = 0
            self._since_plain[batch] = self._since_plain.get(batch, 0) + 1
            return drafts  # drafted again: t(B + M) measured anew
        self._refused[size] = 0
        self._retry_after.pop(size, None)
        self._since_plain[batch] = self._since_plain.get(batch, 0) + 1
        return kept

    def promising(self, seqs: SequenceOf[Sequence], each: int) -> bool:
        """Whether the next step would draft for these sequences, `each` tokens offered to every one, by the
        rule: a greedy burst ends at its last iteration only then, so that the proposer can draft before the
        next step; otherwise bursts chain as without speculation. Asked once a burst: where the rule refused
        drafts at this size class, the burst counts as one more refusal, and True comes back when the retry
        is due (`trim` then drafts again)."""
        if not self.config.adaptive:
            return True
        batch = len(seqs)
        if each <= 0 or not self.allowed(batch):
            return False
        size = _size_class(batch)
        refused = self._refused.get(size, 0)
        if refused:  # a chained burst counts as a step refused; the retry due ends the chain
            self._refused[size] = refused + 1
            return self._refused[size] >= self._retry_after.get(size, REMEASURE_EVERY)
        if batch not in self.cost.samples:
            return True  # t(B) not measured at this size: the next step measures it (trim)
        return self._judge(seqs, [[0] * each for _ in seqs], self.cost.estimate(batch) or 0.0) is not None

    def _judge(self, seqs: SequenceOf[Sequence], drafts: list[list[int]], t0: float) -> list[list[int]] | None:
        """The rule (module docstring): each draft cut to the positions worth their cost, or None when the
        step as a whole does not promise MARGIN more than a plain one. Unmeasured costs: the drafts as they
        are (a step that measures them)."""
        batch = len(seqs)
        extra = sum(len(d) for d in drafts)
        t1 = self.cost.estimate(batch + extra)
        if t1 is None:
            return drafts  # the step's cost not known yet: this step measures it
        if batch <= EXPLORE_SEQS and self._tried < MIN_EVIDENCE and all(s.spec_acceptance is None for s in seqs):
            return drafts  # no acceptance known yet: this small step measures it
        expected = batch + sum(expected_kept(self.rate(s), len(d)) for s, d in zip(seqs, drafts, strict=True))
        threshold = max(0.0, (t1 - t0) / extra) / t1 * expected
        kept = []
        for seq, draft in zip(seqs, drafts, strict=True):
            a, chance, n = self.rate(seq), 1.0, 0
            for _ in draft:
                chance *= a
                if chance < max(threshold, MIN_KEEP_CHANCE):
                    break
                n += 1
            kept.append(draft[:n])
        # the step as a whole: its expected tokens a second against a plain step's
        extra = sum(len(d) for d in kept)
        t_kept = self.cost.estimate(batch + extra) if extra else t0
        gained = batch + sum(expected_kept(self.rate(s), len(d)) for s, d in zip(seqs, kept, strict=True))
        if not extra or t_kept is None or gained / t_kept < batch / t0 * (1 + MARGIN):
            return None
        return kept

    def verified(self, seq: Sequence, drafted: int, accepted: int) -> None:
        """A sequence's draft of `drafted` tokens had its first `accepted` kept: the positions tried (the
        kept ones, and the refused one if any) and kept are counted, for the sequence and for all."""
        if drafted == 0:
            return
        tried = accepted + (1 if accepted < drafted else 0)
        self._kept = self._kept * DECAY + accepted
        self._tried = self._tried * DECAY + tried
        self.acceptance = (self._kept + PRIOR_WEIGHT * PRIOR_ACCEPTANCE) / (self._tried + PRIOR_WEIGHT)
        seq.spec_kept = seq.spec_kept * DECAY + accepted
        seq.spec_tried = seq.spec_tried * DECAY + tried
        seq.spec_acceptance = (seq.spec_kept + PRIOR_WEIGHT * self.acceptance) / (seq.spec_tried + PRIOR_WEIGHT)


def _size_class(batch: int) -> int:
    """Batch sizes that share a refusal: each up to 8, then by 16s (as the decode graphs' buckets). A batch
    whose requests end one by one passes through every size, and a refusal at 64 holds at 63."""
    return batch if batch <= 8 else -(-batch // 16) * 16


def expected_kept(a: float, n: int) -> float:
    """a + a^2 + ... + a^n: the expected number of a draft's n tokens kept."""
    total, chance = 0.0, 1.0
    for _ in range(n):
        chance *= a
        total += chance
    return total
