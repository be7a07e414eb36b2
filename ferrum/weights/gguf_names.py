"""GGUF's tensor names and HF's, and the row order llama.cpp's converter gave llama's attn_q / attn_k
(no ferrum imports: the GGUF reader and the published-checkpoint repacking both use it).

`hf_tensor_name("blk.3.attn_q.weight")` -> "model.layers.3.self_attn.q_proj.weight" (None for tensors
with no HF counterpart, e.g. rope_freqs), `gguf_tensor_name` the reverse; `hf_row_order` the index over
rows that restores the HF order (transformers undoes it the same way).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

__all__ = ["PERMUTED_ARCHITECTURES", "gguf_tensor_name", "hf_row_order", "hf_tensor_name"]

PERMUTED_ARCHITECTURES = frozenset({"llama"})  # llama.cpp permutes attn_q / attn_k rows of these

_GLOBAL_NAMES: Mapping[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES: Mapping[str, str] = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TO_GGUF_GLOBAL = {hf: gguf for gguf, hf in _GLOBAL_NAMES.items()}
_TO_GGUF_BLOCK = {hf: gguf for gguf, hf in _BLOCK_NAMES.items()}
_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.([\w.]+)\.(weight|bias)")


def hf_tensor_name(name: str) -> str | None:
    """The HF checkpoint's name of GGUF tensor `name` (None: no HF counterpart, e.g. rope_freqs.weight)."""
    stem, _, suffix = name.rpartition(".")
    if stem in _GLOBAL_NAMES and suffix in ("weight", "bias"):
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    match = _GGUF_BLOCK.fullmatch(name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        return None
    return f"model.layers.{match.group(1)}.{_BLOCK_NAMES[match.group(2)]}.{match.group(3)}"


def gguf_tensor_name(hf_name: str) -> str | None:
    """The GGUF tensor name of HF checkpoint tensor `hf_name` (None: GGUF has no such tensor)."""
    stem, _, suffix = hf_name.rpartition(".")
    if stem in _TO_GGUF_GLOBAL and suffix in ("weight", "bias"):
        return f"{_TO_GGUF_GLOBAL[stem]}.{suffix}"
    match = _HF_LAYER.fullmatch(hf_name)
    if match is None or match.group(2) not in _TO_GGUF_BLOCK:
        return None
    return f"blk.{match.group(1)}.{_TO_GGUF_BLOCK[match.group(2)]}.{match.group(3)}"


def hf_row_order(
    name: str, rows: int, *, architecture: str, num_heads: int, num_kv_heads: int
) -> torch.Tensor | None:
    """For GGUF tensor `name` (its first, output dim has `rows` rows) of a file whose
    general.architecture is `architecture`: the LongTensor index that puts its rows in HF order
    (`hf = stored[index]`, on raw block rows as on values), or None when they are in HF order already.
    Only attn_q / attn_k (weight and bias) of llama files are reordered: llama.cpp's converter wrote
    row (h, i, j) of head h (i: the rotary half, j < head_dim / 2) at (h, j, i)."""
    match = _GGUF_BLOCK.fullmatch(name)
    if architecture not in PERMUTED_ARCHITECTURES or match is None or match.group(2) not in ("attn_q", "attn_k"):
        return None
    heads = num_heads if match.group(2) == "attn_q" else num_kv_heads
    if heads <= 0 or rows % (2 * heads):
        raise ValueError(f"{name}: {rows} rows do not split into {heads} heads of two rotary halves")
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)
