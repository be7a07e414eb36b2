"""The proposer seam: what drafts a decoding sequence's next tokens for the target model to verify.

A `Proposer` is asked once a step for the sequences the policy lets draft, each with the most tokens it may
draft, and answers a list of token ids per sequence (empty: nothing to offer). It sees the sequences'
tokens so far and keeps whatever state it likes per request id (`forget` drops it).

    NgramProposer   prompt lookup: the last n tokens (prompt_lookup_max down to prompt_lookup_min) matched
                    against everything before them, prompt and output; the tokens after the most recent
                    match are the draft. On the host, over a NumPy copy of each sequence's tokens kept up to
                    date incrementally; no model.
"""

from __future__ import annotations

from collections.abc import Sequence as SequenceOf
from typing import Protocol

import numpy as np

from ferrum.engine.sequence import Sequence


class Proposer(Protocol):
    def propose(self, seqs: SequenceOf[Sequence], limits: SequenceOf[int]) -> list[list[int]]:
        """Up to limits[i] draft tokens for each decoding sequence seqs[i] (its tokens so far are
        prompt_token_ids + output_token_ids; the draft follows them)."""
        ...

    def forget(self, request_id: str) -> None:
        """The request is done: drop what is kept for it."""
        ...


class NgramProposer:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._tokens: dict[str, tuple[np.ndarray, int]] = {}  # request id -> (buffer, tokens in it)

    def propose(self, seqs: SequenceOf[Sequence], limits: SequenceOf[int]) -> list[list[int]]:
        return [self._draft(self._array(seq), limit) if limit > 0 else [] for seq, limit in zip(seqs, limits,
                                                                                              strict=True)]

    def forget(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)

    def _array(self, seq: Sequence) -> np.ndarray:
        """The sequence's tokens as int64, kept per request and extended by the new ones only."""
        total = seq.num_tokens
        buffer, have = self._tokens.get(seq.request_id, (np.empty(0, dtype=np.int64), 0))
        if have > total:  # (a request id reused: start over)
            buffer, have = np.empty(0, dtype=np.int64), 0
        if total > buffer.shape[0]:
            grown = np.empty(max(total, 2 * buffer.shape[0], 256), dtype=np.int64)
            grown[:have] = buffer[:have]
            buffer = grown
        if have < total:
            buffer[have:total] = seq.tokens(have, total)
        self._tokens[seq.request_id] = (buffer, total)
        return buffer[:total]

    def _draft(self, tokens: np.ndarray, limit: int) -> list[int]:
        """The tokens that followed the most recent earlier occurrence of the longest suffix n-gram."""
        length = tokens.shape[0]
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = tokens[length - n :]
            # occurrences starting at j = 0 .. length - n - 1 (one token at least follows each)
            starts = np.flatnonzero(tokens[: length - n] == suffix[0])
            for i in range(1, n):  # narrowed one token at a time, vectorized
                starts = starts[tokens[starts + i] == suffix[i]]
            if starts.size:
                j = int(starts[-1])  # the most recent
                return tokens[j + n : j + n + limit].tolist()
        return []
