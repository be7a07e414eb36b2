"""A model's tokenizer: text <-> ids, chat templates and EOS ids, from a HF-style model folder.

Uses the `tokenizers` library directly and reproduces what HF transformers (v5) does on top of
it: named special tokens from tokenizer_config.json, `clean_up_tokenization_spaces`, and chat
template rendering. One deliberate difference: tokenizer_config.json's `add_bos_token` and
`add_eos_token`, which HF v5 ignores whenever tokenizer.json exists, are honoured here when they
ask for a token that tokenizer.json's post-processor does not add already (never twice).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

import tokenizers
from tokenizers import AddedToken

from ferrum.tokenizer.chat_template import ChatTemplateError, render_chat_template
from ferrum.tokenizer.cleanup import clean_up_tokenization
from ferrum.tokenizer.incremental import IncrementalDecoder
from ferrum.tokenizer.settings import (
    DEFAULT_TEMPLATE,
    TOOL_USE_TEMPLATE,
    TokenizerSettings,
    TokenSpec,
    load_settings,
)

TOKENIZER_FILE = "tokenizer.json"
_PROBE_TEXT = "a"  # encoded once at load to see which special tokens tokenizer.json's post-processor adds


class Tokenizer:
    def __init__(self, backend: tokenizers.Tokenizer, settings: TokenizerSettings, name: str = "") -> None:
        """Wraps `backend`, adding the special tokens `settings` names that it lacks; see `from_folder`."""
        self._backend = backend
        self._settings = settings
        self._name = name
        _register_special_tokens(backend, settings)
        self._prefix_ids, self._suffix_ids = _flag_ids(backend, settings)
        self._special_tokens = {
            name: token for name in settings.named_tokens if (token := settings.token(name)) is not None
        }
        self._backend_special_ids = frozenset(
            token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special
        )
        self._bos_token_id = self._id_of(settings.token("bos_token"))
        eos_id = self._id_of(settings.token("eos_token"))
        self._eos_token_ids = settings.config_eos_token_ids | ({eos_id} if eos_id is not None else set())
        self._clean_up_spaces = settings.clean_up_tokenization_spaces and (
            type(backend.model).__name__ != "BPE" or settings.clean_up_even_for_bpe
        )

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        folder = Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"model folder {folder} does not exist")
        tokenizer_file = folder / TOKENIZER_FILE
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"{folder}: no {TOKENIZER_FILE} (Ferrum needs a fast tokenizer file)")
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # tokenizers raises bare Exception for bad JSON or unknown components
            raise ValueError(f"{folder}: cannot load {TOKENIZER_FILE}: {exc}") from exc
        return cls(backend, load_settings(folder), name=str(folder))

    # --- text <-> ids ---------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids: list[int] = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and (self._prefix_ids or self._suffix_ids):
            return [*self._prefix_ids, *ids, *self._suffix_ids]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        text: str = self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return clean_up_tokenization(text) if self._clean_up_spaces else text

    def backend_json(self) -> str:
        """The tokenizer as tokenizers' JSON (special tokens added, no padding or truncation): what
        other libraries (the grammar engine) build their own view of the vocabulary from."""
        backend = copy.copy(self._backend)
        backend.no_padding()
        backend.no_truncation()
        return backend.to_str()

    def id_to_token_text(self, token_id: int) -> str:
        """The token's text as a user sees it (for logprobs); "\ufffd" for a byte of a split character."""
        return self.decode([token_id], skip_special_tokens=False)

    def incremental_decoder(
        self, skip_special_tokens: bool = True, prompt_token_ids: Sequence[int] | None = None
    ) -> IncrementalDecoder:
        """A streaming decoder for generated ids. Pass the prompt's ids so that the text of each
        generated id is what it adds after the prompt (e.g. " Paris", not "Paris", for a SentencePiece
        "▁Paris"): only a short tail of them is used, as context that is never output."""
        return IncrementalDecoder(
            self._backend,
            skip_special_tokens=skip_special_tokens,
            special_token_ids=self._backend_special_ids,
            clean_up_spaces=self._clean_up_spaces,
            prompt_token_ids=prompt_token_ids,
        )

    # --- chat -----------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The default chat template's source, or None when the model has none."""
        return self._settings.chat_templates.get(DEFAULT_TEMPLATE)

    def with_chat_template(self, source: str) -> Tokenizer:
        """This tokenizer, rendering chats with `source` instead of the model's template (e.g. a --chat-template)."""
        settings = replace(self._settings, chat_templates=MappingProxyType({DEFAULT_TEMPLATE: source}))
        return Tokenizer(self._backend, settings, self._name)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        """Render the conversation as a prompt; `extra` becomes template variables (e.g. documents)."""
        return render_chat_template(
            self._template_source(tools),
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            special_tokens=self._special_tokens,
            extra=extra,
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> list[int]:
        """Render, then encode without adding special tokens: the template writes them itself."""
        prompt = self.apply_chat_template(messages, add_generation_prompt, tools, **extra)
        return self.encode(prompt, add_special_tokens=False)

    def template_for(self, tools: Sequence[Mapping[str, Any]] | None = None) -> str | None:
        """The chat template's source that a conversation (with these tools) is rendered with; None if none."""
        try:
            return self._template_source(tools)
        except ChatTemplateError:
            return None

    def _template_source(self, tools: Sequence[Mapping[str, Any]] | None) -> str:
        templates = self._settings.chat_templates
        if tools is not None and TOOL_USE_TEMPLATE in templates:
            return templates[TOOL_USE_TEMPLATE]
        if DEFAULT_TEMPLATE in templates:
            return templates[DEFAULT_TEMPLATE]
        if templates:
            raise ChatTemplateError(
                f"{self._name or 'this tokenizer'} has chat templates named {sorted(templates)} but none named "
                f"{DEFAULT_TEMPLATE!r}"
            )
        raise ChatTemplateError(
            f"{self._name or 'this tokenizer'} has no chat template (no chat_template.jinja and no chat_template "
            "in tokenizer_config.json); use the completions API or give the model a template"
        )

    # --- vocabulary -----------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (HF's `len(tokenizer)`, not its `vocab_size`)."""
        size: int = self._backend.get_vocab_size(with_added_tokens=True)
        return size

    @property
    def bos_token(self) -> str | None:
        return self._settings.token("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self._settings.token("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self._settings.token("pad_token")

    @property
    def unk_token(self) -> str | None:
        return self._settings.token("unk_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """Every id that ends generation: the EOS ids of generation_config.json and config.json, and eos_token's."""
        return self._eos_token_ids

    @property
    def special_token_ids(self) -> frozenset[int]:
        """The ids `decode(..., skip_special_tokens=True)` drops."""
        return self._backend_special_ids

    def token_to_id(self, token: str) -> int | None:
        token_id: int | None = self._backend.token_to_id(token)
        return token_id

    def _id_of(self, token: str | None) -> int | None:
        return self.token_to_id(token) if token is not None else None

    def __repr__(self) -> str:
        return f"Tokenizer({self._name!r}, vocab_size={self.vocab_size})"


def _register_special_tokens(backend: tokenizers.Tokenizer, settings: TokenizerSettings) -> None:
    """Make every special token the config names an added, special token of `backend`, as HF does."""
    added = {token.content: token for token in backend.get_added_tokens_decoder().values()}
    missing: list[AddedToken] = []
    for spec in (*settings.named_tokens.values(), *settings.extra_special_tokens):
        existing = added.get(spec.content)
        if existing is not None and existing.special:
            continue
        source: TokenSpec | AddedToken = existing if existing is not None else spec
        missing.append(
            AddedToken(
                spec.content,
                single_word=source.single_word,
                lstrip=source.lstrip,
                rstrip=source.rstrip,
                normalized=source.normalized,
                special=True,
            )
        )
    if missing:
        backend.add_special_tokens(missing)


def _flag_ids(backend: tokenizers.Tokenizer, settings: TokenizerSettings) -> tuple[list[int], list[int]]:
    """The ids encode must put before and after tokenizer.json's output to honour tokenizer_config.json's
    add_bos_token/add_eos_token: BOS (EOS) when the flag is set and the post-processor does not
    already add it. A flag that is false or absent takes nothing away from what tokenizer.json adds."""
    probe = backend.encode(_PROBE_TEXT, add_special_tokens=True).ids
    bos = _token_with_id(backend, settings.token("bos_token")) if settings.add_bos_token else None
    eos = _token_with_id(backend, settings.token("eos_token")) if settings.add_eos_token else None
    prefix = [bos[1]] if bos is not None and probe[:1] != [bos[1]] else []
    suffix = [eos[1]] if eos is not None and probe[-1:] != [eos[1]] else []
    return prefix, suffix


def _token_with_id(backend: tokenizers.Tokenizer, token: str | None) -> tuple[str, int] | None:
    if token is None:
        return None
    token_id = backend.token_to_id(token)
    return (token, token_id) if token_id is not None else None
