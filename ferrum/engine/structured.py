"""Structured outputs: a grammar (JSON schema, regex, a choice of strings, or a Lark / GBNF grammar) that
every generated token must follow, enforced with llguidance.

    compile_grammar    a request's StructuredOutput (ferrum.engine.sampling_params) as llguidance's grammar
                       text, naming what is wrong with it (StructuredOutputError: a 400); checked_grammar
                       remembers the answers
    Guides             the engine's side: one llguidance tokenizer for the model, compiled grammars cached
                       (a new sequence gets a copy of its grammar's matcher), and per step the token
                       bitmask of every guided sequence, computed on the host while the device runs the
                       forward pass (`start_masks`), then applied to the logits on their device (`apply`)
    Guide              one sequence's matcher: `consume(token)` after sampling; `done` once the grammar
                       can only end (the sequence then stops, EOS or not)

The bitmask is one bit per vocabulary entry (int32 words, llguidance's layout); it crosses to the device
as V/8 bytes per sequence and is unpacked there.
"""

from __future__ import annotations

import functools
import json
import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence as SequenceOf
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ferrum.engine.sampling_params import StructuredOutput

if TYPE_CHECKING:
    from ferrum.tokenizer import Tokenizer

log = logging.getLogger(__name__)

MAX_CACHED_GRAMMARS = 128


class StructuredOutputError(ValueError):
    """A grammar that cannot be compiled; `param` names the API field it came from."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def compile_grammar(structured: StructuredOutput) -> str:
    """llguidance's grammar text for `structured`, checked; raises StructuredOutputError naming the
    problem."""
    import llguidance

    param = structured.param
    matcher = llguidance.LLMatcher
    if structured.kind == "json":
        try:
            schema = json.loads(structured.spec)
        except json.JSONDecodeError as exc:
            raise StructuredOutputError(f"{param}: the JSON schema is not valid JSON ({exc})", param) from exc
        if not isinstance(schema, (dict, bool)):
            raise StructuredOutputError(f"{param}: a JSON schema must be an object", param)
        text = matcher.grammar_from_json_schema(schema if isinstance(schema, dict) else {})
    elif structured.kind == "regex":
        text = matcher.grammar_from_regex(structured.spec)
    elif structured.kind == "choice":
        choices = json.loads(structured.spec)
        if not choices:
            raise StructuredOutputError(f"{param}: choice needs at least one string", param)
        text = matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))
    else:
        lark = structured.spec
        if "::=" in lark:  # GBNF
            from llguidance.gbnf_to_lark import gbnf_to_lark

            try:
                lark = gbnf_to_lark(lark)
            except Exception as exc:  # the converter raises plain exceptions for bad input
                raise StructuredOutputError(f"{param}: not a valid GBNF grammar: {exc}", param) from exc
        text = matcher.grammar_from_lark(lark)
    error = matcher.validate_grammar(text)
    if error:
        raise StructuredOutputError(f"{param}: {_first_lines(error)}", param)
    return text


def _first_lines(message: str, limit: int = 6) -> str:
    """llguidance's multi-line report as one line (an API error message is one line)."""
    lines = [" ".join(line.split()) for line in message.strip().splitlines() if line.strip()]
    return " | ".join(lines[:limit])


@functools.lru_cache(maxsize=256)
def checked_grammar(structured: StructuredOutput) -> str:
    """`compile_grammar(structured)`, remembered: the server checks each request's grammar, the engine
    compiles it, and clients send the same few schemas again and again."""
    return compile_grammar(structured)


class Guide:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def consume(self, token: int) -> bool:
        """Advances by the sampled token; False if the grammar refuses it (cannot happen to a token drawn
        under this guide's mask, but a guide must never be trusted to be in step silently)."""
        return bool(self.matcher.consume_token(token))

    @property
    def done(self) -> bool:
        """The grammar is complete and cannot go on: only the end of the sequence is left."""
        return bool(self.matcher.is_stopped())

    @property
    def error(self) -> str:
        return self.matcher.get_error() if self.matcher.is_error() else ""


class Guided(Protocol):
    """What the masks need of a sequence (ferrum.engine.sequence.Sequence): its guide, if it has one."""

    @property
    def guide(self) -> Guide | None: ...


