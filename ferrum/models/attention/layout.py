"""`KVCacheLayout`: how the paged KV cache is laid out, shared by the block manager, both model
runners and the memory planner.

The cache of one layer is two tensors (k, v) of shape [num_slots, num_kv_heads, head_width], with
num_slots = num_blocks * block_size (or block-major, below). head_width is head_dim in a float dtype; an
int8 cache (kv_cache_dtype int8) holds each head's head_dim int8 values and their float32 scale, 4 bytes:
head_dim + 4 (block-major, the CPU kernels arrange each block's values and scales in tiles of their own:
ferrum/kernels/cpu/common.h). An fp8 cache (kv_cache_dtype fp8) holds e4m3 values, each k the key over its
layer's k scale, each v over its v scale (`Attention.kv_scale`): head_dim bytes. A sequence's token at
position p lives in slot

    block_table[p // block_size] * block_size + p % block_size

(the Triton kernels compute the same on the device: ferrum.kernels.paged_attention). The
layout belongs to the attention layers; the engine sizes, allocates and hands out blocks by it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ferrum.models.config import ModelConfig

KVCache = tuple[torch.Tensor, torch.Tensor]  # one layer's (k, v)

INT8_SCALE_BYTES = 4  # an int8 cache head's float32 scale, after its values
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # an fp8 cache's largest value, 448


@dataclass(frozen=True)
class KVCacheLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype  # what a slot holds: a float dtype, float8_e4m3fn, or int8 (values and a scale per head)
    block_size: int

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")

    @classmethod
    def of(cls, config: ModelConfig, dtype: torch.dtype, block_size: int) -> KVCacheLayout:
        return cls(config.num_layers, config.num_kv_heads, config.head_dim, dtype, block_size)

    @property
    def quantized(self) -> bool:
        """An int8 cache: each head's values with a float32 scale of their own."""
        return self.dtype == torch.int8

    @property
    def fp8(self) -> bool:
        """An fp8 (e4m3) cache: values over their layer's k or v scale."""
        return self.dtype == torch.float8_e4m3fn

    @property
    def head_width(self) -> int:
        """Elements of `dtype` one kv head of one slot takes."""
        return self.head_dim + INT8_SCALE_BYTES if self.quantized else self.head_dim

    @property
    def bytes_per_token(self) -> int:
        """k and v of every layer for one token."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_width * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def blocks_in(self, nbytes: int) -> int:
        """How many whole blocks `nbytes` holds (0 for none or less)."""
        return max(0, nbytes // self.bytes_per_block)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks one sequence of `num_tokens` tokens needs."""
        return -(-num_tokens // self.block_size)

    def slot(self, block_table: Sequence[int], position: int) -> int:
        size = self.block_size
        return block_table[position // size] * size + position % size

    def slots(self, block_table: Sequence[int], start: int, end: int) -> list[int]:
        """The slots of positions start .. end - 1."""
        size = self.block_size
        return [block_table[p // size] * size + p % size for p in range(start, end)]

    def allocate(self, num_blocks: int, device: torch.device, zeroed: bool = True,
                 block_major: bool = False) -> list[KVCache]:
        """k and v tensors of `num_blocks` blocks for every layer: zeroed, or left as allocated for a
        backend that never reads a slot before writing it (on the host its pages are then only
        backed as they are first written). `block_major`: [num_blocks, num_kv_heads, block_size,
        head_width], each kv head's slots of a block side by side, stored head-major (a transposed view
        of [num_kv_heads, num_blocks, block_size, head_width]: each kv head's blocks back to back, so that
        cpu_paged's work item reading one kv head over a sequence's consecutive blocks streams one run of
        memory, which the CPU's prefetchers follow); else [num_slots, num_kv_heads, head_width]."""
        make = torch.zeros if zeroed else torch.empty
        if block_major:
            shape = (self.num_kv_heads, num_blocks, self.block_size, self.head_width)
            return [(make(shape, dtype=self.dtype, device=device).transpose(0, 1),
                     make(shape, dtype=self.dtype, device=device).transpose(0, 1)) for _ in range(self.num_layers)]
        flat = (num_blocks * self.block_size, self.num_kv_heads, self.head_width)
        return [(make(flat, dtype=self.dtype, device=device), make(flat, dtype=self.dtype, device=device))
                for _ in range(self.num_layers)]
