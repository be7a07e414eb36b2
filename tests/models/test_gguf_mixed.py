"""A llama GGUF mixing block types as llama.cpp's Q4_K_M files do (Q4_K, Q6_K, Q5_K, Q5_1, Q8_0, Q4_0, F16
and F32 tensors; attn_q / attn_k rows in llama.cpp's order), written by gguf-py, served by Ferrum in float32
on the CPU: the logits equal HF transformers' loading the same file (its own dequantization, float32),
to float32 rounding; each type is served as said (int4, int8 with group scales, or dequantized; a fused
projection of parts in different types as int8 with zeros)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ferrum.engine.block_manager import BlockManager
from ferrum.engine.sampling_params import SamplingParams
from ferrum.engine.scheduler import ScheduledSequence
from ferrum.engine.sequence import Sequence
from ferrum.models.config import load_model_config
from ferrum.models.layers import layer_ops
from ferrum.models.layers.quantized_linear import QuantizedLinear
from ferrum.models.loader import load_model
from ferrum.weights.formats.gguf import gguf_header
from ferrum.weights.formats.gguf_model import gguf_config
from ferrum.weights.loader import WeightLoader
from ferrum.weights.spec.sources import File
from tests.engines import host_device, make_runner

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
Q = gguf.GGMLQuantizationType

HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 256, 512, 4, 2, 128
# per layer: each projection's type (K-quants need K a multiple of 256)
TYPES = [
    {"attn_q": Q.Q4_K, "attn_k": Q.Q4_K, "attn_v": Q.Q6_K, "attn_output": Q.Q4_K, "ffn_gate": Q.Q4_K,
     "ffn_up": Q.Q4_K, "ffn_down": Q.Q6_K},
    {"attn_q": Q.Q8_0, "attn_k": Q.Q8_0, "attn_v": Q.Q5_K, "attn_output": Q.Q4_0, "ffn_gate": Q.Q5_0,
     "ffn_up": Q.Q5_0, "ffn_down": Q.F16},
    {"attn_q": Q.Q5_1, "attn_k": Q.Q5_1, "attn_v": Q.Q5_1, "attn_output": Q.Q5_K, "ffn_gate": Q.Q5_K,
     "ffn_up": Q.Q5_K, "ffn_down": Q.Q5_1},
]
SHAPES = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (KV_HEADS * 64, HIDDEN), "attn_v": (KV_HEADS * 64, HIDDEN),
          "attn_output": (HIDDEN, HIDDEN), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
          "ffn_down": (HIDDEN, FFN)}


def _blocks(kind: Any, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """A [rows, K] tensor of `kind`: gguf-py's quantizer where it has one, else random codes with sane scales."""
    if kind in (Q.F16, Q.F32):
        return (rng.standard_normal(shape) * 0.05).astype(np.float16 if kind == Q.F16 else np.float32)
    values = (rng.standard_normal(shape) * 0.05).astype(np.float32)
    try:
        return gguf.quants.quantize(values, kind)
    except NotImplementedError:  # K-quants: random blocks, their float16 d (and dmin) small
        per, size = gguf.GGML_QUANT_SIZES[kind]
        raw = rng.integers(0, 256, (shape[0] * shape[1] // per, size), dtype=np.uint8)
        scales = (rng.random((len(raw), 2)) * 0.002 + 0.0005).astype(np.float16).view(np.uint8)
        if kind == Q.Q6_K:
            raw[:, size - 2:] = scales[:, :2]
        else:  # Q4_K, Q5_K: d, dmin first
            raw[:, :4] = scales
        return raw.reshape(shape[0], -1)


def _llama_writer(path: Path, blocks: int) -> Any:
    """A gguf-py writer of a llama file of `blocks` layers of this module's shapes, its hyperparameters written."""
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(blocks)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    return writer


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = Path(tmp_path_factory.mktemp("gguf-mixed")) / "mixed.gguf"
    rng = np.random.default_rng(4)
    writer = _llama_writer(path, len(TYPES))
    writer.add_vocab_size(VOCAB)
    writer.add_tensor("token_embd.weight", (rng.standard_normal((VOCAB, HIDDEN)) * 0.5).astype(np.float16))
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    writer.add_tensor("output.weight", _blocks(Q.Q6_K, (VOCAB, HIDDEN), rng), raw_dtype=Q.Q6_K)
    for i, types in enumerate(TYPES):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{i}.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
        for name, kind in types.items():
            data = _blocks(kind, SHAPES[name], rng)
            writer.add_tensor(f"blk.{i}.{name}.weight", data, raw_dtype=None if kind in (Q.F16, Q.F32) else kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_mixed_gguf_logits_equal_transformers(mixed: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(__import__("json").dumps(gguf_config(gguf_header(mixed), mixed)))
    device = host_device()
    model, report = load_model(load_model_config(tmp_path), File(mixed), device, torch.float32, layer_ops(device),
                               WeightLoader())
    served = {name: layer.scheme.describe() for name, layer in model.quantized_layers().items()}
    assert served["layers.0.self_attn.o_proj"] == "int4 (group 32, Q4_K sub-scales)"  # Q4_K, in its own factors
    assert served["layers.0.mlp.gate_up_proj"] == "int4 (group 32, Q4_K sub-scales)"
    assert served["layers.0.mlp.down_proj"] == "int8 (group 16)"  # Q6_K
    assert served["lm_head"] == "int8 (group 16)"  # Q6_K
    assert served["layers.1.self_attn.o_proj"] == "int4 (group 32, symmetric, float16 scales)"  # Q4_0
    assert served["layers.1.mlp.gate_up_proj"] == "int8 (group 32)"  # Q5_0
    assert "layers.1.mlp.down_proj" not in served  # F16
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):  # Q5_1, Q5_K
        assert served[f"layers.2.{name}"] == "int8 (group 32, with zeros)"
    from ferrum.kernels.config import KernelConfig
    from ferrum.models.fused_decode import FusedDecode

    assert FusedDecode(model, KernelConfig(), pdl=False).max_rows == 1  # the GEMV reads int8's zeros too
    # q/k and v in different types (Q4_K and Q6_K as Q4_K_M files have them; Q8_0 and Q5_K): the fused
    # projection is served in int8 with a scale and a zero per group of the smaller group, exactly
    assert served["layers.0.self_attn.qkv_proj"] == "int8 (group 16, with zeros)"
    assert served["layers.1.self_attn.qkv_proj"] == "int8 (group 32, with zeros)"
    hf = transformers.AutoModelForCausalLM.from_pretrained(mixed.parent, gguf_file=mixed.name,
                                                           dtype=torch.float32).eval()
    ids = [3, 17, 99, 5, 64, 2, 120, 31, 8, 77, 45]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0, [4, len(ids) - 1]]
    runner = make_runner(model, device, 16, 8, enforce_eager=True)
    blocks = BlockManager(num_blocks=16, block_size=8)
    seqs = [Sequence(f"p{n}", ids[:n], SamplingParams(max_tokens=1), 0.0) for n in (5, len(ids))]
    for seq in seqs:
        blocks.grow(seq, seq.num_tokens)
    got, _ = runner.execute([ScheduledSequence(s, s.num_tokens) for s in seqs])
    assert (got.float() - want).abs().max().item() < 1e-4 * max(1.0, want.abs().max().item())
    assert isinstance(model.lm_head, QuantizedLinear)


def _q4_k_logits(path: Path, size: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    from ferrum.engine.observer import StepRecord
    from tests.engines import local_engine

    engine = local_engine(str(path), tensor_parallel_size=size, dtype="float32", max_num_seqs=4,
                          max_num_batched_tokens=64, kv_cache_memory_gb=0.01)
    records: list[StepRecord] = []
    remove = engine.add_observer(records.append)
    try:
        tokens = engine.generate([[5, 17, 2, 7, 30, 3], [9] * 12], SamplingParams(max_tokens=3, temperature=0))
    finally:
        remove()
        engine.release()
    return tokens, [r.logits for r in records if r.logits is not None and r.logits.numel()]


def test_q4_k_at_tensor_parallel_2_gives_one_process_logits(tmp_path: Path) -> None:
    """Every projection in Q4_K over two ranks (gloo): q/k/v, gate/up and the head split by rows; down_proj's
    512 inputs as 256 a rank (whole super-blocks: each rank keeps its own factors); o_proj's 256 as 128 a
    rank (half a super-block: float32 scales and zeros per group of 32, exactly). The logits equal one
    process's up to summation order."""
    from tests.weights.test_gguf import MERGES, TOKENS
    from tests.weights.test_gguf import TYPES as TOKEN_TYPES

    rng = np.random.default_rng(8)
    path = tmp_path / "q4k.gguf"
    writer = _llama_writer(path, 1)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(TOKENS)
    writer.add_token_types(TOKEN_TYPES)
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_tensor("token_embd.weight", (rng.standard_normal((len(TOKENS), HIDDEN)) * 0.5).astype(np.float16))
    writer.add_tensor("output_norm.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    writer.add_tensor("output.weight", _blocks(Q.Q4_K, (len(TOKENS), HIDDEN), rng), raw_dtype=Q.Q4_K)
    for norm in ("attn_norm", "ffn_norm"):
        writer.add_tensor(f"blk.0.{norm}.weight", (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))
    for name, shape in SHAPES.items():
        writer.add_tensor(f"blk.0.{name}.weight", _blocks(Q.Q4_K, shape, rng), raw_dtype=Q.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    one_tokens, one_logits = _q4_k_logits(path, 1)
    two_tokens, two_logits = _q4_k_logits(path, 2)
    assert two_tokens == one_tokens and len(two_logits) == len(one_logits) > 0
    for got, want in zip(two_logits, one_logits, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
