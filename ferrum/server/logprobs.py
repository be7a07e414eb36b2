"""Token logprobs in the two wire formats: completions' and chat's."""

from __future__ import annotations

from collections.abc import Sequence

from ferrum.engine.outputs import TokenLogprob
from ferrum.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
)

_LOGPROB_FLOOR = -9999.0  # OpenAI's stand-in for -inf


def _finite(value: float) -> float:
    return value if value >= _LOGPROB_FLOOR else _LOGPROB_FLOOR  # also maps NaN to the floor


def completion_logprobs(lps: Sequence[TokenLogprob], text_offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for lp in lps:
        top = {t.token: _finite(t.logprob) for t in lp.top}
        top.setdefault(lp.token, _finite(lp.logprob))
        out.tokens.append(lp.token)
        out.token_logprobs.append(_finite(lp.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(lp.token)
    return out


def chat_logprobs(lps: Sequence[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=lp.token,
                logprob=_finite(lp.logprob),
                bytes=list(lp.token.encode("utf-8")),
                top_logprobs=[
                    ChatTopLogprob(
                        token=t.token, logprob=_finite(t.logprob), bytes=list(t.token.encode("utf-8"))
                    )
                    for t in lp.top
                ],
            )
            for lp in lps
        ]
    )
