"""Building a model: laid out on the meta device, then allocated where it runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BUILD = """
import sys
from ferrum.models.config import load_model_config
from ferrum.models.layers import torch_ops
from ferrum.models.loader import build_model
from tests.engines import host_device
import torch
model = build_model(load_model_config(sys.argv[1]), host_device(), torch.float32, torch_ops())
assert torch.isfinite(model.rotary.cos_table).all() and model.rotary.cos_table.shape == (256, 16)
print("torch._dynamo" in sys.modules)
"""


def test_building_a_model_does_not_import_torch_dynamo(tmp_path: Path) -> None:
    """Arithmetic on meta tensors (rotary tables, nn.Embedding's random init) runs torch's reference ops,
    whose first call imports torch._dynamo: 1.2-1.4 s of a CPU server's start-up. A fresh process builds a
    small Llama and has not imported it."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
    }))
    done = subprocess.run([sys.executable, "-c", BUILD, str(tmp_path)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "False"
