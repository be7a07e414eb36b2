"""`quantization: auto` (`--quantization auto`): the fastest configuration for the device that stays
within the quantization bounds the tests hold (tests/engine/test_cpu_auto.py), decided once the
engine has its `Device`, before the model is built.

    CPU, weights that fit the   served as stored: a model whose weights fit the last-level cache its
    cache its cores can hold    cores can count on (Device.cache_bytes: their share, at most 12 MiB a
                                core) is not read from memory each token, so int4 would only cost
                                accuracy
    CPU with its C++ kernels    linear layers int4 in groups of 32 (asymmetric), quantized on load;
                                a checkpoint stored quantized (GPTQ, AWQ, GGUF, ...) keeps its own
                                format. Either way the layers compute through the kernels' integer
                                GEMV, and the LM head is int8 in groups of 32 for decode steps
                                (ferrum.models.layers.int8_head). Decode on the CPU streams every
                                weight once a token: int4 reads a quarter of bf16's bytes, and the
                                kernels read them at the memory's speed. Served in 16 bits (bf16),
                                int4's scales and zeros are float16: a checkpoint dequantized from
                                4-bit groups of 32 (the demo model, from its Q4_1 GGUF) gets its own
                                grid back, where bfloat16 ones turned the demo's near-tie answer to
                                "What is the capital of France?" ("The" -1.864, "L" -1.963 in
                                float32) into "L'Étoile, ..." on an AMX Xeon. Served in float32 they
                                stay float32. Served in 16 bits on AVX512-VNNI with head_dim 64 or
                                128, the KV cache is int8 too (where kv_cache_dtype is auto): half
                                the bytes long contexts read each step (TPOT at 6,000 tokens
                                1.47-1.58x TPOT at 50, against 2.06 with bf16, on that Xeon, before
                                the GEMVs' prefetch made the short step faster: 1.90x since), the
                                kernels scoring its tiles in integers. A prompt prefilled from its
                                first token reads its own keys and values as computed, not from the
                                cache, so it is scored as with a bf16 cache (the race's perplexity
                                read every key quantized before: 15.970 against llama.cpp's 15.944,
                                a bf16 cache's 15.891). Served in float32 on AVX2 without VNNI (no
                                bf16 matmul units: an AVX2-only CPU), head_dim 64 or 128, the KV
                                cache is int8 as well, its tiles' bytes widened to 16 bits and
                                multiplied by 16-bit queries and weights (vpmaddwd) as they lie: a
                                2-core AVX2 EPYC's 6,000-token decode step 17.4-18.5 ms with a
                                bfloat16 cache -> 11.9-12.9 ms, alternating. (A prompt hitting the
                                prefix cache then reads its prefix quantized where one prefilled
                                alone reads its own keys: their greedy answers can part, so the
                                tests that compare outputs serve a float32 cache.) Otherwise,
                                served in float32, the KV cache is
                                bfloat16: half a float32 cache's bytes (27-29 -> 19-22 ms on that
                                EPYC)
    anything else               served as stored (bf16 GEMMs of GPUs are not bound the same way; the
                                GPU's quantized paths are opt-in: --quantization int4 / int8 / fp8)

The server's default (ferrum.config.loader); the engine's own (EngineConfig, create_engine) is to
serve the weights as stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ferrum.backends.device import Device
from ferrum.models.config import ModelConfig
from ferrum.weights.quantization.scheme import QuantizationConfig

CPU_GROUP = 32  # the CPU kernels' activation block: groups of 32 inputs cost no extra scale loads
ASSUMED_CACHE = 32 * 2**20  # a CPU whose cache sysfs does not report
INT8_KV_HEAD_DIMS = (64, 128)  # the head widths whose int8 tiles the kernels score in integers (VNNI or AVX2)


@dataclass(frozen=True)
class QuantizationChoice:
    quantization: QuantizationConfig | None  # the linear layers' on-load quantization (None: as stored)
    reason: str = ""  # what auto picked and why (empty when the setting was not auto)
    int8_head: bool = False  # the LM head int8 for decode steps (ferrum.models.layers.int8_head)
    kv_dtype: torch.dtype | None = None  # the KV cache's dtype where kv_cache_dtype is auto (None: the serving dtype)


def streamed_bytes(model: ModelConfig, dtype: torch.dtype) -> int:
    """Bytes of the weights a decode step reads in `dtype`: every layer's projections and the LM head."""
    h, q, kv = model.hidden_size, model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    per_layer = h * (q + 2 * kv) + q * h + 3 * h * model.intermediate_size
    return (model.num_layers * per_layer + model.vocab_size * h) * dtype.itemsize


