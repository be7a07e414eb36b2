"""cpu_paged: attention over the paged KV cache through the CPU's C++ kernels (ferrum.kernels.cpu).

Per layer, two calls: `rope_write` rotates q and k in place in the fused qkv projection's output and
writes k and v to their cache slots; `paged_attention` reads each sequence's keys and values where
they lie, block by block through its block table, for decodes and prefills alike (a prefill's
queries see the cached tokens before them and their own, causally). With a cache narrower than the
activations (int8, or bfloat16 under float32) a prompt prefilled from its first token reads its keys and
values from the projection as computed, so it is scored as a cache of the activations' dtype would score
it; every other step (decodes, chunks after cached tokens, speculative verify steps) reads every key from
the cache, rounded (on AVX2, the rows of sequences whose rows are all generated tokens with 7-bit queries and
value weights, `generated`; prompt rows with 16-bit ones, so that a prompt read from the prefix cache
scores as when prefilled). Nothing is gathered or copied
per step: a step's inputs are its new tokens' positions and slots, and per sequence its block table,
context length and first query row. A layer with a sliding window reads only the keys inside it (the
blocks before it may have been given back: their table entries are never read).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from ferrum.backends.device import Device
from ferrum.models.attention.layout import KVCache, KVCacheLayout
from ferrum.models.attention.packed_step import PackedStep, host_ints
from ferrum.models.layers.rotary import RotaryEmbedding

if TYPE_CHECKING:
    from ferrum.models.attention.layer import Attention


@dataclass(frozen=True)
class CpuAttentionBatch:
    """One step's inputs to the CPU kernels."""

    positions: torch.Tensor  # [T] int64
    slot_mapping: torch.Tensor  # [T] int64: where each row's k and v are written
    block_tables: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32: tokens in the cache after this step's write
    query_starts: torch.Tensor  # [S + 1] int32: each sequence's first row (the rows are packed by sequence)
    rotary: RotaryEmbedding
    block_size: int
    fresh: bool  # a prompt starts in this step (an int8 cache: its keys are read as computed)
    generated: torch.Tensor | None = None  # [S] bool: the sequences whose rows are all generated tokens (None: none)

    def attend(self, layer: Attention, qkv: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """qkv: [T, q_size + 2 kv_size] -> attention output [T, q_size]; writes k, v to the cache."""
        heads, kv_heads, dim = layer.num_heads, layer.num_kv_heads, layer.head_dim
        rows = qkv.shape[0]
        if layer.q_norm is not None and layer.k_norm is not None:  # per-head norms before rope (Qwen3)
            q = qkv[:, : layer.q_size].view(rows, heads, dim)
            k = qkv[:, layer.q_size : layer.q_size + layer.kv_size].view(rows, kv_heads, dim)
            q.copy_(layer.q_norm.norm(q))
            k.copy_(layer.k_norm.norm(k))
        torch.ops.ferrum_cpu.rope_write(qkv, self.positions, self.rotary.cos_table, self.rotary.sin_table,
                                        cache[0], cache[1], self.slot_mapping, heads, kv_heads)
        out = torch.empty(rows, heads, dim, dtype=qkv.dtype)
        step_k: torch.Tensor | None = None
        step_v: torch.Tensor | None = None
        if self.fresh and cache[0].dtype != qkv.dtype:  # a fresh prompt's keys and values read as computed
            step_k = qkv[:, layer.q_size : layer.q_size + layer.kv_size].view(rows, kv_heads, dim)
            step_v = qkv[:, layer.q_size + layer.kv_size :].view(rows, kv_heads, dim)
        torch.ops.ferrum_cpu.paged_attention(out, qkv[:, : layer.q_size].view(rows, heads, dim), cache[0], cache[1],
                                             self.block_tables, self.seq_lens, self.query_starts, self.block_size,
                                             dim**-0.5, layer.window or 0, step_k, step_v, self.generated)
        return out.view(rows, layer.q_size)


class CpuPagedAttention:
    name = "cpu_paged"

    def __init__(self, device: Device, layout: KVCacheLayout) -> None:
        self.device = device.torch_device
        self.layout = layout

    def step_inputs(self, step: PackedStep, rotary: RotaryEmbedding) -> CpuAttentionBatch:
        seqs = step.sequences
        tables = np.zeros((len(seqs), max(len(s.block_table) for s in seqs)), dtype=np.int32)
        for i, s in enumerate(seqs):
            tables[i, : len(s.block_table)] = s.block_table
        lens = [s.past + s.length for s in seqs]
        starts = [s.start for s in seqs] + [seqs[-1].start + seqs[-1].length]
        return CpuAttentionBatch(
            positions=host_ints(step.positions),
            slot_mapping=host_ints(step.slots),
            block_tables=torch.from_numpy(tables),
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            query_starts=torch.tensor(starts, dtype=torch.int32),
            rotary=rotary,
            block_size=self.layout.block_size,
            fresh=any(s.past == 0 for s in seqs),
            generated=torch.tensor([s.generated for s in seqs]) if any(s.generated for s in seqs) else None,
        )
