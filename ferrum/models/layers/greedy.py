"""GPU: the end of every decode graph. Each row's argmax becomes its next input and is recorded for
the host (greedy bursts replay a graph several times with no host work between, and copy the
chosen ids back once); positions, context lengths and KV slots move one token on, on the device."""

from __future__ import annotations

import torch


def greedy_advance(logits: torch.Tensor, tokens: torch.Tensor, step: torch.Tensor, ids: torch.Tensor,
                   positions: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                   page: int, num_real: torch.Tensor, pdl: bool) -> None:
    """For the first num_real rows of logits [B, V]: tokens[step] = ids = argmax (the first index on
    ties, as torch.argmax); positions and lens += 1; slots = the KV slot of the new position. Then
    step += 1. ids, positions, slots and lens are int64 [B], tables int32 [B, max_blocks], step and
    num_real int64 [1]."""
    from ferrum.kernels.greedy import greedy_advance as advance

    advance(logits, tokens, step, ids, positions, lens, slots, tables, page, num_real, pdl=pdl)
