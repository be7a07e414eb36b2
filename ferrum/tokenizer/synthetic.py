"""A synthetic tokenizer for models without one of their own (random-weight checkpoints of real shapes,
scripts/make_random_checkpoint.py): one word "t<id>" per token id, so that any token id round-trips
through text at any vocabulary size."""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def write_synthetic_tokenizer(out: Path, vocab_size: int) -> None:
    """tokenizer.json and tokenizer_config.json in `out`: a word-level tokenizer with one word "t<id>"
    per token id (whitespace-separated), <bos> and <eos> last, and a plain chat template."""
    bos, eos = vocab_size - 2, vocab_size - 1
    vocab = {f"t{i}": i for i in range(vocab_size - 2)} | {"<bos>": bos, "<eos>": eos}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {"id": i, "content": tok, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for tok, i in (("<bos>", bos), ("<eos>", eos))
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": "<eos>"},
    }
    (out / "tokenizer.json").write_text(json.dumps(tokenizer))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": False, "chat_template": CHAT_TEMPLATE,
        "tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
    }))
