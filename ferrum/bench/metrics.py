"""Per-request timings of a serving run, and the figures of one concurrency level made from them."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

TokenSource = Literal["usage", "chunks"]


@dataclass(frozen=True)
class RequestRecord:
    """One request as the client saw it. Times in seconds; `itl_s` holds the gaps between chunks
    that carried tokens. A failed request has `error` set and counts no tokens."""

    prompt_len: int  # prompt tokens: the server's usage count where it sent one, else as drawn
    output_len: int  # requested (max_tokens)
    output_tokens: int  # generated: from the response's usage, else the number of content chunks
    ttft_s: float
    itl_s: tuple[float, ...]
    latency_s: float
    error: str | None = None
    token_source: TokenSource = "usage"  # where `output_tokens` came from
    finish_reason: str | None = None  # the last one the stream gave
    text: str = ""  # the generated text, as streamed

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first; None with fewer than two tokens."""
        if self.output_tokens < 2:
            return None
        return (self.latency_s - self.ttft_s) / (self.output_tokens - 1)


@dataclass(frozen=True)
class Distribution:
    """Mean, median and 99th percentile in milliseconds; None when there were no samples."""

    mean_ms: float | None
    median_ms: float | None
    p99_ms: float | None
    count: int

    @classmethod
    def of_seconds(cls, values: Sequence[float]) -> Distribution:
        if not values:
            return cls(None, None, None, 0)
        ms = np.asarray(values, dtype=np.float64) * 1000.0
        return cls(float(ms.mean()), float(np.median(ms)), float(np.percentile(ms, 99)), len(values))


@dataclass(frozen=True)
class LevelResult:
    concurrency: int
    request_rate: float  # requests/s offered; math.inf: all at once
    num_requests: int
    completed: int
    failed: int
    first_error: str | None
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    requested_output_tokens: int  # sum of max_tokens over completed requests
    request_throughput: float  # completed requests/s
    output_throughput: float  # output tokens/s
    total_token_throughput: float  # (input + output) tokens/s
    ttft: Distribution
    tpot: Distribution
    itl: Distribution
    e2el: Distribution  # end-to-end latency
    token_sources: dict[str, int]  # completed requests per source of their output token count
    finish_reasons: dict[str, int]  # completed requests per finish reason ("none" where not given)


def _rate(amount: float, duration_s: float) -> float:
    return amount / duration_s if duration_s > 0 else 0.0


def summarize(
    records: Sequence[RequestRecord], duration_s: float, concurrency: int, request_rate: float = math.inf
) -> LevelResult:
    """The figures of one level: `records` of every request sent, `duration_s` from the first send
    to the last answer."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    input_tokens = sum(r.prompt_len for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    return LevelResult(
        concurrency=concurrency,
        request_rate=request_rate,
        num_requests=len(records),
        completed=len(done),
        failed=len(failed),
        first_error=failed[0].error if failed else None,
        duration_s=duration_s,
        total_input_tokens=input_tokens,
        total_output_tokens=output_tokens,
        requested_output_tokens=sum(r.output_len for r in done),
        request_throughput=_rate(len(done), duration_s),
        output_throughput=_rate(output_tokens, duration_s),
        total_token_throughput=_rate(input_tokens + output_tokens, duration_s),
        ttft=Distribution.of_seconds([r.ttft_s for r in done]),
        tpot=Distribution.of_seconds([t for r in done if (t := r.tpot_s) is not None]),
        itl=Distribution.of_seconds([gap for r in done for gap in r.itl_s]),
        e2el=Distribution.of_seconds([r.latency_s for r in done]),
        token_sources=dict(sorted(Counter(r.token_source for r in done).items())),
        finish_reasons=dict(sorted(Counter(str(r.finish_reason).lower() for r in done).items())),
    )


@dataclass(frozen=True)
class Acceptance:
    """A run's speculative decoding: drafts verified, their tokens, the tokens kept (and, where the engine
    says, the tokens kept at each draft position), as vLLM counts them."""

    num_drafts: float
    num_draft_tokens: float
    num_accepted_tokens: float
    accepted_per_position: tuple[float, ...] = ()

    @property
    def acceptance_rate(self) -> float:
        """The share of draft tokens kept."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verified draft's step gave its sequence on average: 1 + the kept ones."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
