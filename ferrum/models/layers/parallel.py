"""Tensor parallelism: one rank's share of a decoder and the collectives that join the shares.

    TensorParallel       a rank's place in the group (rank, size) and its two collectives:
                         all_reduce (sum) and all_gather along the last dim; single() is one rank.
                         The sum goes through `reduce` where start-up chose one (on GPUs that reach
                         each other's memory: ferrum.engine.parallel.peer_all_reduce), else torch.distributed
    ShardPlan            what rank r of N holds of a model: its heads, KV heads (split, or
                         replicated where N exceeds them), MLP columns and vocabulary rows; the
                         sharded ModelConfig the rank builds its modules from; and, for each
                         checkpoint tensor, the slice of it the rank reads
    RowParallelLinear    a linear whose input features are split: partial products summed across
                         ranks, then the bias (o_proj, down_proj)
    VocabParallelEmbedding / ParallelLMHead   vocabulary rows split across ranks

Column-parallel projections (the fused q/k/v and gate/up) need no module of their own: each rank's
nn.Linear simply has fewer output rows, filled from the matching rows of the checkpoint. One
all-reduce follows attention (in o_proj) and one the MLP (in down_proj); the embedding adds one and
the LM head gathers the vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ferrum.models.config import ModelConfig


class ShardingError(ValueError):
    """The model cannot be split over the requested number of ranks; says why."""


@dataclass
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: Any = None  # the torch.distributed process group of the model's collectives
    backend: str = "gloo"  # its backend: nccl (CUDA) or gloo (CPU)
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None  # sums in place; None: torch.distributed

    @classmethod
    def single(cls) -> TensorParallel:
        return cls()

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks, in place."""
        if self.size > 1:
            if self.reduce is not None:
                return self.reduce(x)
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` side by side along the last dim, rank order."""
        if self.size == 1:
            return x
        import torch.distributed as dist

        x = x.contiguous()
        if self.backend == "nccl":  # one buffer: capturable in a CUDA graph
            out = torch.empty((self.size, *x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.group)
            return out.movedim(0, -2).reshape(*x.shape[:-1], self.size * x.shape[-1])
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)


@dataclass(frozen=True)
class Shard:
    """The part of a checkpoint tensor one rank reads: [start, end) along `dim`."""

    dim: int
    start: int
    end: int


@dataclass(frozen=True)
class ShardPlan:
    config: ModelConfig  # the whole model's
    rank: int = 0
    size: int = 1

    @classmethod
    def check(cls, config: ModelConfig, size: int) -> None:
        """ShardingError naming the first count that does not divide by `size`."""
        if size < 1:
            raise ShardingError(f"tensor_parallel_size must be at least 1, got {size}")
        if size == 1:
            return
        counts = [("attention heads", config.num_heads), ("intermediate_size", config.intermediate_size)]
        if config.moe is not None:  # each expert's intermediate dimension is split, like a dense MLP's
            counts.append(("experts' moe_intermediate_size", config.moe.intermediate_size))
            if config.moe.shared_intermediate_size:
                counts.append(("shared_expert_intermediate_size", config.moe.shared_intermediate_size))
        for what, count in counts:
            if count % size:
                raise ShardingError(f"tensor_parallel_size={size} does not divide the model's {count} {what}")
        kv = config.num_kv_heads
        if (kv % size if kv >= size else size % kv):
            raise ShardingError(
                f"tensor_parallel_size={size} and the model's {kv} KV heads: one must divide the other "
                "(KV heads are split across ranks, or each replicated on size/heads ranks)"
            )

    @property
    def sharded(self) -> bool:
        return self.size > 1

    @property
    def heads(self) -> int:
        return self.config.num_heads // self.size

    @property
    def kv_heads(self) -> int:
        return max(1, self.config.num_kv_heads // self.size)

    @property
    def first_kv_head(self) -> int:
        # rank r's query heads are [r*heads, (r+1)*heads); their KV heads (grouped-query attention)
        # start at r*kv/size, which is also the replicated head when there are fewer KV heads than ranks
        return self.rank * self.config.num_kv_heads // self.size

    @property
    def intermediate(self) -> int:
        return self.config.intermediate_size // self.size

    @property
    def vocab_rows(self) -> int:
        """Vocabulary rows per rank (the last rank's tail beyond the vocabulary stays unused)."""
        return -(-self.config.vocab_size // self.size)

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_rows

    def rank_config(self) -> ModelConfig:
        """The config this rank builds its attention, MLP and KV cache from."""
        if not self.sharded:
            return self.config
        moe = self.config.moe
        if moe is not None:
            moe = replace(moe, intermediate_size=moe.intermediate_size // self.size,
                          shared_intermediate_size=moe.shared_intermediate_size // self.size)
        return replace(self.config, num_heads=self.heads, num_kv_heads=self.kv_heads,
                       intermediate_size=self.intermediate, moe=moe)

    def checkpoint_shard(self, projection: str, kind: str, intermediate: int | None = None) -> Shard | None:
        """The slice of checkpoint tensor `projection` (q_proj, k_proj, v_proj, o_proj, gate_proj,
        up_proj, down_proj, embed_tokens, lm_head; `kind` weight or bias) this rank reads; None: all.
        `intermediate`: a gated MLP's whole intermediate size where it is not the dense one's (an
        expert's, a shared expert's)."""
        if not self.sharded:
            return None
        hd, r = self.config.head_dim, self.rank
        if intermediate is not None and projection in ("gate_proj", "up_proj", "down_proj"):
            part = intermediate // self.size
            return Shard(0 if projection != "down_proj" else 1, r * part, (r + 1) * part)
        if projection == "q_proj":
            return Shard(0, r * self.heads * hd, (r + 1) * self.heads * hd)
        if projection in ("k_proj", "v_proj"):
            first = self.first_kv_head
            return Shard(0, first * hd, (first + self.kv_heads) * hd)
        if projection in ("gate_proj", "up_proj"):
            return Shard(0, r * self.intermediate, (r + 1) * self.intermediate)
        if projection in ("o_proj", "down_proj"):  # row-parallel: input columns; a bias is whole
            width = self.heads * hd if projection == "o_proj" else self.intermediate
            return Shard(1, r * width, (r + 1) * width) if kind == "weight" else None
        if projection in ("embed_tokens", "lm_head"):
            return Shard(0, self.vocab_start, min(self.config.vocab_size, self.vocab_start + self.vocab_rows))
        return None


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r @ W_r^T, then + bias: the input features are split."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """The embedding of this rank's vocabulary rows; ids elsewhere give zeros, summed across ranks."""

    def __init__(self, rows: int, start: int, dim: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.start, self.rows, self.tp = start, rows, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(nn.Module):
    """Logits of this rank's vocabulary rows, gathered into the whole vocabulary on every rank."""

    def __init__(self, rows: int, dim: int, vocab_size: int, tp: TensorParallel) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, dim))
        self.vocab_size, self.tp = vocab_size, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(F.linear(x, self.weight))[..., : self.vocab_size]
