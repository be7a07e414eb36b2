"""One place for each fact: the KV-cache layout (bytes, slots, allocation), the request limits the
engine, its clients and the server share, and the memory planner (host and GPU, the GPU's
against a stand-in runtime: every byte counted against the budget). And the step observer."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from ferrum.backends.cuda import CUDABackend
from ferrum.engine.builder import create_engine
from ferrum.engine.config import EngineConfig
from ferrum.engine.limits import PromptTooLongError, RequestLimits
from ferrum.engine.memory_plan import plan_gpu, plan_host
from ferrum.engine.observer import StepRecord
from ferrum.engine.sampling_params import SamplingParams
from ferrum.kernels.config import GemmRules
from ferrum.models.attention.layout import KVCacheLayout
from tests.backends.test_backends import GIB, StubRuntime, gpu_facts
from tests.engines import host_device
from tests.tiny_model import make_tiny_llama

MIB = 2**20


def test_kv_layout_bytes_slots_and_allocation() -> None:
    layout = KVCacheLayout(num_layers=3, num_kv_heads=2, head_dim=8, dtype=torch.bfloat16, block_size=4)
    assert layout.bytes_per_token == 2 * 3 * 2 * 8 * 2
    assert layout.bytes_per_block == layout.bytes_per_token * 4
    assert layout.blocks_in(10 * layout.bytes_per_block + 1) == 10 and layout.blocks_in(-5) == 0
    assert [layout.blocks_for(n) for n in (1, 4, 5)] == [1, 1, 2]
    table = [7, 2, 9]
    assert layout.slots(table, 2, 6) == [30, 31, 8, 9] and layout.slot(table, 9) == 37
    caches = layout.allocate(5, torch.device("cpu"))
    assert len(caches) == 3 and all(k.shape == v.shape == (20, 2, 8) and k.dtype == torch.bfloat16 for k, v in caches)
    assert layout.allocate(5, torch.device("cpu"), block_major=True)[0][0].shape == (5, 2, 4, 8)
    # int8: each head's 8 values, then its float32 scale (4 bytes): 12 bytes against bf16's 16
    int8 = dataclasses.replace(layout, dtype=torch.int8)
    assert int8.quantized and int8.head_width == 12 and int8.bytes_per_token == 2 * 3 * 2 * 12
    assert int8.allocate(5, torch.device("cpu"))[0][0].shape == (20, 2, 12)


def test_kv_cache_dtype_is_checked_and_int8_is_refused_without_the_cpu_kernels(tmp_path: Path) -> None:
    assert EngineConfig(kv_cache_dtype="auto").kv_dtype(torch.bfloat16) == torch.bfloat16
    assert EngineConfig(kv_cache_dtype="bf16").kv_dtype(torch.float32) == torch.bfloat16
    assert EngineConfig(kv_cache_dtype="fp16").kv_dtype(torch.bfloat16) == torch.float16
    assert EngineConfig(kv_cache_dtype="int8").kv_dtype(torch.bfloat16) == torch.int8
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be auto, int8, fp8 \(fp8_e4m3\) or a serving dtype"):
        EngineConfig(kv_cache_dtype="fp4")
    with pytest.raises(ValueError, match="read only by the CPU kernels' attention.*not loaded"):
        create_engine(make_tiny_llama(tmp_path / "tiny"), backend="cpu", kv_cache_dtype="int8",
                      kernels={"cpu": False})


def test_request_limits() -> None:
    limits = RequestLimits(max_model_len=100, vocab_size=50)
    assert limits.max_tokens(10, None) == 90 and limits.max_tokens(10, 90) == 90
    with pytest.raises(PromptTooLongError, match="you requested 101 tokens") as info:
        limits.max_tokens(10, 91)
    assert (info.value.prompt_tokens, info.value.max_tokens) == (10, 91)
    with pytest.raises(PromptTooLongError, match="leaves no room") as info:
        limits.max_tokens(100, None)
    assert info.value.max_tokens is None
    limits.check([1, 2, 49], 97)
    with pytest.raises(ValueError, match="empty"):
        limits.check([], 1)
    with pytest.raises(ValueError, match=r"out of range \[0, 50\): \[50, -1\]"):
        limits.check([1, 50, -1], 1)


def test_host_plan_takes_the_configured_size_or_a_share_of_free_memory() -> None:
    device = host_device()
    layout = KVCacheLayout(2, 2, 8, torch.float32, 16)
    plan = plan_host(device, layout, EngineConfig(kv_cache_memory_gb=0.5))
    assert plan.kv_cache_bytes == GIB // 2 and plan.num_blocks == (GIB // 2) // layout.bytes_per_block
    default = plan_host(device, layout, EngineConfig())
    assert 0 < default.kv_cache_bytes <= min(2 * GIB, device.free_memory_bytes() // 5 + 64 * MIB)


class ProfilingRuntime(StubRuntime):
    """A stand-in GPU whose allocator the profile fills: peak and held as torch would report."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.peak = 0

    def allocate(self, size: int) -> None:
        super().allocate(size)
        self.peak = max(self.peak, self.memory_held())

    def peak_memory_held(self) -> int:
        return max(self.peak, self.memory_held())

    def reset_peak_memory(self) -> None:
        self.peak = self.memory_held()


