"""After sampling: append tokens, advance grammars, detokenize, check stop conditions, build deltas (with the
prompt logprobs, once, for requests that ask)."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from ferrum.engine.outputs import RequestOutput, TokenLogprob, TopLogprob
from ferrum.engine.sampler import SampleResult
from ferrum.engine.sequence import Sequence, SequenceStatus
from ferrum.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.eos_token_ids = frozenset(tokenizer.eos_token_ids)

    def decode_prompt_scores(self, seqs: Iterable[Sequence]) -> None:
        """Turns the prompt scores the runner left on these sequences into TokenLogprobs."""
        names: dict[int, str] = {}  # a prompt's top tokens repeat: each decoded once

        def text(token_id: int) -> str:
            name = names.get(token_id)
            if name is None:
                name = names[token_id] = self.tokenizer.id_to_token_text(token_id)
            return name

        for seq in seqs:
            for scores in seq.prompt_scores:
                for token, logprob, rank, top_ids, top_values in zip(
                    scores.token_ids, scores.logprobs, scores.ranks, scores.top_ids, scores.top_logprobs, strict=True
                ):
                    top = tuple(TopLogprob(i, text(i), v) for i, v in zip(top_ids, top_values, strict=True))
                    seq.prompt_logprobs.append(TokenLogprob(token, text(token), logprob, top, rank))
            seq.prompt_scores.clear()

    def append(self, seqs: list[Sequence], result: SampleResult) -> None:
        for seq, token, lp in zip(seqs, result.token_ids, result.logprobs, strict=True):
            self._append_token(seq, token, lp)

    def catch_up(self, seq: Sequence, tokens: list[int]) -> None:
        """The text of `tokens`, already the last of `seq.output_token_ids` (appended ahead by the engine
        so that the device could go on), for a sequence they cannot stop (Scheduler.keeps_going)."""
        for token in tokens:
            self._after_token(seq, token, None)

    def _append_token(self, seq: Sequence, token: int, lp: tuple[float, list[tuple[int, float]]] | None) -> None:
        seq.output_token_ids.append(token)
        self._after_token(seq, token, lp)

    def _after_token(self, seq: Sequence, token: int, lp: tuple[float, list[tuple[int, float]]] | None) -> None:
        p = seq.params
        if lp is not None:
            top = tuple(TopLogprob(i, self.tokenizer.id_to_token_text(i), v) for i, v in lp[1])
            seq.pending_logprobs.append(TokenLogprob(token, self.tokenizer.id_to_token_text(token), lp[0], top))

        if seq.decoder is None:
            seq.decoder = self.tokenizer.incremental_decoder(
                skip_special_tokens=p.skip_special_tokens, prompt_token_ids=seq.prompt_token_ids
            )
        if seq.guide is not None and not seq.guide.consume(token):  # drawn under its mask: cannot happen
            log.error("request %s: token %d refused by its grammar (%s); stopping it", seq.request_id, token,
                      seq.guide.error)
            self._add_text(seq, seq.decoder.flush())
            self._finish(seq, "stop")
            return
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            self._add_text(seq, seq.decoder.flush())  # the stop token's own text is not output
            self._finish(seq, "stop")
            return
        if self._add_text(seq, seq.decoder.step(token)):
            self._finish(seq, "stop")
            return
        if seq.guide is not None and seq.guide.done:  # the grammar is complete: nothing may follow
            self._add_text(seq, seq.decoder.flush())
            self._finish(seq, "stop")
            return
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            self._finish(seq, "stop" if self._add_text(seq, seq.decoder.flush()) else "length")

    def _add_text(self, seq: Sequence, text: str) -> bool:
        """Appends decoded text; True when a stop string turned up (the text is then cut there)."""
        if not text:
            return False
        seq.output_text += text
        return bool(seq.params.stop) and self._truncate_at_stop(seq, len(text))

    @staticmethod
    def _truncate_at_stop(seq: Sequence, new_len: int) -> bool:
        text, p = seq.output_text, seq.params
        longest = max(len(s) for s in p.stop)
        search_from = max(0, len(text) - new_len - longest + 1)
        hits = [(text.find(s, search_from), s) for s in p.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        seq.output_text = text[: index + len(stop)] if p.include_stop_str_in_output else text[:index]
        return True

    @staticmethod
    def _finish(seq: Sequence, reason: str) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason  # type: ignore[assignment]

    @staticmethod
    def delta(seq: Sequence) -> RequestOutput | None:
        """What is new for the client since the last delta; None when nothing is."""
        text_end = len(seq.output_text)
        if not seq.is_finished and seq.params.stop:
            # hold back what could still turn out to be the start of a stop string
            text_end -= max(len(s) for s in seq.params.stop) - 1
        text_end = max(text_end, seq.num_text_sent)
        new_text = seq.output_text[seq.num_text_sent : text_end]
        new_tokens = tuple(seq.output_token_ids[seq.num_tokens_sent :])
        if not new_text and not new_tokens and not seq.is_finished:
            return None
        logprobs = tuple(seq.pending_logprobs) if seq.params.logprobs is not None else None
        seq.pending_logprobs = []
        prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
        if seq.params.prompt_logprobs is not None and not seq.prompt_logprobs_sent and not seq.scores_prompt:
            prompt_logprobs = (None, *seq.prompt_logprobs)
            seq.prompt_logprobs_sent = True
        seq.num_text_sent = text_end
        seq.num_tokens_sent = len(seq.output_token_ids)
        queue_time = None
        if seq.first_scheduled is not None and not seq.queue_time_sent:
            seq.queue_time_sent = True
            queue_time = seq.first_scheduled - seq.arrival
        return RequestOutput(
            request_id=seq.request_id,
            new_text=new_text,
            new_token_ids=new_tokens,
            new_logprobs=logprobs,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens,
            num_output_tokens=len(seq.output_token_ids),
            queue_time_s=queue_time,
            prompt_logprobs=prompt_logprobs,
        )
