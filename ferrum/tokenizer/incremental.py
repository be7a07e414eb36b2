"""Streaming detokenization: text for each new token id, as soon as it is final.

Built on `tokenizers.decoders.DecodeStream`, which decodes a short window of recent ids and
holds back output while the window's text ends in U+FFFD (a UTF-8 character split across
tokens). `flush` is needed only when the last ids leave an incomplete character (the whole
decode shows it as U+FFFD, the stream could not know no more bytes were coming).

Prompt context: the text of a generated token can depend on the ids before it. SentencePiece-style
decoders (Metaspace, or Llama's Replace/ByteFallback/Fuse/Strip chain) drop the "▁" space of the
first token they see, so "▁Paris" alone decodes to "Paris" but to " Paris" after the prompt. Given
the prompt's ids, the decoder keeps the last few of them as context (already shown, never output),
so that, with P the prompt and G the generated ids, the pieces `step` returns plus `flush` equal
`decode(P + G)[len(decode(P)):]` whenever decode(P) is a prefix of decode(P + G) (byte-level BPE,
Metaspace). Without prompt ids they equal `decode(G)`, and the pieces before `flush` are always a
prefix of the whole. A prompt that ends inside a character (its decode ends in U+FFFD) is the one
case where the prefix can fail: generated ids that complete the character output it whole.
"""

from __future__ import annotations

from collections.abc import Sequence

import tokenizers
from tokenizers.decoders import DecodeStream

from ferrum.tokenizer.cleanup import CleanupStream

REPLACEMENT = "\ufffd"
CONTEXT_IDS = 6  # prompt ids kept as context (vLLM keeps 5) ...
MAX_CONTEXT_IDS = 24  # ... or up to this many, to start the context on a whole character


class IncrementalDecoder:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        skip_special_tokens: bool,
        special_token_ids: frozenset[int],
        clean_up_spaces: bool,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> None:
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        self._special_token_ids = special_token_ids
        self._cleanup = CleanupStream() if clean_up_spaces else None
        self._context = self._pick_context(() if prompt_token_ids is None else prompt_token_ids)
        self._ids: list[int] = []
        self._raw_emitted = 0  # chars of the raw (pre-clean-up) stream text handed out so far
        self._pending = 0  # trailing ids that have not produced text yet
        self._finished = False
        self._primed = ""  # stream text that stepping in the context produced, not yet returned
        self._context_chars = 0  # chars of decode(context + ids) before the stream's text
        self._unconfirmed = ""  # the context's incomplete end, as U+FFFD: see _start
        self._stream: DecodeStream | None = None
        self._start()

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The generated ids stepped in so far (not the context)."""
        return tuple(self._ids)

    @property
    def context_ids(self) -> tuple[int, ...]:
        """The prompt ids (a short tail of the prompt) the decoder decodes the generated ids after."""
        return tuple(self._context)

    def step(self, token_id: int) -> str:
        """Add one id; return the text it completes (often "", e.g. mid-character or a skipped special)."""
        if self._finished:
            raise RuntimeError("IncrementalDecoder.step called after flush")
        self._ids.append(token_id)
        raw = self._stream_step(token_id)
        if raw:
            self._pending = 0
            self._raw_emitted += len(raw)
        else:
            self._pending += 1
        return self._output(raw)

    def flush(self) -> str:
        """End the stream: return whatever text is still held back. `step` may not be called afterwards."""
        if self._finished:
            return ""
        self._finished = True
        raw = ""
        if self._pending and not self._only_skipped_specials_pending():
            raw = self._decode(self._context + self._ids)[self._context_chars + self._raw_emitted :]
            self._raw_emitted += len(raw)
        text = self._output(raw)
        if self._cleanup is not None:
            text += self._cleanup.flush()
        return text

    # --- set-up ---------------------------------------------------------------------------------

    def _pick_context(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt's last CONTEXT_IDS ids, or a few more so that their text does not start inside a
        character: a byte-fallback run cut mid-character decodes to U+FFFD as a whole, even the bytes
        that generated ids would continue it with."""
        tail = [int(token_id) for token_id in prompt_token_ids[-(MAX_CONTEXT_IDS + 1) :]]
        whole = len(tail) <= MAX_CONTEXT_IDS  # the tail is the whole prompt: its start is the text's start
        for size in range(min(CONTEXT_IDS, len(tail)), min(MAX_CONTEXT_IDS, len(tail)) + 1):
            context = tail[-size:]
            if (whole and size == len(tail)) or not self._decode(context).startswith(REPLACEMENT):
                return context
        return tail[-CONTEXT_IDS:]

    def _start(self) -> None:
        """Seed the stream with the context: the text it has already "shown".

        Usually that is all the context. When the context's text ends inside a character, the stream is
        seeded with the longest head of it whose text is whole and starts the full context's text (so
        it ends on a character boundary), and the rest of the context is stepped in. The context text
        after the head (some U+FFFD) is `_unconfirmed`: stream text that repeats it is not output.
        """
        context_text = self._decode(self._context)
        cut, head_text = len(self._context), context_text
        while head_text.endswith(REPLACEMENT) or not context_text.startswith(head_text):
            cut -= 1
            head_text = self._decode(self._context[:cut])
        self._context_chars = len(head_text)
        self._unconfirmed = context_text[len(head_text) :]
        self._stream = _new_stream(self._backend, self._context[:cut], self._skip_special_tokens)
        for token_id in self._context[cut:]:
            primed = self._stream_step(token_id)
            self._raw_emitted += len(primed)
            self._primed += primed

    # --- per step -------------------------------------------------------------------------------

    def _stream_step(self, token_id: int) -> str:
        if self._stream is not None:
            try:
                return self._stream.step(self._backend, token_id) or ""
            except Exception:  # noqa: BLE001  (a decoder it cannot window: decode all ids at each step)
                self._stream = None
        full = self._decode(self._context + self._ids)
        return "" if full.endswith(REPLACEMENT) else full[self._context_chars + self._raw_emitted :]

    def _output(self, raw: str) -> str:
        raw, self._primed = self._primed + raw, ""
        if self._unconfirmed and raw:  # drop what repeats the context's incomplete end
            same = 0
            limit = min(len(raw), len(self._unconfirmed))
            while same < limit and raw[same] == self._unconfirmed[same]:
                same += 1
            self._unconfirmed = self._unconfirmed[same:] if same == len(raw) else ""
            raw = raw[same:]
        return self._cleanup.push(raw) if self._cleanup is not None and raw else raw

    def _only_skipped_specials_pending(self) -> bool:
        return self._skip_special_tokens and all(
            token_id in self._special_token_ids for token_id in self._ids[len(self._ids) - self._pending :]
        )

    def _decode(self, ids: list[int]) -> str:
        text: str = self._backend.decode(ids, skip_special_tokens=self._skip_special_tokens)
        return text


def _new_stream(
    backend: tokenizers.Tokenizer, seed: list[int], skip_special_tokens: bool
) -> DecodeStream | None:
    """A DecodeStream that treats `seed` (ids whose text is whole) as already shown; None if it fails."""
    try:
        if not seed:
            return DecodeStream(skip_special_tokens=skip_special_tokens)
        try:
            return DecodeStream(ids=seed, skip_special_tokens=skip_special_tokens)
        except TypeError:  # tokenizers without DecodeStream(ids=...): step the seed in, dropping its text
            stream = DecodeStream(skip_special_tokens=skip_special_tokens)
            for token_id in seed:
                stream.step(backend, token_id)
            return stream
    except Exception:  # noqa: BLE001  (decode all ids at each step instead)
        return None
