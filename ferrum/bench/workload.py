"""The benchmark workload: N requests with random prompt token ids and input/output lengths drawn
uniformly (both ends included) from ranges, reproducible from a seed."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ferrum.tokenizer import Tokenizer


@dataclass(frozen=True)
class LengthRange:
    """Lengths from `low` to `high`, both included."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if self.low < 1 or self.high < self.low:
            raise ValueError(f"a length range needs 1 <= low <= high, got {self.low}:{self.high}")

    @classmethod
    def parse(cls, text: str) -> LengthRange:
        """"LOW:HIGH", or "N" for exactly N."""
        parts = text.split(":")
        try:
            if len(parts) == 1:
                return cls(int(parts[0]), int(parts[0]))
            if len(parts) == 2:
                return cls(int(parts[0]), int(parts[1]))
        except ValueError as exc:
            raise ValueError(f"invalid length range {text!r}: {exc}") from None
        raise ValueError(f"invalid length range {text!r}; expected N or LOW:HIGH")

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass(frozen=True)
class WorkloadSpec:
    num_prompts: int = 256
    input_len: LengthRange = LengthRange(100, 1024)
    output_len: LengthRange = LengthRange(100, 1024)
    seed: int = 0
    ignore_eos: bool = True

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be at least 1, got {self.num_prompts}")

    @property
    def longest_request(self) -> int:
        """The most tokens one request may need: the longest prompt plus the longest output."""
        return self.input_len.high + self.output_len.high


@dataclass(frozen=True)
class BenchRequest:
    prompt_token_ids: tuple[int, ...]
    output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def prompt_token_pool(tokenizer: Tokenizer, vocab_size: int | None = None) -> np.ndarray:
    """The ids prompts are drawn from: those below `vocab_size` (default: the tokenizer's) that the
    tokenizer does not treat as special, nor as BOS or EOS."""
    size = tokenizer.vocab_size if vocab_size is None else min(vocab_size, tokenizer.vocab_size)
    excluded = set(tokenizer.special_token_ids) | set(tokenizer.eos_token_ids)
    if tokenizer.bos_token_id is not None:
        excluded.add(tokenizer.bos_token_id)
    pool = np.setdiff1d(np.arange(size, dtype=np.int64), np.fromiter(excluded, dtype=np.int64))
    if pool.size == 0:
        raise ValueError("the tokenizer has no ordinary (non-special) token ids to draw prompts from")
    return pool


_LENGTHS, _WARMUP, _PROMPTS = 0, 1, 2  # separate random streams of one seed


def _draw(rng: np.random.Generator, pool: np.ndarray, input_len: int, output_len: int) -> BenchRequest:
    ids = rng.choice(pool, size=input_len, replace=True)
    return BenchRequest(tuple(int(t) for t in ids), output_len)


def make_workload(spec: WorkloadSpec, pool: Sequence[int] | np.ndarray, round_index: int = 0) -> list[BenchRequest]:
    """`spec.num_prompts` requests; the same spec, pool and round always give the same requests.
    Rounds share their lengths but not their prompt ids, so a round (e.g. one concurrency level) finds
    nothing of an earlier one in a server's prefix cache."""
    ids = np.asarray(pool, dtype=np.int64)
    lengths = np.random.default_rng([spec.seed, _LENGTHS])
    n = spec.num_prompts
    input_lens = lengths.integers(spec.input_len.low, spec.input_len.high, size=n, endpoint=True)
    output_lens = lengths.integers(spec.output_len.low, spec.output_len.high, size=n, endpoint=True)
    prompts = np.random.default_rng([spec.seed, _PROMPTS, round_index])
    return [_draw(prompts, ids, int(i), int(o)) for i, o in zip(input_lens, output_lens, strict=True)]


def warmup_request(spec: WorkloadSpec, pool: Sequence[int] | np.ndarray, max_output_len: int = 16) -> BenchRequest:
    """A request outside the workload (its own random stream, so it primes no prefix cache entry the
    timed requests could hit), with the shortest input and a short output."""
    rng = np.random.default_rng([spec.seed, _WARMUP])
    return _draw(rng, np.asarray(pool, dtype=np.int64), spec.input_len.low,
                 min(spec.output_len.low, max_output_len))
