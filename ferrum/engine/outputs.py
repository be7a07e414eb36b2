"""What the engine hands back to the API layer, one delta per step per request (merged when the
reader falls behind)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str  # the token's text, decoded on its own
    logprob: float


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float
    top: tuple[TopLogprob, ...]  # empty unless the request asked for top logprobs
    rank: int | None = None  # prompt logprobs: the token's rank in its distribution (1: the most likely)


@dataclass(frozen=True)
class RequestOutput:
    """New text and tokens since the last output of this request."""

    request_id: str
    new_text: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprob, ...] | None
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int  # total so far
    queue_time_s: float | None = None  # on the first output after it left the waiting queue: time spent there
    # with SamplingParams.prompt_logprobs: one entry per prompt token (None for the first, which has no
    # context), on one output only (the first once the whole prompt is computed)
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


def merge_outputs(outputs: Sequence[RequestOutput]) -> RequestOutput:
    """Consecutive deltas of one request as one delta: text, token ids and logprobs concatenated in
    order, the finish fields and counts from the last. What a consumer slower than the engine gets."""
    if not outputs:
        raise ValueError("merge_outputs needs at least one output")
    if len(outputs) == 1:
        return outputs[0]
    last = outputs[-1]
    logprob_parts = [out.new_logprobs for out in outputs if out.new_logprobs is not None]
    return RequestOutput(
        request_id=last.request_id,
        new_text="".join(out.new_text for out in outputs),
        new_token_ids=tuple(token for out in outputs for token in out.new_token_ids),
        new_logprobs=tuple(lp for part in logprob_parts for lp in part) if logprob_parts else None,
        finished=last.finished,
        finish_reason=last.finish_reason,
        num_prompt_tokens=last.num_prompt_tokens,
        num_output_tokens=last.num_output_tokens,
        queue_time_s=next((out.queue_time_s for out in outputs if out.queue_time_s is not None), None),
        prompt_logprobs=next((out.prompt_logprobs for out in outputs if out.prompt_logprobs is not None), None),
    )
