"""The per-step roofline's arithmetic (ferrum.bench.roofline), on hand-made steps."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ferrum.bench.roofline import DevicePeaks, ModelCost, Roofline
from ferrum.engine.observer import StepKind, StepRecord
from ferrum.models.config import ModelConfig, MoeConfig, RopeConfig


def _config(tied: bool) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=64, intermediate_size=128,
                       num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5,
                       rope=RopeConfig(theta=10000.0),
                       max_position_embeddings=512, tie_word_embeddings=tied, attention_bias=False, qk_norm=False,
                       mlp_bias=False, dtype=torch.bfloat16, sliding_window=None, eos_token_ids=(2,),
                       bos_token_id=1)


def _record(kind: StepKind, seqs: int, tokens: int, cached: int, attended: int, iterations: int = 1) -> StepRecord:
    return StepRecord(kind=kind, num_seqs=seqs, num_tokens=tokens, num_generated=seqs, started=0.0, finished=1.0,
                      iterations=iterations, cached_tokens=cached, attended_keys=attended)


def test_model_cost_counts_the_body_head_and_attention() -> None:
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 3 * 64 * 128
    untied = ModelCost.of(_config(tied=False), weight_bytes=10_000_000, embedding_itemsize=2, kv_bytes_per_token=256)
    assert untied.linear_flops_per_token == 2 * 2 * per_layer
    assert untied.head_flops_per_seq == 2 * 1000 * 64
    assert untied.attention_flops_per_key == 4 * 4 * 16 * 2
    assert untied.weight_bytes_per_pass == 10_000_000 - 1000 * 64 * 2  # the embedding table is not read whole
    tied = ModelCost.of(_config(tied=True), weight_bytes=10_000_000, embedding_itemsize=2, kv_bytes_per_token=256)
    assert tied.weight_bytes_per_pass == 10_000_000  # the tied table is the head: read whole


def test_each_pass_takes_the_larger_of_its_flops_and_bytes() -> None:
    cost = ModelCost(linear_flops_per_token=100.0, head_flops_per_seq=10.0, attention_flops_per_key=1.0,
                     weight_bytes_per_pass=1000.0, kv_bytes_per_token=2.0)
    roofline = Roofline(cost, DevicePeaks(matmul_flops=100.0, bandwidth=100.0))
    # a prefill of 2 sequences x 8 new tokens after 4 cached each: 2 * (8 * 4 + 36) keys attended
    roofline.add(_record("prefill", seqs=2, tokens=16, cached=8, attended=136))
    prefill_flops = 100 * 16 + 10 * 2 + 136
    prefill_bytes = 1000 + 2 * (8 + 2 * 16)
    assert roofline.seconds == pytest.approx(max(prefill_flops, prefill_bytes) / 100)
    assert roofline.compute_bound == 1  # 1756 FLOPs against 1080 bytes
    # a burst of 3 iterations of 2 decoding sequences, 20 tokens cached when it began
    roofline.add(_record("burst", seqs=2, tokens=2, cached=20, attended=22, iterations=3))
    burst = [max(100 * 2 + 10 * 2 + (22 + 2 * j), 1000 + 2 * (20 + 2 * j + 4)) for j in range(3)]
    assert roofline.passes == 4
    assert roofline.compute_bound == 1  # the burst's passes move more bytes (1048+) than they compute (242+)
    assert roofline.by_kind == pytest.approx({"prefill": max(prefill_flops, prefill_bytes) / 100,
                                              "burst": sum(burst) / 100})
    assert roofline.fraction(2 * roofline.seconds) == pytest.approx(0.5)


def test_a_mixture_of_experts_counts_the_experts_its_tokens_pick() -> None:
    """8 experts of 32, top 2, in both layers: a token's FLOPs are its router and 2 experts; a pass's bytes
    are the rest of the weights plus the experts its tokens pick (expected, with routing spread evenly)."""
    moe = MoeConfig(num_experts=32, top_k=2, intermediate_size=48, normalize=True, sparse_layers=(0, 1))
    config = replace(_config(tied=True), moe=moe)
    expert = 3 * 64 * 48 * 2  # one expert in both layers, elements
    cost = ModelCost.of(config, weight_bytes=10_000_000, embedding_itemsize=2, kv_bytes_per_token=256)
    attention = 64 * (64 + 2 * 32) + 64 * 64
    assert cost.linear_flops_per_token == 2 * (2 * attention + 2 * 64 * 32 + 2 * expert)
    assert cost.weight_bytes_per_pass == 10_000_000 - 32 * expert * 2
    assert cost.expert_bytes_read(1) == pytest.approx(2 * expert * 2)  # one token: its 2 experts
    assert cost.expert_bytes_read(10_000) == pytest.approx(32 * expert * 2)  # many: every expert once
