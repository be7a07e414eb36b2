"""triton_paged: attention over the paged KV cache with Triton kernels that read it directly
(ferrum.kernels.paged_attention, ferrum.kernels.rope), for GPUs.

A step is either all decodes (one new token per sequence: the grouped decode kernel, split over
the cache at small batches, run inside a CUDA graph) or anything else (whole prompts, prompt
chunks after cached tokens, and decodes mixed in: decodes through the decode kernel, the rest
through the prefill kernel), run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ferrum.backends.device import Device
from ferrum.kernels.config import KernelConfig
from ferrum.kernels.paged_attention import (
    PREFILL_BLOCK_M,
    decode_splits,
    paged_decode,
    paged_decode_rope,
    paged_prefill,
)
from ferrum.kernels.rope import rope_and_store
from ferrum.models.attention.layout import KVCache, KVCacheLayout
from ferrum.models.attention.packed_step import PackedStep, host_ints

if TYPE_CHECKING:
    from ferrum.models.attention.layer import Attention
    from ferrum.models.layers.rotary import RotaryEmbedding


@dataclass(frozen=True)
class PrefillTiles:
    """Which query tiles the prefill kernel runs: tile i covers new tokens
    tile_m[i] .. tile_m[i] + PREFILL_BLOCK_M of sequence tile_seq[i]."""

    tile_seq: torch.Tensor  # [num_tiles] int32
    tile_m: torch.Tensor  # [num_tiles] int32
    q_start: torch.Tensor  # [S] int32: row of each sequence's first new token in the packed batch
    q_len: torch.Tensor  # [S] int32: new tokens of each sequence
    past: torch.Tensor  # [S] int32: tokens already in the cache before this step


@dataclass(frozen=True)
class TritonAttentionBatch:
    positions: torch.Tensor  # [T] int64
    cos_table: torch.Tensor  # [max_positions, head_dim] float32 (the model's rotary tables)
    sin_table: torch.Tensor
    slot_mapping: torch.Tensor  # [T] int64: where each new token's k/v goes
    block_tables: torch.Tensor  # [S, max_blocks] int32
    page: int  # tokens per KV block
    context_lens: torch.Tensor | None  # [S] int32, decode steps: tokens in the cache incl. the new one
    tiles: PrefillTiles | None  # other steps
    decode_splits: int = 1  # decode steps: slices of each sequence's cache run in parallel
    num_decode: int | None = None  # eager steps: the first rows are decodes; None in a decode graph (all are)
    pdl: bool = False  # rope and attention kernels launched with programmatic dependent launch

    def attend(self, layer: Attention, qkv: torch.Tensor, cache: KVCache) -> torch.Tensor:
        q_norm, k_norm = layer.q_norm, layer.k_norm
        q = rope_and_store(
            qkv, self.positions, self.cos_table, self.sin_table, self.slot_mapping, cache[0], cache[1],
            layer.num_heads, layer.num_kv_heads, layer.head_dim,
            q_norm.weight if q_norm is not None else None, k_norm.weight if k_norm is not None else None,
            q_norm.eps if q_norm is not None else 1e-6, pdl=self.pdl, kv_scale=layer.kv_scale,
        )
        return self.attend_stored(layer, q, cache)

    def attend_decodes(self, layer: Attention, qkv: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """A decode graph's attention straight from the q/k/v projection, each row the one new token of its
        own sequence (the fused chain's steps, ferrum.models.fused_decode): the per-head norms, rope and the
        cache write inside the decode kernel (paged_decode_rope), one launch fewer than attend's."""
        assert self.num_decode is None and self.context_lens is not None
        q_norm, k_norm = layer.q_norm, layer.k_norm
        out = paged_decode_rope(
            qkv, layer.num_heads, self.positions, self.cos_table, self.sin_table, self.slot_mapping, cache[0],
            cache[1], self.block_tables, self.context_lens, self.page, layer.head_dim**-0.5, self.decode_splits,
            q_norm.weight if q_norm is not None else None, k_norm.weight if k_norm is not None else None,
            q_norm.eps if q_norm is not None else 1e-6, block_n=32 if self.decode_splits > 1 else 64,
            pdl=self.pdl, kv_scale=layer.kv_scale, window=layer.window,
        )
        return out.view(-1, layer.q_size)

    def attend_stored(self, layer: Attention, q: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Attention for q [T, H, D] already rotated, this step's k and v already in the cache."""
        scale = layer.head_dim**-0.5
        t = self.tiles
        if self.num_decode is None:  # a decode graph: every row a decode
            assert self.context_lens is not None
            out = paged_decode(
                q, cache[0], cache[1], self.block_tables, self.context_lens, self.page, scale, self.decode_splits,
                block_n=32 if self.decode_splits > 1 else 64,  # short slices: smaller steps (measured on an H100)
                pdl=self.pdl, kv_scale=layer.kv_scale, window=layer.window,
            )
            return out.view(-1, layer.q_size)
        out = torch.zeros_like(q)  # rows padding the step stay zero
        n = self.num_decode
        if n:
            assert self.context_lens is not None
            paged_decode(
                q[:n], cache[0], cache[1], self.block_tables[:n], self.context_lens, self.page, scale, 1, out=out[:n],
                pdl=self.pdl, kv_scale=layer.kv_scale, window=layer.window,
            )
        if t is not None:
            paged_prefill(
                q, cache[0], cache[1], self.block_tables, t.tile_seq, t.tile_m, t.q_start, t.q_len, t.past,
                self.page, scale, out=out, kv_scale=layer.kv_scale, window=layer.window,
            )
        return out.view(-1, layer.q_size)


class TritonPagedAttention:
    name = "triton_paged"

    def __init__(self, device: Device, layout: KVCacheLayout, kernels: KernelConfig) -> None:
        self.device = device.torch_device
        self.layout = layout
        self.num_sms = device.multi_processor_count
        self.max_splits = kernels.max_decode_splits
        self.pdl = kernels.pdl and device.pdl

    def step_inputs(self, step: PackedStep, rotary: RotaryEmbedding) -> TritonAttentionBatch:
        """An eager step's inputs (copied up without waiting for the device)."""
        dev = self.device
        seqs = step.sequences
        width = max(len(s.block_table) for s in seqs)
        tables = np.zeros((len(seqs), width), dtype=np.int32)
        tile_seq: list[int] = []
        tile_m: list[int] = []
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = s.block_table
            if i >= step.num_decode:
                for m0 in range(0, s.length, PREFILL_BLOCK_M):
                    tile_seq.append(i)
                    tile_m.append(m0)
        pad = step.num_rows - len(step.positions)
        positions = step.positions + [0] * pad
        slots = step.slots + [step.pad_slot] * pad

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32).to(dev, non_blocking=True)

        tiles = None
        if tile_seq:
            tiles = PrefillTiles(ints(tile_seq), ints(tile_m), ints([s.start for s in seqs]),
                                 ints([s.length for s in seqs]), ints([s.past for s in seqs]))
        return TritonAttentionBatch(
            positions=host_ints(positions).to(dev, non_blocking=True),
            cos_table=rotary.cos_table,
            sin_table=rotary.sin_table,
            slot_mapping=host_ints(slots).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(tables).to(dev, non_blocking=True),
            page=self.layout.block_size,
            context_lens=ints([s.past + 1 for s in seqs[: step.num_decode]]) if step.num_decode else None,
            tiles=tiles,
            num_decode=step.num_decode,
            pdl=self.pdl,
        )

    def decode_graph_inputs(self, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
                            context_lens: torch.Tensor, rotary: RotaryEmbedding) -> TritonAttentionBatch:
        """A decode graph's inputs: static device buffers of its batch size, refilled before each
        replay (every row a decode; splits of each cache to fill the GPU at small batches)."""
        size = positions.shape[0]
        return TritonAttentionBatch(
            positions=positions,
            cos_table=rotary.cos_table,
            sin_table=rotary.sin_table,
            slot_mapping=slots,
            block_tables=block_tables,
            page=self.layout.block_size,
            context_lens=context_lens,
            tiles=None,
            decode_splits=decode_splits(size, self.layout.num_kv_heads, self.num_sms, self.max_splits),
            pdl=self.pdl,
        )
