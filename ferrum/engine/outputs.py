"""What the engine hands back to the API layer, one delta per step per request."""

from __future__ import annotations

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
