"""The all-reduce of a tensor-parallel group's GPUs, chosen once at start-up.

    PeerAllReduce   small messages (a decode step's hidden states: 8 KB a row for an 8B model) go
                    through one Triton kernel over peer-mapped buffers (ferrum.kernels.all_reduce:
                    4.3 us a sum in a CUDA graph on 2 x H200, NCCL 11.8 us with NVLink multicast
                    off: benchmarks/gpu.md);
                    larger ones, and anything not contiguous, through torch.distributed (NCCL)
    peer_all_reduce the PeerAllReduce for a group, or None (with the reason logged) where the fast
                    path cannot be had: a rank's GPU cannot reach another's memory (`Device.peers`),
                    torch lacks symmetric memory, this process already set it up for a group of
                    that name (torch keeps the first one's store), or its self-test fails; every
                    rank takes the same decision (agreed through the group before and after)

The buffers are torch's symmetric memory (torch.distributed._symmetric_memory, CUDA backend,
without multicast: the CUDA backend sets TORCH_SYMM_MEM_DISABLE_MULTICAST=1 for every process it
initialises, ferrum.backends.cuda), mapped into every rank's address space; the kernel needs only
their addresses.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ferrum.backends.device import Device

log = logging.getLogger(__name__)


class PeerAllReduce:
    """Sums a tensor over the group's ranks: the one-shot kernel up to `max_bytes`, NCCL past it."""

    def __init__(self, group: Any, device: torch.device, max_bytes: int, pdl: bool = False, push: bool = True) -> None:
        import torch.distributed as dist
        import torch.distributed._symmetric_memory as symm_mem

        from ferrum.kernels import all_reduce as kernel

        self.group, self.device, self.max_bytes, self.pdl = group, device, max_bytes, pdl
        self.push = push  # write to the peers' buffers (one NVLink trip) rather than read theirs (two)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        max_programs = kernel.programs(max_bytes // 2)  # the most programs: 2-byte elements
        flag_bytes = max_programs * self.world * 4
        data_bytes = kernel.buffer_bytes(max_bytes, self.world)
        self._memory = symm_mem.empty(data_bytes + flag_bytes, dtype=torch.uint8, device=device)
        self._memory[data_bytes:].zero_()
        handle = _rendezvous(self._memory, group)
        pointers = [int(p) for p in handle.buffer_ptrs]
        self._buffers = torch.tensor(pointers, dtype=torch.int64, device=device)
        self._flags = torch.tensor([p + data_bytes for p in pointers], dtype=torch.int64, device=device)
        self._epochs = torch.zeros(max_programs, dtype=torch.int32, device=device)
        self._handle = handle
        self._kernel = kernel
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every rank's flags are zero before any rank's first call

    def fits(self, x: torch.Tensor) -> bool:
        return x.is_contiguous() and x.numel() * x.element_size() <= self.max_bytes and x.dtype in (
            torch.bfloat16, torch.float16, torch.float32)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Sums `x` over the ranks, in place."""
        if not self.fits(x):
            import torch.distributed as dist

            dist.all_reduce(x, group=self.group)
            return x
        return self._kernel.one_shot_sum_(x, self._buffers, self._flags, self._epochs, self.max_bytes,
                                          self.rank, self.world, self.pdl, self.push)


_MAPPED_GROUPS: set[str] = set()  # group names this process set up peer memory under


def _rendezvous(memory: torch.Tensor, group: Any) -> Any:
    """Maps every rank's `memory` into this process (collective)."""
    import torch.distributed._symmetric_memory as symm_mem

    _MAPPED_GROUPS.add(group.group_name)
    return symm_mem.rendezvous(memory, group.group_name)


def peer_all_reduce(group: Any, device: Device, max_bytes: int, pdl: bool = False,
                    push: bool = True) -> PeerAllReduce | None:
    """The fast path for this rank of `group` (NCCL, one GPU a process), or None on every rank."""
    if max_bytes <= 0:
        return None
    # the set-up's allocations, mappings and the self-test's Triton launches go to the current
    # device (Triton takes no device): make it this rank's, whatever the calling thread had current
    with torch.cuda.device(device.torch_device):
        return _set_up(group, device, max_bytes, pdl, push)


def _set_up(group: Any, device: Device, max_bytes: int, pdl: bool, push: bool) -> PeerAllReduce | None:
    import torch.distributed as dist

    reason = _unavailable(group, device)
    where = device.torch_device
    if _agreed(reason is None, group, where) is False:
        log.info("tensor parallel all-reduce: NCCL for every message (%s)", reason or "another rank cannot peer-map")
        return None
    fast: PeerAllReduce | None = None
    try:
        fast = PeerAllReduce(group, where, max_bytes, pdl, push)
        reason = _self_test(fast, dist.get_rank(group), dist.get_world_size(group))
    except Exception as exc:  # noqa: BLE001 - any failure means the slow path, on every rank
        reason = f"{type(exc).__name__}: {exc}"
    if not _agreed(reason is None, group, where):
        log.warning("tensor parallel all-reduce: NCCL for every message (peer-mapped set-up failed: %s)",
                    reason or "on another rank")
        return None
    log.info("tensor parallel all-reduce: one-shot (%s) over peer-mapped buffers up to %d KB, NCCL above",
             "push" if push else "pull", max_bytes // 1024)
    return fast


def _unavailable(group: Any, device: Device) -> str | None:
    """Why this rank cannot have the fast path, or None (one collective, on every rank)."""
    import torch.distributed as dist

    where = device.torch_device
    mine = torch.tensor([where.index], dtype=torch.int32, device=where)
    every = torch.empty(dist.get_world_size(group), dtype=torch.int32, device=where)
    dist.all_gather_into_tensor(every, mine, group=group)
    devices = [f"{where.type}:{index}" for index in every.tolist()]
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401 - only whether it is there
    except ImportError:
        return "this torch has no symmetric memory"
    if group.group_name in _MAPPED_GROUPS:
        # torch keeps a group name's store for the life of the process: a later group of the same
        # name (a second engine in one process) would meet the first one's store
        return f"this process already set up peer memory for a group named {group.group_name!r}"
    for other in devices:
        if other != device.name and other not in device.peers:
            return f"{device.name} cannot reach {other}'s memory"
    return None


def _agreed(ok: bool, group: Any, device: torch.device) -> bool:
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def _self_test(fast: PeerAllReduce, rank: int, world: int) -> str | None:
    """A few calls of known sums at the sizes decode uses; None when every one is exact."""
    for numel in (1, 100, 4096, fast.max_bytes // 2):  # each variant Triton compiles, before any capture
        x = torch.full((numel,), float(rank + 1), dtype=torch.bfloat16, device=fast.device)
        x[::7] = -(rank + 1)
        want = torch.full_like(x, world * (world + 1) / 2)
        want[::7] = -world * (world + 1) / 2
        got = fast(x)
        if not torch.equal(got, want):
            return f"self-test of {numel} elements gave a wrong sum"
    return None
