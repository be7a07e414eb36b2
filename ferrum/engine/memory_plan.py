"""How many KV-cache blocks fit: the memory planner, for the host and for GPUs.

Host (the CPU; MPS, whose memory is the host's): `kv_cache_memory_gb` when set, else a fifth of the
memory available now, at most 2 GiB.

GPU: the budget is `gpu_memory_utilization` of the device's memory, everything counted: other
processes, this process's CUDA context, the weights, the activations of the widest step, the
sampler's widest temporaries, the decode CUDA graphs' memory pool and their static buffers, and
the allocator's cached blocks. All but the KV cache is measured, not estimated: with the weights
loaded, a scratch runner (a KV cache just large enough for one step) runs every eager step size
largest first, the sampler over `max_num_seqs` rows with every filter on, and captures the largest
decode graph; the peak of what the allocator held, less the scratch cache, is what serving needs
besides its KV cache. What the device reports in use beyond this process's allocator is the
context and other processes. The KV cache gets the rest of the budget.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from ferrum.backends.device import Device
from ferrum.engine.config import EngineConfig
from ferrum.models.attention.layout import KVCacheLayout

log = logging.getLogger(__name__)

HOST_KV_SHARE = 5  # a fifth of the available memory
HOST_KV_CAP_BYTES = 2 * 2**30


@dataclass(frozen=True)
class MemoryPlan:
    total_bytes: int
    budget_bytes: int  # what Ferrum may fill, everything counted (GPU); the KV cache's (host)
    weights_bytes: int  # held by this process before profiling: the weights
    peak_bytes: int  # the most held during profiling, the scratch KV cache left out (GPU)
    other_bytes: int  # in use outside this process's allocator: the context, other processes (GPU)
    kv_cache_bytes: int
    num_blocks: int

    def describe(self) -> str:
        gib = 2**30
        if self.peak_bytes == 0:
            return f"KV cache {self.kv_cache_bytes / gib:.2f} GiB ({self.num_blocks} blocks)"
        return (
            f"budget {self.budget_bytes / gib:.2f} of {self.total_bytes / gib:.2f} GiB: weights "
            f"{self.weights_bytes / gib:.2f} GiB, peak without the KV cache {self.peak_bytes / gib:.2f} GiB, "
            f"context and other processes {self.other_bytes / gib:.2f} GiB -> KV cache "
            f"{self.kv_cache_bytes / gib:.2f} GiB ({self.num_blocks} blocks)"
        )


def plan_host(device: Device, layout: KVCacheLayout, config: EngineConfig) -> MemoryPlan:
    """The KV cache on the host: the configured size, else a fifth of available memory (<= 2 GiB)."""
    if config.kv_cache_memory_gb is not None:
        kv_bytes = int(config.kv_cache_memory_gb * 2**30)
    else:
        kv_bytes = min(HOST_KV_CAP_BYTES, device.free_memory_bytes() // HOST_KV_SHARE)
    return MemoryPlan(device.total_memory_bytes, kv_bytes, 0, 0, 0, kv_bytes, layout.blocks_in(kv_bytes))


def plan_gpu(
    device: Device, layout: KVCacheLayout, config: EngineConfig, profile: Callable[[], int]
) -> MemoryPlan:
    """The KV cache of a GPU (see the module docstring). `profile()` runs the scratch step, graph
    and sampler with the weights loaded and returns the bytes of its scratch KV cache."""
    runtime = device.runtime
    runtime.synchronize()
    runtime.empty_cache()  # blocks cached from earlier work are not the model's: hand them back first
    weights = runtime.memory_held()
    runtime.reset_peak_memory()
    scratch = profile()
    runtime.synchronize()
    peak = runtime.peak_memory_held() - scratch
    runtime.empty_cache()
    free, total = runtime.memory_info()
    other = max(0, total - free - runtime.memory_held())
    budget = int(total * config.gpu_memory_utilization)
    if config.kv_cache_memory_gb is not None:
        kv_bytes = int(config.kv_cache_memory_gb * 2**30)
    else:
        kv_bytes = budget - other - peak
    plan = MemoryPlan(total, budget, weights, peak, other, max(kv_bytes, 0), layout.blocks_in(kv_bytes))
    log.info("GPU memory plan: %s", plan.describe())
    return plan


def in_use_bytes(device: Device) -> tuple[int, int]:
    """(used by every process, used by this process's allocator) on the device now."""
    free, total = device.runtime.memory_info()
    return total - free, device.runtime.memory_held()
