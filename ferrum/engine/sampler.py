"""Turns a step's logits into one token per sequence, with logprobs when asked.

Logprobs are those of the model's raw distribution (before penalties, logit bias, grammar masks and
temperature), as vLLM reports them by default. A grammar's mask (ferrum.engine.structured) and a
request's logit bias apply before greedy choice and sampling alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrum.engine.sampling_params import SamplingParams
from ferrum.engine.sequence import Sequence


@dataclass(frozen=True)
class SampleResult:
    token_ids: list[int]
    # per sequence: (chosen logprob, [(top id, top logprob), ...]) or None
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


def sample(logits: torch.Tensor, seqs: list[Sequence], mask: torch.Tensor | None = None) -> SampleResult:
    """logits: [B, V] float32 on any device, one row per sequence in `seqs`; `mask`: the grammars'
    token bitmask [B, ceil(V/32)] int32 on the host (Guides), or None. The work stays on the logits'
    device; the chosen ids come back to the host in one transfer (logprobs add more)."""
    params = [s.params for s in seqs]
    if mask is None and all(plain_greedy(p) for p in params):
        return SampleResult(logits.argmax(dim=-1).tolist(), [None] * len(seqs))
    dist = target(logits, seqs, mask)
    token_ids = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
    if dist.greedy_rows:
        token_ids[dist.greedy_index] = dist.greedy_ids
    if dist.sampled_rows:
        token_ids[dist.sampled_index] = draw(dist.probs, [seqs[i].generator for i in dist.sampled_rows])
    chosen = token_ids.tolist()
    return SampleResult(chosen, [dist.logprobs(i, chosen[i]) for i in range(len(seqs))])


@dataclass(frozen=True)
class Target:
    """The distribution a step's rows are sampled from, after penalties, logit bias, the grammars' masks,
    temperature and top-k / top-p / min-p: greedy rows by their arg-max, sampled rows by their probabilities
    (ferrum.engine.speculative.verify checks drafts against it), and the raw logprobs where asked."""

    seqs: list[Sequence]
    greedy_rows: list[int]
    greedy_ids: torch.Tensor  # [len(greedy_rows)] on the logits' device
    sampled_rows: list[int]
    probs: torch.Tensor  # [len(sampled_rows), V]
    raw_logprobs: torch.Tensor | None  # [B, V] when any row asks for logprobs

    @property
    def greedy_index(self) -> torch.Tensor:
        return torch.tensor(self.greedy_rows, device=self.greedy_ids.device)

    @property
    def sampled_index(self) -> torch.Tensor:
        return torch.tensor(self.sampled_rows, device=self.probs.device)

    def logprobs(self, row: int, token: int) -> tuple[float, list[tuple[int, float]]] | None:
        """Row `row`'s logprob of `token` and its top ones (the raw distribution), if the row asks."""
        n = self.seqs[row].params.logprobs
        if n is None or self.raw_logprobs is None:
            return None
        values = self.raw_logprobs[row]
        top: list[tuple[int, float]] = []
        if n > 0:
            best, ids = values.topk(n)
            top = list(zip(ids.tolist(), best.tolist(), strict=True))
        return float(values[token]), top


def target(logits: torch.Tensor, seqs: list[Sequence], mask: torch.Tensor | None = None) -> Target:
    """The distribution of each row of logits [B, V] for its sequence (see Target)."""
    params = [s.params for s in seqs]
    raw_logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs is not None for p in params) else None
    device = logits.device
    logits = _apply_logit_bias(_apply_penalties(logits, seqs), params)
    if mask is not None:
        from ferrum.engine.structured import Guides

        logits = Guides.apply(logits, mask)
    greedy_rows = [i for i, p in enumerate(params) if p.greedy]
    greedy_ids = logits[torch.tensor(greedy_rows, device=device)].argmax(dim=-1) if greedy_rows else \
        torch.empty(0, dtype=torch.long, device=device)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    probs = torch.empty(0, logits.shape[1], device=device)
    if sampled_rows:
        probs = _filtered_probs(logits[torch.tensor(sampled_rows, device=device)], [params[i] for i in sampled_rows])
    return Target(seqs, greedy_rows, greedy_ids, sampled_rows, probs, raw_logprobs)


