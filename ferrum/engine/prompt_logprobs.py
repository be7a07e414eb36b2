"""Prompt logprobs: scoring the prompt tokens of the requests that ask for them (SamplingParams.prompt_logprobs)
from the hidden states of the step that computes them.

The hidden state at position p gives the distribution of the token at p + 1, so a prefill chunk over
positions [a, b) scores the prompt tokens at a + 1 .. b (up to the prompt's last token; the last
position's state is the one sampled from). `pack_step` (ferrum.engine.runner) plans the rows
(`PromptRows`); `score_prompt_rows` turns them into `PromptScores` on the host, a few rows at a time, so
that the [rows, vocab] logits stay small. Only requests that ask pay: other steps plan no rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

# Rows of logits made at once: [128, vocab] float32 is 66 MB at a 128k vocabulary, below what the
# memory planner's widest sampler call already needs (ferrum.engine.model_rank._widest_sample).
ROWS_PER_CHUNK = 128


@dataclass(frozen=True)
class PromptRows:
    """Consecutive rows of a step whose hidden states score prompt tokens: row first_row + i scores
    token_ids[i], the prompt token at position start + i."""

    first_row: int
    start: int  # >= 1: the first prompt token has no context to be scored from
    token_ids: list[int]
    top_k: int  # also the top_k most likely tokens at each position


@dataclass(frozen=True)
class PromptScores:
    """What `PromptRows` gave: per token, its logprob, its rank (1: the most likely) and the top_k
    (ids, logprobs), most likely first."""

    start: int
    token_ids: list[int]
    logprobs: list[float]
    ranks: list[int]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


def score_prompt_rows(
    hidden: torch.Tensor, compute_logits: Callable[[torch.Tensor], torch.Tensor], rows: PromptRows
) -> PromptScores:
    """`hidden`: the step's final hidden states [T, hidden]; `compute_logits`: the model's head (float32
    logits [n, vocab]; under tensor parallelism a collective, called the same way on every rank)."""
    logprobs: list[float] = []
    ranks: list[int] = []
    top_ids: list[list[int]] = []
    top_values: list[list[float]] = []
    n = len(rows.token_ids)
    for offset in range(0, n, ROWS_PER_CHUNK):
        m = min(ROWS_PER_CHUNK, n - offset)
        begin = rows.first_row + offset
        logits = compute_logits(hidden[begin : begin + m])
        targets = torch.tensor(rows.token_ids[offset : offset + m], dtype=torch.long, device=logits.device)
        chosen = logits.gather(1, targets.unsqueeze(1))  # [m, 1]
        lse = torch.logsumexp(logits, dim=-1, keepdim=True)
        rank = (logits > chosen).sum(dim=-1) + 1
        parts = [(chosen - lse).squeeze(1), rank.to(torch.float32)]
        if rows.top_k:
            values, ids = logits.topk(rows.top_k, dim=-1)
            parts += [(values - lse).flatten(), ids.flatten().to(torch.float32)]
        host = torch.cat(parts).cpu()  # one transfer; ids and ranks are exact in float32 below 2**24
        logprobs += host[:m].tolist()
        ranks += [int(r) for r in host[m : 2 * m].tolist()]
        if rows.top_k:
            k = rows.top_k
            top_values += host[2 * m : 2 * m + m * k].view(m, k).tolist()
            top_ids += [[int(i) for i in row] for row in host[2 * m + m * k :].view(m, k).tolist()]
        else:
            top_values += [[] for _ in range(m)]
            top_ids += [[] for _ in range(m)]
    return PromptScores(rows.start, list(rows.token_ids), logprobs, ranks, top_ids, top_values)
