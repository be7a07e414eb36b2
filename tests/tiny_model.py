"""A tiny random-weight Llama model folder for source tests (transformers is test-only here).

It uses the demo model's tokenizer files, so Ferrum can load and run it like any model folder.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "models" / "SmolLM2-135M-Instruct"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def make_tiny_llama(folder: Path, seed: int = 0, max_shard_size: str | None = None) -> Path:
    """Writes config.json, generation_config.json, safetensors weights (sharded when
    `max_shard_size` is given) and the demo tokenizer files into `folder`."""
    transformers = pytest.importorskip("transformers")
    import torch

    folder.mkdir(parents=True, exist_ok=True)
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    for name in TOKENIZER_FILES:
        shutil.copyfile(DEMO / name, folder / name)
    return folder


def folder_files(folder: Path) -> dict[str, bytes]:
    """Relative name -> content of every file in `folder` (follows symlinks)."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
