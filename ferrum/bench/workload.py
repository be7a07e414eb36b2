"""The benchmark workload: N requests with random prompt token ids and input/output lengths drawn
uniformly (both ends included) from ranges, reproducible from a seed; optionally behind one shared
random prefix, or with prompt texts from a list instead of random ids."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from ferrum.bench.errors import BenchError
from ferrum.tokenizer import Tokenizer

TokenPool = Sequence[int] | np.ndarray


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
    """What to send. Each request's prompt is `prefix_len` shared random token ids followed by its own
    random ids (`input_len` of them), or, when `prompts` is given, prompt `i % len(prompts)` as text
    (then `input_len` is unused and there is no prefix). `output_len` gives each request's max_tokens."""

    num_prompts: int = 256  # requests per round (concurrency level)
    input_len: LengthRange = LengthRange(100, 1024)  # the per-request random part, without the prefix
    output_len: LengthRange = LengthRange(100, 1024)
    seed: int = 0
    ignore_eos: bool = True
    prefix_len: int = 0  # token ids shared by every request of every round (0: none)
    prompts: tuple[str, ...] = ()  # prompt texts handed out round-robin instead of random ids

    def __post_init__(self) -> None:
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be at least 1, got {self.num_prompts}")
        if self.prefix_len < 0:
            raise ValueError(f"prefix_len must be 0 or more, got {self.prefix_len}")
        if self.prompts and self.prefix_len:
            raise ValueError("a shared random prefix (--prefix-len) does not combine with a prompt list "
                             "(--prompts-file)")
        if not all(isinstance(p, str) and p for p in self.prompts):
            raise ValueError("every prompt of a prompt list must be a non-empty string")

    @property
    def dataset(self) -> str:
        """"random" (random token ids) or "prompt-list"."""
        return "prompt-list" if self.prompts else "random"

    @property
    def longest_request(self) -> int:
        """The most tokens one request may need, as far as is known before the server tokenizes:
        prefix plus the longest random part plus the longest output; with a prompt list, the
        longest output (the prompts' own lengths are the server's to check)."""
        if self.prompts:
            return self.output_len.high
        return self.prefix_len + self.input_len.high + self.output_len.high

    def describe_longest(self) -> str:
        """How `longest_request` adds up, e.g. "prefix 1536 + input 1024 + output 1024"."""
        if self.prompts:
            return f"output {self.output_len.high}, plus the prompt"
        prefix = f"prefix {self.prefix_len} + " if self.prefix_len else ""
        return f"{prefix}input {self.input_len.high} + output {self.output_len.high}"


@dataclass(frozen=True)
class BenchRequest:
    """One request: prompt token ids (the shared prefix first, `prefix_len` of them), or a prompt
    `text` (from a prompt list, or the ids decoded for the chat endpoint), and its max_tokens."""

    prompt_token_ids: tuple[int, ...]
    output_len: int
    prefix_len: int = 0
    text: str | None = None

    @property
    def prompt_len(self) -> int:
        """Prompt tokens as drawn (0 for a text from a prompt list: only the server knows them)."""
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


_LENGTHS, _WARMUP, _PROMPTS, _PREFIX = 0, 1, 2, 3  # separate random streams of one seed

WARMUP_TEXT = "Say hello."  # the warm-up prompt of a prompt-list workload: none of the list's prompts


def _draw(rng: np.random.Generator, pool: np.ndarray, input_len: int, output_len: int,
          prefix: tuple[int, ...] = ()) -> BenchRequest:
    ids = rng.choice(pool, size=input_len, replace=True)
    return BenchRequest((*prefix, *(int(t) for t in ids)), output_len, len(prefix))


def _pool(pool: TokenPool | None) -> np.ndarray:
    if pool is None:
        raise ValueError("a random-token workload needs a pool of token ids to draw from")
    return np.asarray(pool, dtype=np.int64)


def shared_prefix(spec: WorkloadSpec, pool: TokenPool | None) -> tuple[int, ...]:
    """The `spec.prefix_len` ids every request starts with: its own random stream of the seed, so the
    same in every round and independent of the per-request parts."""
    if spec.prefix_len == 0:
        return ()
    ids = np.random.default_rng([spec.seed, _PREFIX]).choice(_pool(pool), size=spec.prefix_len, replace=True)
    return tuple(int(t) for t in ids)


def make_workload(spec: WorkloadSpec, pool: TokenPool | None, round_index: int = 0,
                  num_requests: int | None = None) -> list[BenchRequest]:
    """`num_requests` (default `spec.num_prompts`) requests; the same arguments always give the same
    requests. Rounds share their lengths and the shared prefix but not their own prompt ids, so a
    round (e.g. one concurrency level) finds nothing of an earlier one in a server's prefix cache but
    the prefix. With a prompt list, request i gets prompt i % len(prompts) in every round, and `pool`
    may be None."""
    n = spec.num_prompts if num_requests is None else num_requests
    if n < 1:
        raise ValueError(f"a round needs at least one request, got {n}")
    lengths = np.random.default_rng([spec.seed, _LENGTHS])
    input_lens = lengths.integers(spec.input_len.low, spec.input_len.high, size=n, endpoint=True)
    output_lens = lengths.integers(spec.output_len.low, spec.output_len.high, size=n, endpoint=True)
    if spec.prompts:
        texts = spec.prompts
        return [BenchRequest((), int(o), text=texts[i % len(texts)]) for i, o in enumerate(output_lens)]
    ids = _pool(pool)
    prefix = shared_prefix(spec, ids)
    prompts = np.random.default_rng([spec.seed, _PROMPTS, round_index])
    return [_draw(prompts, ids, int(i), int(o), prefix) for i, o in zip(input_lens, output_lens, strict=True)]


def warmup_request(spec: WorkloadSpec, pool: TokenPool | None, max_output_len: int = 16) -> BenchRequest:
    """A request outside the workload (its own random stream, and never the shared prefix, so it
    primes no prefix cache entry the timed requests could hit), with the shortest input and a short
    output; with a prompt list, WARMUP_TEXT."""
    output_len = min(spec.output_len.low, max_output_len)
    if spec.prompts:
        return BenchRequest((), output_len, text=WARMUP_TEXT)
    rng = np.random.default_rng([spec.seed, _WARMUP])
    return _draw(rng, _pool(pool), spec.input_len.low, output_len)


def with_text(request: BenchRequest, decode: Callable[[Sequence[int]], str]) -> BenchRequest:
    """`request` with its ids as text (for the chat endpoint): the prefix and the rest decoded apart,
    so every request's text starts with the same prefix text. A request with a text keeps it."""
    if request.text is not None:
        return request
    ids = request.prompt_token_ids
    head = decode(ids[:request.prefix_len]) if request.prefix_len else ""
    return replace(request, text=head + decode(ids[request.prefix_len:]))


def load_prompts(path: str | Path) -> tuple[str, ...]:
    """The prompts of a JSON file holding a list of non-empty strings."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise BenchError(f"cannot read the prompts file {path}: {exc.strerror or exc}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BenchError(f"the prompts file {path} is not JSON: {exc}") from None
    if not isinstance(data, list) or not data or not all(isinstance(p, str) and p for p in data):
        raise BenchError(f"the prompts file {path} must hold a non-empty JSON list of non-empty strings")
    return tuple(data)
