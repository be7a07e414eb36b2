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


def select_attention(device: Device, layout: KVCacheLayout, kernels: KernelConfig,
                     cpu_kernels: bool = False) -> AttentionBackend:
    """triton_paged where Triton compiles for the device, cpu_paged on the CPU once its kernels are
    loaded (`cpu_kernels`: ferrum.kernels.cpu.build), torch_paged elsewhere. An int8 cache
    (`layout.quantized`) is read by cpu_paged alone: ValueError elsewhere."""
    cpu_paged = cpu_kernels and device.kind == "cpu" and not device.triton
    if layout.quantized and not cpu_paged:
        reason = "its C++ kernels are not loaded" if device.kind == "cpu" else f"it is not the CPU ({device.kind})"
        raise ValueError(f"kv_cache_dtype int8 is read only by the CPU kernels' attention (cpu_paged), and this "
                         f"engine's device {device.torch_device} cannot run it: {reason}. Use kv_cache_dtype auto")
    if device.triton:
        from ferrum.models.attention.triton_paged import TritonPagedAttention

        return TritonPagedAttention(device, layout, kernels)
    if cpu_paged:
        from ferrum.models.attention.cpu_paged import CpuPagedAttention

        return CpuPagedAttention(device, layout)
    from ferrum.models.attention.torch_paged import TorchPagedAttention

    return TorchPagedAttention(device, layout)
