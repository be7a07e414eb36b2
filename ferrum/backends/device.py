"""`Device`: the one source of hardware facts for everything after backend selection.

The selected `ComputeBackend` hands the engine one `Device` (`backend.device()`): the torch device
and every probed fact the engine, its runners, the KV-cache planner, the weight loader and the
kernels need, frozen, plus live queries of memory through the device's `DeviceRuntime`. Outside
`ferrum.backends`, no code finds out hardware facts for itself: it asks the `Device`.

    device.torch_device                    torch.device("cuda:0")
    device.kind, .name, .description       "cuda", "cuda:0", "NVIDIA H100 80GB HBM3"
    device.dtypes, .preferred_dtype        what it computes natively; what `dtype: auto` serves in
    device.compute_capability, .multi_processor_count, .total_memory_bytes
    device.triton, .cuda_graphs, .pdl, .fp8, .packed_bf16_linears
    device.dedicated_memory                memory of its own (a discrete GPU), not the host's
    device.peers                           the devices whose memory it maps directly ("cuda:1", ...)
    device.collective                      the torch.distributed backend its ranks sum through: nccl, gloo
    device.threads                         host threads its work runs on (the CPU's cores; 0 on a GPU)
    device.free_memory_bytes()             live: free now (every process counted)
    device.runtime                         live memory statistics, synchronize, empty the allocator cache
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch

from ferrum.dtypes import dtype_names

DeviceKind = Literal["cpu", "cuda", "mps"]
Collective = Literal["nccl", "gloo"]


class DeviceRuntime(Protocol):
    """The live calls made on one device, behind one object so that tests can stand in for the
    hardware. Implemented over torch.cuda (ferrum.backends.cuda), torch.mps (ferrum.backends.mps)
    and the host (ferrum.backends.cpu)."""

    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the device now, every process counted."""
        ...

    def memory_held(self) -> int:
        """Bytes this process holds on the device through torch's allocator, cached blocks included."""
        ...

    def memory_allocated(self) -> int:
        """Bytes of live tensors this process has on the device."""
        ...

    def peak_memory_held(self) -> int:
        """The most `memory_held` has been since the last `reset_peak_memory`."""
        ...

    def reset_peak_memory(self) -> None:
        """Start a new peak for `peak_memory_held`."""
        ...

    def synchronize(self) -> None:
        """Block until all work queued on the device has finished."""
        ...

    def empty_cache(self) -> None:
        """Hand the allocator's unused cached blocks back to the driver."""
        ...

    def make_current(self) -> None:
        """Make this device the calling thread's current one: where kernels that take no device
        (Triton's) launch. A no-op where there is one device of its kind."""
        ...


@dataclass(frozen=True)
class Device:
    """One device as its backend probed it. Facts are frozen; `runtime` answers live questions."""

    name: str  # "cpu", "cuda:0", "mps": a torch device string
    kind: DeviceKind
    description: str  # "NVIDIA H100 80GB HBM3", "AMD EPYC (2 cores)"
    dtypes: frozenset[torch.dtype]  # computed natively
    preferred_dtype: torch.dtype  # what `dtype: auto` serves a float32 or bfloat16 checkpoint in
    total_memory_bytes: int
    compute_capability: tuple[int, int] | None = None  # CUDA only
    multi_processor_count: int = 1  # streaming multiprocessors of a GPU; usable cores of a CPU
    cpu_flags: tuple[str, ...] = ()  # the CPU features that matter to its kernels (avx2, amx_bf16, ...)
    triton: bool = False  # Triton kernels compile for it
    cuda_graphs: bool = False
    pdl: bool = False  # programmatic dependent launch (compute capability 9.0 and later)
    fp8: bool = False  # native fp8 matrix units (compute capability 8.9 and later)
    packed_bf16_linears: bool = False  # a CPU with bf16 matmul units: oneDNN-prepacked linears pay off
    cache_bytes: int = 0  # the last-level cache a CPU's usable cores can count on (0: not known); weights larger
    # stream from memory each token
    # memory of its own, not the host's (a discrete GPU): the engine sizes its KV cache there by
    # profiling against gpu_memory_utilization; a device without (the CPU, MPS) from available memory
    dedicated_memory: bool = False
    peers: tuple[str, ...] = ()  # other devices whose memory this one can map directly (CUDA peer access)
    collective: Collective | None = None  # torch.distributed's backend for tensors here; None: no collectives
    threads: int = 0  # host threads its work runs on (the CPU: its usable cores); 0: its own cores compute
    runtime: DeviceRuntime = field(default=None, compare=False, hash=False, repr=False)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.kind not in ("cpu", "cuda", "mps"):
            raise ValueError(f"device kind must be cpu, cuda or mps, got {self.kind!r}")
        object.__setattr__(self, "dtypes", frozenset(self.dtypes))
        if self.preferred_dtype not in self.dtypes:
            raise ValueError(
                f"{self.name}: preferred dtype {self.preferred_dtype} is not among its dtypes "
                f"({dtype_names(self.dtypes)})"
            )

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.name)

    @property
    def is_accelerator(self) -> bool:
        """A GPU (cuda or mps): the engine runs in a process of its own there by default."""
        return self.kind != "cpu"

    def free_memory_bytes(self) -> int:
        """Free memory of the device now (a GPU: every process counted; the CPU: what the OS says is
        available, within any cgroup limit)."""
        return self.runtime.memory_info()[0]

    def summary(self) -> str:
        """One line for logs: name, description, memory and the facts the engine acts on."""
        facts = [f"{self.total_memory_bytes / 2**30:.1f} GiB", f"dtypes {dtype_names(self.dtypes)}"]
        if self.compute_capability is not None:
            facts.append(f"cc {self.compute_capability[0]}.{self.compute_capability[1]}, "
                         f"{self.multi_processor_count} SMs")
        else:
            facts.append(f"{self.multi_processor_count} cores")
        facts += [name for name, on in (("triton", self.triton), ("cuda graphs", self.cuda_graphs),
                                         ("pdl", self.pdl), ("fp8", self.fp8),
                                         ("packed bf16 linears", self.packed_bf16_linears)) if on]
        if self.peers:
            facts.append(f"peers {', '.join(self.peers)}")
        return f"{self.name} ({self.description}): " + "; ".join(facts)
