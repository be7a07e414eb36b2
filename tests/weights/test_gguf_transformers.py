"""The demo model's GGUF read by Ferrum against transformers' own GGUF loading of it
(`from_pretrained(dir, gguf_file=name)`): every tensor equal to gguf-py's dequantization of Ferrum's raw block
rows, put under Ferrum's HF name and in the row order `hf_row_order` gives (exact); the same config values;
the same token ids, a chat included."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

from ferrum.weights import WeightLoaderConfig
from ferrum.weights.formats.gguf import gguf_header
from ferrum.weights.formats.readers import open_local
from ferrum.weights.gguf_names import hf_row_order, hf_tensor_name
from ferrum.weights.locations.gguf_file import gguf_model_folder

pytestmark = pytest.mark.slow
transformers = pytest.importorskip("transformers")

DEMO_GGUF = Path(__file__).resolve().parents[2] / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
if not DEMO_GGUF.is_file():
    pytest.skip(f"no {DEMO_GGUF} (scripts/prepare_demo_model.py keeps it)", allow_module_level=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gguf_model_folder(DEMO_GGUF, WeightLoaderConfig(cache_dir=tmp_path_factory.mktemp("cache")))


@pytest.fixture(scope="module")
def reference() -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(DEMO_GGUF.parent), gguf_file=DEMO_GGUF.name, dtype=torch.float32
    )


def test_tensors_equal_transformers_dequantized(reference: Any) -> None:
    header = gguf_header(DEMO_GGUF)
    config = reference.config
    state = reference.state_dict()
    reader = open_local(DEMO_GGUF, None)
    seen = set()
    try:
        for name, info in header.tensors.items():
            hf = hf_tensor_name(name)
            assert hf is not None, name
            stored = reader.tensor(name).numpy()  # raw block rows, or the F32 values
            order = hf_row_order(name, stored.shape[0], architecture="llama", num_heads=config.num_attention_heads,
                                 num_kv_heads=config.num_key_value_heads)
            if order is not None:
                stored = stored[order.numpy()]  # on the raw rows: rows are independent blocks
            values = torch.from_numpy(gguf.quants.dequantize(stored, info.ggml_type)).reshape(info.logical_shape)
            assert torch.equal(values, state[hf]), f"{name} -> {hf}"
            seen.add(hf)
    finally:
        reader.close()
    assert seen == set(state) - {"lm_head.weight"}  # tied: lm_head is the embedding
    assert header.tensors["blk.0.attn_q.weight"].ggml_type.name == "Q4_1"  # a permuted tensor was quantized


def test_config_values_equal_transformers(folder: Path, reference: Any) -> None:
    import json

    ours: Mapping[str, Any] = json.loads((folder / "config.json").read_text())
    theirs = reference.config
    for key in ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "attention_bias", "bos_token_id", "eos_token_id", "pad_token_id",
                "unk_token_id"):
        assert ours[key] == getattr(theirs, key), key
    assert ours["rope_theta"] == theirs.rope_parameters["rope_theta"]
    assert ours["architectures"] == ["LlamaForCausalLM"]


TEXTS = [
    "Hello, world!",
    "  two leading spaces,\ttabs\nand new lines\n\n",
    "Ünïcödé — 日本語 🙂 naïve café",
    "<|im_start|>user\nhi there<|im_end|>\n<|endoftext|>",
    "numbers 1234567 and code: def f(x): return x**2  # ok",
]
CHAT = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]


def test_token_ids_equal_transformers(folder: Path) -> None:
    from ferrum.tokenizer.tokenizer import Tokenizer

    theirs = transformers.AutoTokenizer.from_pretrained(str(DEMO_GGUF.parent), gguf_file=DEMO_GGUF.name)
    ours = Tokenizer.from_folder(folder)
    for text in TEXTS:
        ids = theirs(text)["input_ids"]
        assert ours.encode(text) == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
    chat = theirs.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True)
    chat_ids = chat["input_ids"] if isinstance(chat, Mapping) else chat
    assert ours.encode_chat(CHAT, add_generation_prompt=True) == list(chat_ids)
    assert (ours.bos_token, ours.eos_token) == (theirs.bos_token, theirs.eos_token)
