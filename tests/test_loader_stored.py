"""The loader's direct file reads (the GPU upload path reads tensors straight from the file)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from ferrum.models.loader import iter_stored_tensors
from ferrum.weights.errors import CorruptWeightsError
from tests.tiny_model import make_tiny_llama


def test_stored_tensors_read_what_safetensors_reads(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path / "m", max_shard_size="20KB")
    seen = 0
    for name, stored, path in iter_stored_tensors(folder):
        with safe_open(str(path), framework="pt") as f:
            assert torch.equal(stored.read(), f.get_tensor(name)), name
        seen += 1
    assert seen > 5


def test_a_truncated_file_names_itself(tmp_path: Path) -> None:
    folder = make_tiny_llama(tmp_path / "m")
    broken = tmp_path / "broken"
    shutil.copytree(folder, broken)
    weights = next(broken.glob("*.safetensors"))
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) - 100])
    with pytest.raises(CorruptWeightsError, match=str(weights)):
        for _, stored, _ in iter_stored_tensors(broken):
            stored.read()
