"""Attention over the paged KV cache, one backend chosen once per engine from its `Device`:

    torch_paged    plain PyTorch (SDPA over gathered cache slots): every device; the CPU's path
    triton_paged   Triton kernels that read the paged cache directly (ferrum.kernels): GPUs

A runner packs each step's tokens the same way whatever the backend (`PackedStep`: one token per
decoding sequence first, then the new tokens of each prefilling sequence, whole prompts or chunks
after cached tokens), and the backend turns that into its per-step attention inputs, which every
attention layer of the model then calls `attend` on. `KVCacheLayout` (layout.py) says where a
token's k and v live.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from ferrum.backends.device import Device
from ferrum.kernels.config import KernelConfig
from ferrum.models.attention.layout import KVCache, KVCacheLayout

__all__ = ["AttentionBackend", "KVCache", "KVCacheLayout", "PackedStep", "SequenceRows", "select_attention"]


@dataclass(frozen=True)
class SequenceRows:
    """One sequence's rows in a packed step."""

    start: int  # its first row
    length: int  # its new tokens this step
    past: int  # its tokens already in the cache
    block_table: Sequence[int]


@dataclass(frozen=True)
class PackedStep:
    """One step's tokens, packed: `num_decode` decoding sequences (a row each) first, then the
    prefilling ones. Rows past the real ones (to `num_rows`) pad the step: token 0 at position 0,
    written to `pad_slot` (a block nobody reads)."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]  # where each row's k and v are written
    sequences: tuple[SequenceRows, ...]
    num_decode: int
    num_rows: int  # real rows plus padding
    pad_slot: int


class AttentionBackend(Protocol):
    """Turns a packed step into the attention inputs the layers call `attend` on."""

    name: str

    def step_inputs(self, step: PackedStep, rotary: object) -> object:
        """The step's attention inputs (an object with `attend(layer, qkv, cache)`), on the device.
        `rotary`: the model's RotaryEmbedding."""
        ...


def select_attention(device: Device, layout: KVCacheLayout, kernels: KernelConfig) -> AttentionBackend:
    """triton_paged where Triton compiles for the device, torch_paged elsewhere."""
    if device.triton:
        from ferrum.models.attention.triton_paged import TritonPagedAttention

        return TritonPagedAttention(device, layout, kernels)
    from ferrum.models.attention.torch_paged import TorchPagedAttention

    return TorchPagedAttention(device, layout)
