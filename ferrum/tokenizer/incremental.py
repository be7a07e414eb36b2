"""Streaming detokenization: text for each new token id, as soon as it is final.

Built on `tokenizers.decoders.DecodeStream`, which decodes a short window of recent ids and
holds back output while the window's text ends in U+FFFD (a UTF-8 character split across
tokens). The pieces `step` returns, joined, are always a prefix of `decode(ids)`; after
`flush` they equal it. `flush` is needed only when the last ids leave an incomplete character
(the whole decode shows it as U+FFFD, the stream could not know no more bytes were coming).
"""

from __future__ import annotations

import tokenizers
from tokenizers.decoders import DecodeStream

from ferrum.tokenizer.cleanup import CleanupStream


class IncrementalDecoder:
    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        skip_special_tokens: bool,
        special_token_ids: frozenset[int],
        clean_up_spaces: bool,
    ) -> None:
        self._backend = backend
        self._skip_special_tokens = skip_special_tokens
        self._special_token_ids = special_token_ids
        self._stream: DecodeStream | None = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._cleanup = CleanupStream() if clean_up_spaces else None
        self._ids: list[int] = []
        self._raw_emitted = 0  # chars of the raw (pre-clean-up) decode handed out so far
        self._pending = 0  # trailing ids that have not produced text yet
        self._finished = False

    @property
    def token_ids(self) -> tuple[int, ...]:
        return tuple(self._ids)

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
        return self._clean(raw)

    def flush(self) -> str:
        """End the stream: return whatever text is still held back. `step` may not be called afterwards."""
        if self._finished:
            return ""
        self._finished = True
        raw = ""
        if self._pending and not self._only_skipped_specials_pending():
            raw = self._backend.decode(self._ids, skip_special_tokens=self._skip_special_tokens)[
                self._raw_emitted :
            ]
            self._raw_emitted += len(raw)
        text = self._clean(raw)
        if self._cleanup is not None:
            text += self._cleanup.flush()
        return text

    def _stream_step(self, token_id: int) -> str:
        if self._stream is not None:
            try:
                return self._stream.step(self._backend, token_id) or ""
            except Exception:  # noqa: BLE001  (a decoder it cannot window: decode all ids at each step)
                self._stream = None
        full = self._backend.decode(self._ids, skip_special_tokens=self._skip_special_tokens)
        return "" if full.endswith("\ufffd") else full[self._raw_emitted :]

    def _only_skipped_specials_pending(self) -> bool:
        return self._skip_special_tokens and all(
            token_id in self._special_token_ids for token_id in self._ids[len(self._ids) - self._pending :]
        )

    def _clean(self, raw: str) -> str:
        return self._cleanup.push(raw) if self._cleanup is not None and raw else raw
