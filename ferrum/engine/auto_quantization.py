"""`quantization: auto` (`--quantization auto`): the fastest configuration for the device that stays
within the quantization bounds the tests hold (tests/engine/test_cpu_auto.py), decided once the
engine has its `Device`, before the model is built.

    CPU, weights that fit its   served as stored: a model whose weights fit the last-level cache
    last-level cache            is not read from memory each token, so int4 would only cost accuracy
    CPU with its C++ kernels    linear layers int4 in groups of 32 (asymmetric), quantized on load;
                                a checkpoint stored quantized (GPTQ, AWQ, GGUF, ...) keeps its own
                                format. Either way the layers compute through the kernels' integer
                                GEMV, and the LM head is int8 in groups of 32 for decode steps
                                (ferrum.models.layers.int8_head). Decode on the CPU streams every
                                weight once a token: int4 reads a quarter of bf16's bytes, and the
                                kernels read them at the memory's speed. With AVX512-VNNI and head_dim
                                64 or 128 the KV cache is int8 too (kv_cache_dtype auto; a float32
                                scale per head and token; block_size a multiple of 16), whose bytes a
                                decode step streams as well: about half of bfloat16's
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
INT8_KV_HEAD_DIMS = (64, 128)  # the CPU kernels' integer attention over an int8 cache (attention.cpp, run_item_tiled)


@dataclass(frozen=True)
class QuantizationChoice:
    quantization: QuantizationConfig | None  # the linear layers' on-load quantization (None: as stored)
    reason: str = ""  # what auto picked and why (empty when the setting was not auto)
    int8_head: bool = False  # the LM head int8 for decode steps (ferrum.models.layers.int8_head)
    int8_kv: bool = False  # the KV cache int8 where kv_cache_dtype is auto (KVCacheLayout.quantized)


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
                                        f"{streamed / 2**20:.1f} MiB fit the CPU's {cache / 2**20:.0f} MiB cache: "
                                        "decode does not stream them from memory)")
    widths = {model.hidden_size, model.intermediate_size, model.num_heads * model.head_dim}
    if any(width % CPU_GROUP for width in widths):
        return QuantizationChoice(None, f"quantization auto on {where}: weights as stored (the layers' widths "
                                        f"{sorted(widths)} are not all multiples of {CPU_GROUP})")
    int8_kv = "avx512_vnni" in device.cpu_flags and model.head_dim in INT8_KV_HEAD_DIMS
    head = ("; the LM head int8 in groups of 32 for decode steps of up to 4 rows (float activations, "
            "float32 logits); " + ("the KV cache int8 with a float32 scale per head and token (read as integers "
                                   "with AVX512-VNNI), unless kv_cache_dtype says otherwise" if int8_kv else
                                   "the KV cache in the serving dtype (int8 is read as integers only with "
                                   f"AVX512-VNNI and head_dim {' or '.join(map(str, INT8_KV_HEAD_DIMS))})"))
    if model.published is not None:
        return QuantizationChoice(None, f"quantization auto on {where}: the checkpoint's own "
                                        f"{model.published.name} layers through the CPU kernels' integer GEMV{head}",
                                  int8_head=True, int8_kv=int8_kv)
    on_load = QuantizationConfig("int4", group_size=CPU_GROUP)
    return QuantizationChoice(on_load, f"quantization auto on {where}: linear layers int4 (groups of {CPU_GROUP}, "
                                       f"asymmetric) through the CPU kernels' integer GEMV{head}", int8_head=True,
                              int8_kv=int8_kv)
