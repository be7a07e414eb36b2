"""Token logprobs in the wire formats: completions' and chat's, and the prompt's (an echoed prompt's in
completions' format, and vLLM's prompt_logprobs)."""

from __future__ import annotations

from collections.abc import Sequence

from ferrum.engine.outputs import TokenLogprob
from ferrum.server.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
    PromptLogprob,
    PromptLogprobs,
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


def echo_logprobs(first_token: str, prompt: Sequence[TokenLogprob | None], top_n: int) -> CompletionLogprobs:
    """An echoed prompt's tokens in completions' format, from the engine's prompt logprobs (scored with
    at least `top_n` top tokens): the first token (`first_token`, its text) has null logprobs; text
    offsets count from 0."""
    out = CompletionLogprobs(tokens=[first_token], token_logprobs=[None], top_logprobs=[None], text_offset=[0])
    offset = len(first_token)
    for lp in prompt[1:]:
        assert lp is not None, "only the first prompt token goes unscored"
        top = {t.token: _finite(t.logprob) for t in lp.top[:top_n]}
        top.setdefault(lp.token, _finite(lp.logprob))
        out.tokens.append(lp.token)
        out.token_logprobs.append(_finite(lp.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(lp.token)
    return out


def join_logprobs(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        tokens=first.tokens + then.tokens,
        token_logprobs=first.token_logprobs + then.token_logprobs,
        top_logprobs=first.top_logprobs + then.top_logprobs,
        text_offset=first.text_offset + then.text_offset,
    )


def vllm_prompt_logprobs(prompt: Sequence[TokenLogprob | None], top_n: int) -> PromptLogprobs:
    """vLLM's prompt_logprobs: per prompt token, None for the first, else token id -> logprob, rank and
    text for the prompt's own token and the `top_n` most likely (ranks 1..top_n)."""
    out: PromptLogprobs = []
    for lp in prompt:
        if lp is None:
            out.append(None)
            continue
        entry = {lp.token_id: PromptLogprob(logprob=_finite(lp.logprob), rank=lp.rank, decoded_token=lp.token)}
        for rank, t in enumerate(lp.top[:top_n], start=1):
            entry.setdefault(t.token_id, PromptLogprob(logprob=_finite(t.logprob), rank=rank, decoded_token=t.token))
        out.append(entry)
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