def _apply_logit_bias(logits: torch.Tensor, params: list) -> torch.Tensor:
    rows = [(i, p.logit_bias) for i, p in enumerate(params) if p.logit_bias]
    if not rows:
        return logits
    logits = logits.clone()
    for i, bias in rows:
        ids = torch.tensor([t for t, _ in bias], dtype=torch.long, device=logits.device)
        values = torch.tensor([b for _, b in bias], dtype=logits.dtype, device=logits.device)
        logits[i].index_add_(0, ids, values)
    return logits


def plain_greedy(p: SamplingParams) -> bool:
    """Greedy with nothing that changes or reports the logits (no penalties, bias or logprobs): the arg-max
    of the raw logits is the whole sampling (a grammar's mask aside, which the caller checks)."""
    return p.greedy and p.logprobs is None and _no_penalties(p) and not p.logit_bias


def _no_penalties(p: SamplingParams) -> bool:
    return p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty


def _apply_penalties(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    rows = [i for i, s in enumerate(seqs) if not _no_penalties(s.params)]
    if not rows:
        return logits
    logits = logits.clone()
    vocab = logits.shape[1]
    for i in rows:
        p, seq = seqs[i].params, seqs[i]
        row = logits[i]
        if p.repetition_penalty != 1.0:
            ids = seq.prompt_token_ids + seq.output_token_ids
            seen = torch.tensor(ids, dtype=torch.long, device=logits.device).unique()
            seen = seen[seen < vocab]
            vals = row[seen]
            row[seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and seq.output_token_ids:
            out = torch.tensor(seq.output_token_ids, dtype=torch.long, device=logits.device)
            out = out[out < vocab]
            ones = torch.ones_like(out, dtype=logits.dtype)
            counts = torch.zeros(vocab, dtype=logits.dtype, device=logits.device).scatter_add_(0, out, ones)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def _filtered_probs(logits: torch.Tensor, params: list) -> torch.Tensor:
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device).unsqueeze(1)
    logits = logits / temps
    top_ks = [p.top_k for p in params]
    if any(k > 0 for k in top_ks):
        vocab = logits.shape[1]
        ks = torch.tensor([k if k > 0 else vocab for k in top_ks], device=device).clamp(max=vocab)
        sorted_logits = logits.sort(dim=-1, descending=True).values
        kth = sorted_logits.gather(1, (ks - 1).unsqueeze(1))
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    top_ps = torch.tensor([p.top_p for p in params], dtype=probs.dtype, device=device)
    if any(p.top_p < 1.0 for p in params):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        # drop a token when the mass before it already reaches top_p; the first is always kept (a
        # top_p too small for float32, such as 1e-300, is 0 here and would otherwise drop every token)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_ps.unsqueeze(1)
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    min_ps = torch.tensor([p.min_p for p in params], dtype=probs.dtype, device=device)
    if any(p.min_p > 0 for p in params):
        threshold = probs.max(dim=-1, keepdim=True).values * min_ps.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return probs / probs.sum(dim=-1, keepdim=True)


def draw(probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token from each row of probs [R, V], a row with a generator drawn on the host with it."""
    out = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if unseeded:
        idx = torch.tensor(unseeded, device=probs.device)
        out[idx] = torch.multinomial(probs[idx], 1).squeeze(1)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if seeded:  # seeded requests draw on the host with their own generator: reproducible anywhere
        host = probs[torch.tensor(seeded, device=probs.device)].cpu()  # one transfer for all of them
        drawn = [int(torch.multinomial(host[k], 1, generator=generators[i]).item()) for k, i in enumerate(seeded)]
        out[torch.tensor(seeded, device=probs.device)] = torch.tensor(drawn, dtype=out.dtype).to(probs.device)
    return out
