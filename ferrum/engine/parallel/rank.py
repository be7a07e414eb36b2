"""The one set-up path of a tensor-parallel rank, rank 0's and every worker's alike: this rank's
device made current, its share of the host's threads where ranks share the CPU, torch.distributed
joined through the device's collective backend, then its `ModelRank` (its shard of the weights, its
part of the KV cache), built step for step like every other rank's, so that the collectives of the
memory profile and of CUDA graph capture meet in the same order everywhere.

`lead_ranks` is rank 0's side: it starts the workers (RankGroup), builds its own rank alongside
them and mirrors its runner's calls to them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ferrum.backends.device import Device
from ferrum.engine.model_rank import ModelRank
from ferrum.engine.parallel.distributed import join_distributed
from ferrum.engine.parallel.errors import TensorParallelError
from ferrum.engine.parallel.group import RankGroup
from ferrum.engine.parallel.mirror import MirroredRunner
from ferrum.engine.parallel.spec import RankSpec
from ferrum.engine.startup import StartupProgress
from ferrum.models.loader import WeightLoadReport


def build_rank(
    spec: RankSpec,
    rank: int,
    device: Device,
    report: Callable[[StartupProgress], None] = lambda _: None,
    agree_blocks: Callable[[int], int] = lambda n: n,
) -> ModelRank:
    """Rank `rank`'s ModelRank on `device` (its backend initialised in this process)."""
    device.runtime.make_current()  # NCCL binds to the current GPU; CUDA graphs capture there
    if device.threads:  # the ranks share the host's cores: each computes on its part of them
        torch.set_num_threads(max(1, device.threads // spec.size))
    tp = join_distributed(rank, spec.size, spec.dist_url, device, spec.config.kernels)
    return ModelRank(spec.config, device, spec.model_config, spec.files, spec.weights, spec.dtype,
                     spec.max_model_len, tp, report=report, agree_blocks=agree_blocks)


def lead_ranks(
    spec: RankSpec, device: Device, report: Callable[[StartupProgress], None]
) -> tuple[ModelRank, list[WeightLoadReport]]:
    """Rank 0: starts ranks 1..N-1, builds itself alongside them; returns its ModelRank, whose runner
    replays every call on the workers, and every rank's weight-load report (rank order)."""
    group = RankGroup.start(spec)
    try:
        rank = build_rank(spec, 0, device, report, group.agree_blocks)
        reports = group.wait_ready()
    except BaseException as exc:
        group.close()
        if group.failure is not None and not isinstance(exc, TensorParallelError):
            raise TensorParallelError(group.failure) from exc
        raise
    rank.runner = MirroredRunner(rank.runner, group)
    return rank, [rank.weight_load, *reports]
