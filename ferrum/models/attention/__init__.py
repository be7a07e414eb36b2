"""Attention over the paged KV cache, one backend chosen once per engine from its `Device`:

    torch_paged    plain PyTorch (SDPA over gathered cache slots): every device
    cpu_paged      the CPU's C++ kernels (ferrum.kernels.cpu), reading the paged cache in place: the CPU
    triton_paged   Triton kernels that read the paged cache directly (ferrum.kernels): GPUs

A runner packs each step's tokens the same way whatever the backend (`PackedStep`, packed_step.py:
one token per decoding sequence first, then the new tokens of each prefilling sequence, whole
prompts or chunks after cached tokens), and the backend turns that into its per-step attention
inputs, which every attention layer of the model (`Attention`, layer.py) then calls `attend` on.
`KVCacheLayout` (layout.py) says where a token's k and v live.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from ferrum.backends.device import Device
from ferrum.kernels.config import KernelConfig
from ferrum.models.attention.layout import KVCache, KVCacheLayout
from ferrum.models.attention.packed_step import PackedStep

if TYPE_CHECKING:
    from ferrum.models.attention.layer import AttentionInputs
    from ferrum.models.layers.rotary import RotaryEmbedding

__all__ = ["AttentionBackend", "KVCache", "KVCacheLayout", "select_attention"]


class AttentionBackend(Protocol):
    """Turns a packed step into the attention inputs the layers call `attend` on."""

    name: str

    def step_inputs(self, step: PackedStep, rotary: RotaryEmbedding) -> AttentionInputs:
        """The step's attention inputs, on the device, which every attention layer calls `attend` on."""
        ...


def select_attention(device: Device, layout: KVCacheLayout, kernels: KernelConfig, cpu_kernels: bool = False,
                     dtype: torch.dtype | None = None) -> AttentionBackend:
    """triton_paged where Triton compiles for the device, cpu_paged on the CPU once its kernels are
    loaded (`cpu_kernels`: ferrum.kernels.cpu.build), torch_paged elsewhere (computing in `dtype`, the
    serving dtype; default the cache's). An int8 cache (`layout.quantized`) is read by cpu_paged alone,
    an fp8 cache by triton_paged on a GPU with fp8 and by torch_paged: ValueError elsewhere."""
    cpu_paged = cpu_kernels and device.kind == "cpu" and not device.triton
    if layout.quantized and not cpu_paged:
        reason = "its C++ kernels are not loaded" if device.kind == "cpu" else f"it is not the CPU ({device.kind})"
        raise ValueError(f"kv_cache_dtype int8 is read only by the CPU kernels' attention (cpu_paged), and this "
                         f"engine's device {device.torch_device} cannot run it: {reason}. Use kv_cache_dtype auto")
    if layout.fp8 and (cpu_paged or (device.triton and not device.fp8)):
        reason = ("the CPU kernels' attention reads bf16/float32 or int8 caches (kv_cache_dtype int8 is the CPU's "
                  "8-bit cache)" if cpu_paged else f"{device.description} has no fp8 (compute capability 8.9+)")
        raise ValueError(f"kv_cache_dtype fp8 cannot be read on {device.torch_device}: {reason}. Use kv_cache_dtype "
                         f"auto")
    if device.triton:
        from ferrum.models.attention.triton_paged import TritonPagedAttention

        return TritonPagedAttention(device, layout, kernels)
    if cpu_paged:
        from ferrum.models.attention.cpu_paged import CpuPagedAttention

        return CpuPagedAttention(device, layout)
    from ferrum.models.attention.torch_paged import TorchPagedAttention

    return TorchPagedAttention(device, layout, dtype)
