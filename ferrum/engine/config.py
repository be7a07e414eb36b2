"""How the engine is sized and what it runs: `EngineConfig` (the `engine:` section of the YAML).

The model and the device are not part of it: the engine is given a `Device` by the selected
backend and the model's files (`ferrum.weights.locations.model_files.ModelFiles`); what depends on the
device (batch limits, the dtype `auto` means) is resolved against that `Device` here, once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from ferrum.backends.device import Device
from ferrum.dtypes import serving_dtype
from ferrum.engine.speculative.config import SpeculativeConfig
from ferrum.kernels.config import KernelConfig
from ferrum.weights.quantization.scheme import QuantizationConfig

FP8_KV_NAMES = ("fp8", "fp8_e4m3")  # kv_cache_dtype names of an e4m3 cache (vLLM takes both)

@dataclass(frozen=True)
class EngineConfig:
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (and fp32, bf16, fp16)
    block_size: int = 16
    max_num_seqs: int | None = None  # default: 256 on GPUs, 64 on the CPU
    max_num_batched_tokens: int | None = None  # default: 8192 on GPUs, 1024 on the CPU
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    kv_cache_memory_gb: float | None = None  # default: a share of free memory (ferrum.engine.memory_plan)
    gpu_memory_utilization: float = 0.9  # GPUs: the share of device memory Ferrum may fill, all of it counted
    enforce_eager: bool = False  # GPUs: no CUDA graphs for decode
    enable_prefix_caching: bool = True  # reuse the KV of full blocks shared with earlier prompts
    # GPUs: greedy decodes run back to back per host round trip while every running sequence decodes
    # greedily and no request waits for a free slot (tokens after a stop are dropped)
    num_scheduler_steps: int = 16
    # ranks the model is split across (tensor parallelism): one process and device per rank
    tensor_parallel_size: int = 1
    kernels: KernelConfig = field(default_factory=KernelConfig)  # the Triton kernels' and the CPU kernels' settings
    # CPU: torch's compute threads (None: the cores the process may use, its affinity and cgroup quota counted)
    threads: int | None = None
    # the linear layers' weights quantized as they load (None: served in the dtype)
    quantization: QuantizationConfig | None = None
    # what the KV cache holds: auto (the serving dtype) | bfloat16 | float16 | float32 | int8 (each head's
    # values with a float32 scale: half a bfloat16 cache's bytes; read by the CPU kernels' attention only) |
    # fp8 (e4m3 with a scale per layer for k and one for v: half the bytes; GPUs with fp8, and the plain
    # torch attention; "fp8_e4m3" is the same)
    kv_cache_dtype: str = "auto"
    # speculative decoding (ferrum.engine.speculative): {method: ngram, num_speculative_tokens: k,
    # prompt_lookup_min, prompt_lookup_max, disable_by_batch_size, adaptive}, as a mapping or its JSON text
    # (--speculative-config); None: off
    speculative_config: SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        if self.dtype != "auto":
            serving_dtype(self.dtype)  # ValueError naming the valid ones
        if self.kv_cache_dtype not in ("auto", "int8", *FP8_KV_NAMES):
            try:
                serving_dtype(self.kv_cache_dtype)
            except ValueError:
                raise ValueError(f"kv_cache_dtype must be auto, int8, fp8 (fp8_e4m3) or a serving dtype (float32, "
                                 f"bfloat16, float16), got {self.kv_cache_dtype!r}") from None
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_scheduler_steps",
                     "tensor_parallel_size", "threads"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be positive, got {self.kv_cache_memory_gb}")
        if not isinstance(self.kernels, KernelConfig):
            object.__setattr__(self, "kernels", KernelConfig.from_mapping(self.kernels))
        object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if isinstance(self.quantization, Mapping):  # e.g. create_engine(..., quantization={"method": "int4"})
            object.__setattr__(self, "quantization", QuantizationConfig(**self.quantization))

    @classmethod
    def from_mapping(cls, raw: dict[str, Any]) -> EngineConfig:
        """From the YAML `engine:` section (without `engine_process`, which is the server's)."""
        values = dict(raw)
        if "kernels" in values:
            values["kernels"] = KernelConfig.from_mapping(values["kernels"])
        return cls(**values)

    def for_device(self, device: Device) -> EngineConfig:
        """This config with the unset batch limits filled in for `device`: a GPU wants wide batches
        (vLLM's defaults), the CPU narrower ones."""
        gpu = device.is_accelerator
        return replace(
            self,
            max_num_seqs=self.max_num_seqs or (256 if gpu else 64),
            max_num_batched_tokens=self.max_num_batched_tokens or (8192 if gpu else 1024),
        )

    def kv_dtype(self, serving: torch.dtype) -> torch.dtype:
        """What the KV cache holds for a model served in `serving`."""
        if self.kv_cache_dtype == "auto":
            return serving
        if self.kv_cache_dtype in FP8_KV_NAMES:
            return torch.float8_e4m3fn
        return torch.int8 if self.kv_cache_dtype == "int8" else serving_dtype(self.kv_cache_dtype)

    @property
    def seqs_per_step(self) -> int:
        """max_num_seqs, as `for_device` filled it in."""
        return _filled(self.max_num_seqs, "max_num_seqs")

    @property
    def tokens_per_step(self) -> int:
        """max_num_batched_tokens, as `for_device` filled it in."""
        return _filled(self.max_num_batched_tokens, "max_num_batched_tokens")

    def serving_dtype(self, checkpoint_dtype: torch.dtype, device: Device) -> torch.dtype:
        """The dtype the weights and activations are kept in. `auto`: on the CPU the device's
        preferred dtype (bf16 where it has bf16 matmul units, else float32); on a GPU the
        checkpoint's own half-precision dtype where the device computes it, else the device's
        preferred one (bf16, or fp16 before compute capability 8.0)."""
        if self.dtype != "auto":
            return serving_dtype(self.dtype)
        half = checkpoint_dtype in (torch.float16, torch.bfloat16)
        if device.is_accelerator and half and checkpoint_dtype in device.dtypes:
            return checkpoint_dtype
        return device.preferred_dtype


def _filled(value: int | None, name: str) -> int:
    if value is None:
        raise ValueError(f"{name} is not resolved yet: use EngineConfig.for_device(device)")
    return value
