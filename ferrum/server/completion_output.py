"""How /v1/completions results become choices: the echoed prompt (its text, and with `logprobs` its
tokens' logprobs, the first null), the completion (left out of a scoring request, max_tokens 0: the
engine's one token is dropped, as vLLM does), and vLLM's `prompt_logprobs`."""

from __future__ import annotations

from collections.abc import Sequence

from ferrum.engine.outputs import TokenLogprob
from ferrum.server.jobs import ChoiceResult, Job
from ferrum.server.logprobs import completion_logprobs, echo_logprobs, join_logprobs, vllm_prompt_logprobs
from ferrum.server.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest
from ferrum.tokenizer import Tokenizer


class CompletionOutput:
    def __init__(self, req: CompletionRequest, tokenizer: Tokenizer, prompt_texts: Sequence[str]) -> None:
        self.req = req
        self.tokenizer = tokenizer
        self.prompt_texts = prompt_texts

    @property
    def echoes_logprobs(self) -> bool:
        """The echoed prompt carries logprobs, which come with the engine's first output."""
        return self.req.echo and self.req.logprobs is not None

    def completion_offset(self, job: Job) -> int:
        """Where the completion's text starts in the choice's text."""
        return len(self.prompt_texts[job.prompt_index]) if self.req.echo else 0

    def echoed(self, job: Job, prompt_logprobs: Sequence[TokenLogprob | None] | None) -> CompletionLogprobs | None:
        """The echoed prompt's logprobs (None without logprobs, or when the engine sent none: aborted)."""
        if not self.echoes_logprobs or prompt_logprobs is None or self.req.logprobs is None:
            return None
        return echo_logprobs(self.tokenizer.id_to_token_text(job.prompt_ids[0]), prompt_logprobs, self.req.logprobs)

    def choice(self, job: Job, r: ChoiceResult) -> CompletionChoice:
        """A non-streaming choice from the job's collected result."""
        generated = not self.req.scores_only
        text = r.text if generated else ""
        logprobs = None
        if r.logprobs is not None:
            logprobs = completion_logprobs(r.logprobs if generated else [], self.completion_offset(job))
            echoed = self.echoed(job, r.prompt_logprobs)
            if echoed is not None:
                logprobs = join_logprobs(echoed, logprobs)
        prompt_logprobs = None
        if self.req.prompt_logprobs is not None and r.prompt_logprobs is not None:
            prompt_logprobs = vllm_prompt_logprobs(r.prompt_logprobs, self.req.prompt_logprobs)
        echo = self.prompt_texts[job.prompt_index] if self.req.echo else ""
        return CompletionChoice(index=job.index, text=echo + text, logprobs=logprobs,
                                finish_reason=r.finish_reason if generated else "length",
                                prompt_logprobs=prompt_logprobs)
