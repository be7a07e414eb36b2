"""What a model folder says about its tokenizer besides tokenizer.json.

Reads tokenizer_config.json (special tokens, BOS/EOS flags, clean-up flag, chat template),
chat_template.jinja and additional_chat_templates/*.jinja, and the EOS ids of config.json and
generation_config.json. Every file is optional here; tokenizer.json itself is loaded by
`Tokenizer.from_folder`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

# The named special tokens a tokenizer_config.json may set, in the order HF lists them.
NAMED_SPECIAL_TOKENS: tuple[str, ...] = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)

DEFAULT_TEMPLATE = "default"
TOOL_USE_TEMPLATE = "tool_use"


@dataclass(frozen=True)
class TokenSpec:
    """A special token as tokenizer_config.json describes it (a string, or an AddedToken dict)."""

    content: str
    lstrip: bool = False
    rstrip: bool = False
    single_word: bool = False
    normalized: bool = False


@dataclass(frozen=True)
class TokenizerSettings:
    # Only the named tokens that are set, e.g. {"bos_token": TokenSpec("<s>")}.
    named_tokens: Mapping[str, TokenSpec] = field(default_factory=dict, hash=False)
    extra_special_tokens: tuple[TokenSpec, ...] = ()
    # None: the config does not say, so tokenizer.json's post-processor stands as it is.
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None
    clean_up_tokenization_spaces: bool = False
    # HF ignores clean_up_tokenization_spaces for BPE models unless this is also set.
    clean_up_even_for_bpe: bool = False
    # Template name -> Jinja source; "default" is the usual one, "tool_use" is picked when tools are given.
    chat_templates: Mapping[str, str] = field(default_factory=dict, hash=False)
    # EOS ids from config.json and generation_config.json.
    config_eos_token_ids: frozenset[int] = frozenset()

    def token(self, name: str) -> str | None:
        spec = self.named_tokens.get(name)
        return spec.content if spec is not None else None


def load_settings(folder: Path) -> TokenizerSettings:
    config = read_json_object(folder / "tokenizer_config.json") or {}
    named = {
        name: spec for name in NAMED_SPECIAL_TOKENS if (spec := _token_spec(config.get(name))) is not None
    }
    return TokenizerSettings(
        named_tokens=MappingProxyType(named),
        extra_special_tokens=_extra_special_tokens(config),
        add_bos_token=_optional_bool(config, "add_bos_token"),
        add_eos_token=_optional_bool(config, "add_eos_token"),
        clean_up_tokenization_spaces=bool(config.get("clean_up_tokenization_spaces", False)),
        clean_up_even_for_bpe=bool(
            config.get("clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False)
        ),
        chat_templates=MappingProxyType(_chat_templates(folder, config)),
        config_eos_token_ids=_config_eos_token_ids(folder),
    )


def read_json_object(path: Path) -> dict[str, Any] | None:
    """The JSON object in `path`, or None when there is no such file."""
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path.parent}: cannot read {path.name}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(  # noqa: TRY004  (a bad file, not a bad argument)
            f"{path.parent}: {path.name} must hold a JSON object, not {type(data).__name__}"
        )
    return data


def _token_spec(value: Any) -> TokenSpec | None:
    if isinstance(value, str):
        return TokenSpec(value)
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return TokenSpec(
            content=value["content"],
            lstrip=bool(value.get("lstrip", False)),
            rstrip=bool(value.get("rstrip", False)),
            single_word=bool(value.get("single_word", False)),
            normalized=bool(value.get("normalized", False)),
        )
    return None


def _extra_special_tokens(config: Mapping[str, Any]) -> tuple[TokenSpec, ...]:
    specs: list[TokenSpec] = []
    for key in ("additional_special_tokens", "extra_special_tokens"):
        value = config.get(key)
        items = value.values() if isinstance(value, Mapping) else value if isinstance(value, list) else ()
        specs.extend(spec for item in items if (spec := _token_spec(item)) is not None)
    return tuple(dict.fromkeys(specs))


def _optional_bool(config: Mapping[str, Any], key: str) -> bool | None:
    value = config.get(key)
    return bool(value) if key in config and value is not None else None


def _chat_templates(folder: Path, config: Mapping[str, Any]) -> dict[str, str]:
    # Template files win over tokenizer_config.json, as in HF.
    from_files: dict[str, str] = {}
    main_file = folder / "chat_template.jinja"
    if main_file.is_file():
        from_files[DEFAULT_TEMPLATE] = _read_text(main_file)
    extra_dir = folder / "additional_chat_templates"
    if extra_dir.is_dir():
        for path in sorted(extra_dir.glob("*.jinja")):
            from_files[path.stem] = _read_text(path)
    if from_files:
        return from_files

    value = config.get("chat_template")
    if isinstance(value, str):
        return {DEFAULT_TEMPLATE: value}
    if isinstance(value, list):
        return {
            item["name"]: item["template"]
            for item in value
            if isinstance(item, Mapping)
            and isinstance(item.get("name"), str)
            and isinstance(item.get("template"), str)
        }
    if isinstance(value, Mapping):
        return {name: source for name, source in value.items() if isinstance(source, str)}
    return {}


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path.parent}: cannot read {path.name}: {exc}") from exc


def _config_eos_token_ids(folder: Path) -> frozenset[int]:
    ids: set[int] = set()
    for name in ("config.json", "generation_config.json"):
        config = read_json_object(folder / name) or {}
        ids |= _int_ids(config.get("eos_token_id"))
        text_config = config.get("text_config")  # multimodal configs keep the language model's ids here
        if isinstance(text_config, Mapping):
            ids |= _int_ids(text_config.get("eos_token_id"))
    return frozenset(ids)


def _int_ids(value: Any) -> set[int]:
    items = value if isinstance(value, list) else [value]
    return {item for item in items if isinstance(item, int) and not isinstance(item, bool) and item >= 0}
