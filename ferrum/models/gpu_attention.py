"""Attention inputs of one step on the GPU: the Triton kernels read the paged cache directly.

A step is either all decodes (one new token per sequence: the grouped decode kernel, run inside
a CUDA graph) or anything else (whole prompts, prompt chunks after cached tokens, and decodes
mixed in: the prefill kernel, which handles a decode as a one-token chunk).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ferrum.models import triton_kernels
from ferrum.models.attention import KVCache

if TYPE_CHECKING:
    from ferrum.models.llama import Attention


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

    def attend(self, layer: Attention, qkv: torch.Tensor, cache: KVCache) -> torch.Tensor:
        q_norm, k_norm = layer.q_norm, layer.k_norm
        q = triton_kernels.rope_and_store(
            qkv, self.positions, self.cos_table, self.sin_table, self.slot_mapping, cache[0], cache[1],
            layer.num_heads, layer.num_kv_heads, layer.head_dim,
            q_norm.weight if q_norm is not None else None, k_norm.weight if k_norm is not None else None,
            q_norm.eps if q_norm is not None else 1e-6,
        )
        return self.attend_stored(layer, q, cache)

    def attend_stored(self, layer: Attention, q: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """Attention for q [T, H, D] already rotated, this step's k and v already in the cache."""
        scale = layer.head_dim**-0.5
        t = self.tiles
        if self.num_decode is None:  # a decode graph: every row a decode
            assert self.context_lens is not None
            out = triton_kernels.paged_decode(
                q, cache[0], cache[1], self.block_tables, self.context_lens, self.page, scale, self.decode_splits,
                block_n=32 if self.decode_splits > 1 else 64,  # short slices: smaller steps (measured on an H100)
            )
            return out.view(-1, layer.q_size)
        out = torch.zeros_like(q)  # rows padding the step stay zero
        n = self.num_decode
        if n:
            assert self.context_lens is not None
            triton_kernels.paged_decode(
                q[:n], cache[0], cache[1], self.block_tables[:n], self.context_lens, self.page, scale, 1, out=out[:n]
            )
        if t is not None:
            triton_kernels.paged_prefill(
                q, cache[0], cache[1], self.block_tables, t.tile_seq, t.tile_m, t.q_start, t.q_len, t.past,
                self.page, scale, out=out,
            )
        return out.view(-1, layer.q_size)
