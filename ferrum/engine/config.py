"""How the engine is sized and what it runs."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class EngineConfig:
    model: str  # path of an HF model folder
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "cpu"
    block_size: int = 16
    max_num_seqs: int | None = None  # default: 256 on GPUs, 64 on the CPU
    max_num_batched_tokens: int | None = None  # default: 8192 on GPUs, 1024 on the CPU
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    kv_cache_memory_gb: float | None = None  # default: a share of free memory, see kv_cache_budget
    gpu_memory_utilization: float = 0.9  # on GPUs: the share of device memory Ferrum may fill (weights + KV)
    enforce_eager: bool = False  # on GPUs: no CUDA graphs for decode
    enable_prefix_caching: bool = True  # reuse the KV of full blocks shared with earlier prompts
    # GPU: greedy decodes run back to back per host round trip while every running sequence decodes
    # greedily and no request waits for a free slot (tokens after a stop are dropped)
    num_scheduler_steps: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "num_scheduler_steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be at least 1, got {self.max_model_len}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be positive, got {self.kv_cache_memory_gb}")

    def with_device_defaults(self) -> EngineConfig:
        """This config with the unset batch limits filled in for its device: a GPU wants wide batches
        (vLLM's defaults), the CPU narrower ones."""
        gpu = not self.device.startswith("cpu")
        return replace(
            self,
            max_num_seqs=self.max_num_seqs or (256 if gpu else 64),
            max_num_batched_tokens=self.max_num_batched_tokens or (8192 if gpu else 1024),
        )