def resolve_quantization(config: QuantizationConfig | None, device: Device, model: ModelConfig,
                         cpu_kernels: bool, dtype: torch.dtype) -> QuantizationChoice:
    if config is None or not config.auto:
        return QuantizationChoice(config)
    where = f"{device.name} ({device.description})"
    if device.kind != "cpu" or not cpu_kernels:
        why = "its C++ kernels are not built" if device.kind == "cpu" else "GPUs serve as stored unless asked"
        return QuantizationChoice(None, f"quantization auto on {where}: weights as stored ({why})")
    streamed, cache = streamed_bytes(model, dtype), device.cache_bytes or ASSUMED_CACHE
    if streamed <= cache:
        return QuantizationChoice(None, f"quantization auto on {where}: weights as stored (their "
                                        f"{streamed / 2**20:.1f} MiB fit the {cache / 2**20:.0f} MiB of cache its "
                                        "cores can count on: "
                                        "decode does not stream them from memory)")
    widths = {model.hidden_size, model.intermediate_size, model.num_heads * model.head_dim}
    if any(width % CPU_GROUP for width in widths):
        return QuantizationChoice(None, f"quantization auto on {where}: weights as stored (the layers' widths "
                                        f"{sorted(widths)} are not all multiples of {CPU_GROUP})")
    head = "; the LM head int8 in groups of 32 (float activations, float32 logits)"
    kv_dtype: torch.dtype | None = None
    kernels_read_cache = not device.triton  # (a CPU device with Triton reads its cache with Triton's kernels)
    vnni = "avx512_vnni" in device.cpu_flags
    if kernels_read_cache and dtype.itemsize == 2 and vnni and model.head_dim in INT8_KV_HEAD_DIMS:
        kv_dtype = torch.int8
        head += "; the KV cache int8 where kv_cache_dtype is auto (AVX512-VNNI scores its tiles in integers)"
    elif kernels_read_cache and dtype == torch.float32 and not vnni and "avx2" in device.cpu_flags \
            and model.head_dim in INT8_KV_HEAD_DIMS:
        kv_dtype = torch.int8
        head += ("; the KV cache int8 where kv_cache_dtype is auto (AVX2 scores its tiles in 16-bit integers: a "
                 "quarter of a float32 cache's bytes)")
    elif kernels_read_cache and dtype == torch.float32:
        kv_dtype = torch.bfloat16
        head += ("; the KV cache bfloat16 where kv_cache_dtype is auto (half a float32 cache's bytes for a long "
                 "context to read; the attention kernel widens each head as it reads it)")
    if model.published is not None:
        return QuantizationChoice(None, f"quantization auto on {where}: the checkpoint's own "
                                        f"{model.published.name} layers through the CPU kernels' integer GEMV{head}",
                                  int8_head=True, kv_dtype=kv_dtype)
    # 16-bit serving: scales and zeros in float16 (bf16's bytes, 3 more bits: a checkpoint dequantized from
    # 4-bit groups of 32 gets its own grid back); float32 serving keeps them in float32
    params = torch.float16 if dtype.itemsize == 2 else None
    on_load = QuantizationConfig("int4", group_size=CPU_GROUP, params=params)
    scales = ", float16 scales" if params else ""
    return QuantizationChoice(on_load, f"quantization auto on {where}: linear layers int4 (groups of {CPU_GROUP}, "
                                       f"asymmetric{scales}) through the CPU kernels' integer GEMV{head}",
                              int8_head=True, kv_dtype=kv_dtype)
