"""A SentencePiece GGUF vocabulary (tokenizer.ggml.model "llama": Llama 2, Mistral, TinyLlama) built into a
tokenizer from the file's tokens and scores: the same token ids as transformers' own GGUF loading of the
file (`AutoTokenizer.from_pretrained(dir, gguf_file=name)`), bytes no token covers as <0xXX> tokens, the
same decoded text; merges from the file where it has them; missing scores named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ferrum.tokenizer.tokenizer import Tokenizer
from ferrum.weights.errors import CorruptWeightsError
from ferrum.weights.formats.gguf import gguf_header
from ferrum.weights.formats.gguf_model import _json, gguf_tokenizer, gguf_tokenizer_config
from tests.weights.test_gguf import write_gguf

transformers = pytest.importorskip("transformers")

PIECES = ["\u2581", "\u2581the", "\u2581t", "he", "\u2581a", "\u2581and", "\u2581of", "\u2581w", "or", "ld",
          "\u2581world", "\u2581wor", "\u2581he", "\u2581hel", "ll", "lo", "\u2581hello", "\u2581P", "ari", "is",
          "\u2581is", "\u2581cap", "ital", "\u2581capital", "an", "nd", "th", "in", "\u2581in", "er", "\u2581c", "ap",
          "it", "al", "e", "t", "h", "a", "n", "d", "o", "f", "w", "r", "l", "P", "i", "s", "c", "p", "\u2581H", "H"]
TOKENS = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *PIECES, "<tool>"]
# SentencePiece's scores: log-probabilities, the vocabulary sorted best first
SCORES = [0.0, 0.0, 0.0, *[0.0] * 256, *[-1.0 - 0.25 * i for i in range(len(PIECES))], 0.0]
TYPES = [2, 3, 3, *[6] * 256, *[1] * len(PIECES), 4]  # unknown, control, byte, normal, user-defined
TEXTS = ["the world", "Hello world", "Paris is the capital of the world", " the  and\tof\n\nin",
         "naïve café 東京 — ok", "hello<tool>world", "a", ""]


def _file(tmp_path: Path, **extra: Any) -> Path:
    kv: dict[str, Any] = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": TOKENS,
                          "tokenizer.ggml.scores": SCORES, "tokenizer.ggml.token_type": TYPES,
                          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2,
                          "tokenizer.ggml.unknown_token_id": 0, **extra}
    return write_gguf(tmp_path / "spm.gguf", {}, kv={k: v for k, v in kv.items() if v is not None}, raw={})


def _ours(path: Path, folder: Path) -> Tokenizer:
    header = gguf_header(path)
    folder.mkdir()
    (folder / "tokenizer.json").write_text(gguf_tokenizer(header).to_str())
    (folder / "tokenizer_config.json").write_text(_json(gguf_tokenizer_config(header)))
    return Tokenizer.from_folder(folder)


def test_token_ids_and_text_equal_transformers(tmp_path: Path) -> None:
    path = _file(tmp_path)
    ours = _ours(path, tmp_path / "folder")
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    for text in TEXTS:
        ids = theirs(text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert ours.decode(ids, skip_special_tokens=True) == theirs.decode(ids, skip_special_tokens=True), text
    # bytes no piece covers
    assert ours.encode("é")[1:] == [TOKENS.index("\u2581"), TOKENS.index("<0xC3>"), TOKENS.index("<0xA9>")]
    assert ours.encode("the")[:2] == [1, TOKENS.index("\u2581the")]  # BOS (no add_bos_token flag: added)
    assert ours.decode(ours.encode("hello<tool>world"), skip_special_tokens=True) == "hello<tool>world"


def test_without_the_space_prefix_the_first_word_has_none(tmp_path: Path) -> None:
    """tokenizer.ggml.add_space_prefix false: no "\u2581" before the first word, as llama.cpp tokenizes
    (transformers 5.23 prepends it whatever the flag says)."""
    ours = _ours(_file(tmp_path, **{"tokenizer.ggml.add_space_prefix": False}), tmp_path / "folder")
    assert ours.encode("the world")[1:4] == [TOKENS.index("t"), TOKENS.index("he"), TOKENS.index("\u2581world")]
    assert ours.decode(ours.encode("the world"), skip_special_tokens=True) == "the world"


def test_merges_from_the_file_are_used_and_missing_scores_named(tmp_path: Path) -> None:
    path = _file(tmp_path, **{"tokenizer.ggml.merges": ["\u2581 t", "h e", "\u2581t he"]})
    tok = gguf_tokenizer(gguf_header(path))
    assert tok.encode("the", add_special_tokens=False).tokens == ["\u2581the"]
    assert tok.encode("world", add_special_tokens=False).tokens == ["\u2581", "w", "o", "r", "l", "d"]  # no merges
    bad = write_gguf(tmp_path / "bad.gguf", {}, raw={}, kv={"tokenizer.ggml.model": "llama",
                                                                  "tokenizer.ggml.tokens": TOKENS})
    with pytest.raises(CorruptWeightsError, match="tokenizer.ggml.scores is missing"):
        gguf_tokenizer(gguf_header(bad))