def test_gpu_plan_counts_every_byte_against_the_budget() -> None:
    runtime = ProfilingRuntime(total_bytes=80 * GIB, used_by_others_bytes=3 * GIB)
    device = CUDABackend(gpu_facts(), runtime).device()
    runtime.allocate(16 * GIB)  # the weights
    runtime.allocate(5 * GIB)
    runtime.free(5 * GIB)  # cached from earlier work (e.g. an engine released before): not weights
    layout = KVCacheLayout(32, 8, 128, torch.bfloat16, 16)
    scratch = layout.bytes_per_block * 600

    def profile() -> int:
        runtime.allocate(scratch)  # the scratch KV cache
        runtime.allocate(2 * GIB)  # activations, the sampler, the largest graph's pool
        runtime.free(2 * GIB)  # cached by the allocator, as torch keeps it
        runtime.free(scratch)
        return scratch

    plan = plan_gpu(device, layout, EngineConfig(gpu_memory_utilization=0.9), profile)
    assert runtime.log.count("empty_cache") == 2  # before the weights' measure and after the profile
    assert plan.weights_bytes == 16 * GIB and plan.peak_bytes == 18 * GIB
    assert plan.other_bytes == 3 * GIB
    assert plan.budget_bytes == int(0.9 * 80 * GIB)
    assert plan.kv_cache_bytes == plan.budget_bytes - 3 * GIB - 18 * GIB
    assert plan.num_blocks == plan.kv_cache_bytes // layout.bytes_per_block
    # the configured size wins over the measured budget
    fixed = plan_gpu(device, layout, EngineConfig(kv_cache_memory_gb=4), lambda: 0)
    assert fixed.kv_cache_bytes == 4 * GIB


def test_step_observer_sees_every_step(engine) -> None:  # the conftest engine: the demo model, float32
    records: list[StepRecord] = []
    remove = engine.add_observer(records.append)
    try:
        prompt = engine.tokenizer.encode("The capital of France is")
        (out,) = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    finally:
        remove()
    assert [r.kind for r in records] == ["prefill", "decode", "decode"]
    assert records[0].num_tokens == len(prompt) and records[1].num_tokens == 1
    assert all(r.num_generated == 1 and r.num_seqs == 1 and r.finished >= r.started for r in records)
    n = len(prompt)  # what each step's passes read from the cache (the roofline's input)
    assert [(r.iterations, r.cached_tokens, r.attended_keys) for r in records] == [
        (1, 0, n * (n + 1) // 2), (1, n, n + 1), (1, n + 1, n + 2)]
    chosen = []
    for r in records:
        assert r.logits is not None  # an ordinary step keeps its logits
        chosen.append(int(r.logits[0].argmax()))
    assert chosen == out  # greedy: the sampled rows' logits
    engine.generate([prompt], SamplingParams(max_tokens=1))
    assert len(records) == 3  # removed


def test_engine_config_reads_kernel_settings_from_yaml() -> None:
    config = EngineConfig.from_mapping({"kernels": {"pdl": False, "max_decode_splits": 16, "gemv": {"k_slice": 1024}}})
    assert (config.kernels.pdl, config.kernels.max_decode_splits, config.kernels.gemv.k_slice) == (False, 16, 1024)
    rows = EngineConfig.from_mapping({"kernels": {"int4_w8a8_rows": 129, "int4_w8a8_format": "fp8"}}).kernels
    assert rows.gemm_rules(True) == GemmRules(True, 129, "fp8")
    assert rows.gemm_rules(False) == GemmRules(False, 129, "int8")  # no row-wise fp8 _scaled_mm: int8 serves
    auto = EngineConfig.from_mapping({}).kernels  # int4 W8A8 in fp8 from DEQUANTIZE_FROM rows on cc 9.0 only
    assert (auto.gemm_rules(True), auto.gemm_rules(False)) == (GemmRules(True, 1, "fp8"), GemmRules(False, 0, "int8"))
    off = EngineConfig.from_mapping({"kernels": {"int4_w8a8_rows": 0}}).kernels
    assert off.gemm_rules(True) == GemmRules(True, 0, "fp8")
    with pytest.raises(ValueError, match="int4_w8a8_rows"):
        EngineConfig.from_mapping({"kernels": {"int4_w8a8_rows": -1}})
    with pytest.raises(ValueError, match="int4_w8a8_format"):
        EngineConfig.from_mapping({"kernels": {"int4_w8a8_format": "int4"}})
    with pytest.raises(ValueError, match="unknown engine.kernels key"):
        EngineConfig.from_mapping({"kernels": {"pld": False}})
    with pytest.raises(ValueError, match="power of two"):
        EngineConfig.from_mapping({"kernels": {"gemv": {"k_slice": 1000}}})
    assert dataclasses.asdict(EngineConfig())["kernels"]["gemv"]["k_slice"] == 2048
