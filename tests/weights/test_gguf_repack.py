"""GGUF's 4-bit block types repacked into the seam's int4, Q8_0 / Q5_0 / Q6_K into int8 with group scales
(ferrum.weights.quantization.published.gguf): the repacked weight, dequantized, equals gguf-py's own
dequantization of the blocks (ggml's reference in Python), exactly for all but Q4_K, and to
float32 rounding of the zero for Q4_K; llama's attn_q rows put back in HF order."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from gguf import quants  # noqa: E402

from ferrum.weights.gguf_names import hf_row_order  # noqa: E402
from ferrum.weights.quantization.arith import dequantize  # noqa: E402
from ferrum.weights.quantization.published.gguf import BLOCKS, GgufFormat  # noqa: E402

N, K = 48, 512
CONFIG = {"num_attention_heads": 4, "num_key_value_heads": 2}


def _blocks(kind: str, rng: np.random.Generator) -> np.ndarray:
    """Rows [N, bytes] of `kind`: gguf-py's quantizer where it has one, else random codes with sane scales."""
    if kind in ("Q4_0", "Q4_1", "Q8_0", "Q5_0"):
        return quants.quantize(rng.standard_normal((N, K)).astype(np.float32), gguf.GGMLQuantizationType[kind])
    per, size = BLOCKS[kind]
    raw = rng.integers(0, 256, (N * K // per, size), dtype=np.uint8)
    for start in (0, 2) if kind == "Q4_K" else (size - 2,):  # Q4_K's d, dmin; Q6_K's d
        raw[:, start:start + 2] = (rng.random(len(raw)) * 0.01 + 0.001).astype(np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(N, -1)


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1", "Q4_K", "Q8_0", "Q5_0", "Q6_K"])
@pytest.mark.parametrize("module", ["model.layers.0.mlp.up_proj", "model.layers.0.self_attn.q_proj"])
def test_repack_equals_ggml_dequantization(kind: str, module: str) -> None:
    rng = np.random.default_rng(3)
    rows = _blocks(kind, rng)
    fmt = GgufFormat({"architecture": "llama", "tensor_types": {f"{module}.weight": kind}}, CONFIG)
    scheme = fmt.scheme(module, K)
    int8 = kind in ("Q8_0", "Q5_0", "Q6_K")
    assert scheme is not None and scheme.group_size == (16 if kind == "Q6_K" else 32) and scheme.grouped
    assert scheme.method == ("int8" if int8 else "int4") and (int8 or scheme.symmetric == (kind == "Q4_0"))
    assert fmt.check(module, N, K, {"blocks": ((N, rows.shape[1]), torch.uint8)}) == []
    repacked = fmt.repack(module, N, K, {"blocks": torch.from_numpy(rows)}, torch.bfloat16).weight
    ref = torch.from_numpy(quants.dequantize(rows, gguf.GGMLQuantizationType[kind]))
    order = hf_row_order(fmt.stored_name(f"{module}.weight"), N, architecture="llama", num_heads=4, num_kv_heads=2)
    assert (order is not None) == module.endswith("q_proj")
    if order is not None:
        ref = ref[order]
    got = dequantize(repacked, torch.float32)
    if kind == "Q4_K":  # zero = offset + 8 * scale rounded to float32 where they lie far apart
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-6 * ref.abs().max().item())
    else:
        assert torch.equal(got, ref)


def test_blocks_of_the_wrong_size_are_named() -> None:
    module = "model.layers.0.mlp.up_proj"
    fmt = GgufFormat({"architecture": "llama", "tensor_types": {f"{module}.weight": "Q4_K"}}, CONFIG)
    problems = fmt.check(module, N, K, {"blocks": ((N, 100), torch.uint8)})
    assert problems == ["tensor 'blk.0.ffn_up.weight' has shape (48, 100), expected (48, 288)"]
    assert fmt.check(module, N, 500, {}) == [f"{module}: 500 inputs do not fill Q4_K blocks of 256"]