class PendingMasks:
    """Bitmasks being computed for some guided sequences; `for_rows` lays them out for a step's rows."""

    def __init__(self, seqs: list[Guided], future: Future[torch.Tensor], words: int) -> None:
        self._index = {id(seq): i for i, seq in enumerate(seqs)}
        self._future = future
        self._words = words

    def for_rows(self, seqs: SequenceOf[Guided]) -> torch.Tensor | None:
        """[len(seqs), words] int32 in `seqs`' order (every bit set for unguided rows); None if no row
        of `seqs` is guided. Waits for the computation."""
        masks = self._future.result()
        where = [self._index.get(id(seq)) for seq in seqs]
        if all(w is None for w in where):
            return None
        out = torch.full((len(seqs), self._words), -1, dtype=torch.int32)
        for row, w in enumerate(where):
            if w is not None:
                out[row] = masks[w]
        return out


class Guides:
    """Grammars for one model's engine (see the module docstring). Thread-safe for `guide()`."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._lock = threading.Lock()
        self._ll_tokenizer: Any = None
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ferrum-masks")
        self._executor: Any = None

    def _llg_tokenizer(self) -> Any:
        if self._ll_tokenizer is None:
            import llguidance

            eos = sorted(self._tokenizer.eos_token_ids)
            text = self._tokenizer.backend_json()
            try:
                self._ll_tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=eos)
            except TypeError:  # llguidance before 1.9 takes one EOS id: the grammar ends with the first
                self._ll_tokenizer = llguidance.LLTokenizer(text, n_vocab=self.vocab_size, eos_token=eos[0])
            self._executor = llguidance.LLExecutor()
        return self._ll_tokenizer

    def guide(self, structured: StructuredOutput) -> Guide:
        """A fresh guide at the start of `structured`'s grammar (compiled once, then copied)."""
        import llguidance

        grammar = checked_grammar(structured)
        with self._lock:
            template = self._compiled.get(grammar)
            if template is None:
                try:
                    template = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
                except Exception as exc:  # the request fails, not the engine
                    log.exception("llguidance could not compile a grammar")
                    raise StructuredOutputError(f"{structured.param}: the grammar could not be compiled for this "
                                                f"model ({type(exc).__name__}: {exc})", structured.param) from exc
                if template.is_error():
                    raise StructuredOutputError(f"{structured.param}: {_first_lines(template.get_error())}",
                                                structured.param)
                self._compiled[grammar] = template
                if len(self._compiled) > MAX_CACHED_GRAMMARS:
                    self._compiled.popitem(last=False)
            else:
                self._compiled.move_to_end(grammar)
            return Guide(template.deep_copy())

    # -- per step ----------------------------------------------------------------------------------
    def start_masks(self, seqs: SequenceOf[Guided]) -> PendingMasks | None:
        """Begins the bitmasks of the guided sequences among `seqs` (those about to be sampled) in a
        thread; llguidance drops the GIL, so this overlaps the forward pass. None when none is guided."""
        guided = [(seq, seq.guide) for seq in seqs if seq.guide is not None]
        if not guided:
            return None
        rows = [(guide.matcher, i) for i, (_, guide) in enumerate(guided)]
        pending = self._pool.submit(self._masks, rows, len(guided))
        return PendingMasks([seq for seq, _ in guided], pending, self.words)

    def _masks(self, rows: list[tuple[Any, int]], batch: int) -> torch.Tensor:
        mask = torch.full((batch, self.words), -1, dtype=torch.int32)  # unguided rows: every bit set
        self._executor.unsafe_compute_mask_ptr(rows, mask.data_ptr(), self.words * 4, batch)
        return mask

    @staticmethod
    def apply(logits: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`logits` [B, V] with every token outside the mask at -inf (a new tensor)."""
        device = logits.device
        words = mask.to(device, non_blocking=True)
        shifts = torch.arange(32, dtype=torch.int32, device=device)
        allowed = ((words.unsqueeze(-1) >> shifts) & 1).view(words.shape[0], -1)[:, : logits.shape[1]] != 0
        allowed |= ~allowed.any(dim=1, keepdim=True)  # a matcher in error allows nothing: leave its row be
        return logits.masked_fill(~allowed, float("-inf"))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
