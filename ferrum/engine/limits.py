"""`RequestLimits`: what one request may ask of the engine, checked in one place. The engine, both
engine clients and the HTTP server ask it; the server turns its error into an OpenAI-style 400."""

from __future__ import annotations

from dataclasses import dataclass


class PromptTooLongError(ValueError):
    """The prompt, or the prompt with the completion asked for, does not fit in the context.
    `max_tokens` is None when the prompt alone leaves no room for any completion."""

    def __init__(self, prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
        if max_tokens is None:
            message = (
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
                f"resulted in {prompt_tokens} tokens, which leaves no room for the completion."
            )
        else:
            message = (
                f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} in the completion)."
            )
        super().__init__(message)
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int  # prompt + completion tokens of one sequence
    vocab_size: int  # prompt token ids must be below it

    def max_tokens(self, num_prompt_tokens: int, requested: int | None) -> int:
        """The completion length a request gets: `requested`, or all the room the context leaves.
        PromptTooLongError when the prompt is empty, leaves no room, or prompt + requested overflows."""
        if num_prompt_tokens < 1 or num_prompt_tokens >= self.max_model_len:
            raise PromptTooLongError(num_prompt_tokens, None, self.max_model_len)
        if requested is None:
            return self.max_model_len - num_prompt_tokens
        if num_prompt_tokens + requested > self.max_model_len:
            raise PromptTooLongError(num_prompt_tokens, requested, self.max_model_len)
        return requested

    def check_biased_ids(self, token_ids: list[int]) -> None:
        """ValueError when logit_bias names a token the model does not have."""
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"logit_bias: token ids out of range [0, {self.vocab_size}): {bad[:5]}")

    def check(self, prompt_token_ids: list[int], max_tokens: int, biased_ids: list[int] | None = None) -> None:
        """Raises PromptTooLongError (lengths) or ValueError (an empty prompt, ids out of range, logit_bias
        naming a token the model does not have)."""
        self.check_biased_ids(biased_ids or [])
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        self.max_tokens(len(prompt_token_ids), max_tokens)
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
