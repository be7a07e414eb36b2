"""Joining and leaving torch.distributed as one rank of a tensor-parallel group, through the
collective backend its `Device` names (NCCL between GPUs, gloo on the CPU); on GPUs the sums of up to
`KernelConfig.one_shot_all_reduce_kb` go through the peer-mapped one-shot kernel where every rank can
have it (ferrum.engine.parallel.peer_all_reduce: the same choice on every rank)."""

from __future__ import annotations

import datetime
from collections.abc import Callable

import torch

from ferrum.backends.device import Device
from ferrum.engine.parallel.errors import TensorParallelError
from ferrum.kernels.config import KernelConfig
from ferrum.models.layers.parallel import TensorParallel


def join_distributed(
    rank: int, size: int, dist_url: str, device: Device, kernels: KernelConfig
) -> TensorParallel:
    """Joins torch.distributed at `dist_url` as `rank` of `size` (every rank at the same time).
    Under NCCL the group is bound to this rank's GPU, which must be current."""
    import torch.distributed as dist

    if device.collective is None:
        raise TensorParallelError(f"{device.name} has no torch.distributed backend to sum across ranks with")
    nccl = device.collective == "nccl"
    dist.init_process_group(device.collective, init_method=dist_url, rank=rank, world_size=size,
                            timeout=datetime.timedelta(minutes=30),
                            device_id=device.torch_device if nccl else None)
    group = dist.group.WORLD
    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    one_shot_bytes = kernels.one_shot_all_reduce_kb * 1024
    if nccl and one_shot_bytes > 0:
        from ferrum.engine.parallel.peer_all_reduce import peer_all_reduce

        pdl = kernels.pdl and device.pdl
        reduce = peer_all_reduce(group, device, one_shot_bytes, pdl, kernels.one_shot_push)
    return TensorParallel(rank, size, group, device.collective, reduce)


def leave_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
