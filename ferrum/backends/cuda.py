"""The torch CUDA backend: one backend per visible GPU, each named after its device ("cuda:0", ...).

What does not change while the process runs (name, compute capability, memory size, which attention
kernels torch and Triton offer) is probed once per GPU by `probe_cuda_device` into a
`CudaDeviceFacts`; live numbers and device work (free memory, memory held, synchronize, emptying
the allocator's cache) go through a `TorchCudaRuntime`. Tests build a `CUDABackend` from stub facts
and a stub runtime, so all of this except the probes themselves runs on a machine without a GPU.

What the compute capability (cc) decides:

    fp32, fp16             always
    bf16                   cc >= 8.0 (native bf16 units; older GPUs only emulate it)
    fp8 (e4m3fn, e5m2)     cc >= 8.9
    "flash" attention      cc >= 8.0, torch built with FlashAttention and its SDPA backend enabled

int8 is not offered: torch has no plain int8 matmul on CUDA and the engine has no int8 path.
Attention kernels besides "flash": "sdpa" (always), "triton_paged" (the engine's Triton
paged-attention kernels; Triton imports) and "flex" (torch's flex_attention imports, and Triton,
which it compiles to on a GPU, does too).

Memory: capabilities() reads free and total from cudaMemGetInfo, which counts every process on the
GPU. `memory_in_use_bytes()` (and so `status()`) is torch.cuda.memory_reserved(device): what this
process's caching allocator holds on the GPU, live tensors and cached blocks alike; it leaves out
the CUDA context itself. Release hooks, garbage collection and torch.cuda.empty_cache() (run by
`shutdown`) bring it back down.

Probing free memory creates a CUDA context on the GPU (a few hundred MiB); set CUDA_VISIBLE_DEVICES
to keep Ferrum off GPUs it must not touch.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass

import torch

from ferrum.backends.accelerator import AcceleratorBackend
from ferrum.backends.base import ComputeBackend, DeviceRuntime
from ferrum.backends.capabilities import BackendCapabilities
from ferrum.backends.cpu import limits_from_memory

logger = logging.getLogger(__name__)

BF16_MIN_CC = (8, 0)
FLASH_MIN_CC = (8, 0)
FP8_MIN_CC = (8, 9)
CUDA_MEMORY_ALIGNMENT = 256  # bytes; what cudaMalloc guarantees
BASE_DTYPES: frozenset[torch.dtype] = frozenset({torch.float32, torch.float16})
FP8_DTYPES: frozenset[torch.dtype] = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})


@dataclass(frozen=True)
class CudaDeviceFacts:
    """What one GPU is, as probed once (or, in tests, as declared)."""

    index: int
    name: str
    compute_capability: tuple[int, int]
    total_memory_bytes: int
    multi_processor_count: int
    flash_attention_built: bool  # torch was built with FlashAttention for SDPA
    flash_sdp_enabled: bool  # and its SDPA backend is switched on
    triton_available: bool
    flex_attention_available: bool
    cuda_version: str

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"device index must not be negative, got {self.index}")

    @property
    def device(self) -> str:
        return f"cuda:{self.index}"


@functools.cache
def module_imports(module_name: str) -> bool:
    """Whether `module_name` can be imported here (any error counts as no)."""
    try:
        importlib.import_module(module_name)
    except Exception:
        return False
    return True


def probe_cuda_device(index: int) -> CudaDeviceFacts:
    """The facts of GPU `index` (as torch numbers the visible GPUs), from torch.cuda."""
    properties = torch.cuda.get_device_properties(index)
    return CudaDeviceFacts(
        index=index,
        name=properties.name,
        compute_capability=(properties.major, properties.minor),
        total_memory_bytes=properties.total_memory,
        multi_processor_count=properties.multi_processor_count,
        flash_attention_built=torch.backends.cuda.is_flash_attention_available(),
        flash_sdp_enabled=torch.backends.cuda.flash_sdp_enabled(),
        triton_available=module_imports("triton"),
        flex_attention_available=module_imports("torch.nn.attention.flex_attention"),
        cuda_version=torch.version.cuda or "unknown",
    )


def cuda_dtypes(compute_capability: tuple[int, int]) -> frozenset[torch.dtype]:
    """The dtypes a GPU of this compute capability computes natively."""
    dtypes = set(BASE_DTYPES)
    if compute_capability >= BF16_MIN_CC:
        dtypes.add(torch.bfloat16)
    if compute_capability >= FP8_MIN_CC:
        dtypes |= FP8_DTYPES
    return frozenset(dtypes)


def cuda_attention_kernels(facts: CudaDeviceFacts) -> tuple[str, ...]:
    """The attention kernels usable on this GPU, by the rules in this module's docstring."""
    kernels = ["sdpa"]
    if facts.compute_capability >= FLASH_MIN_CC and facts.flash_attention_built and facts.flash_sdp_enabled:
        kernels.append("flash")
    if facts.triton_available:
        kernels.append("triton_paged")
    if facts.flex_attention_available and facts.triton_available:
        kernels.append("flex")
    return tuple(kernels)


def cuda_capabilities(facts: CudaDeviceFacts, free_bytes: int, total_bytes: int) -> BackendCapabilities:
    """The capabilities of the GPU `facts` describes, with `free_bytes` of `total_bytes` free now.

    max_batch_size and max_sequence_length follow the CPU backend's formula (ferrum.backends.cpu)
    on the GPU's total memory.
    """
    dtypes = cuda_dtypes(facts.compute_capability)
    kernels = cuda_attention_kernels(facts)
    max_batch_size, max_sequence_length = limits_from_memory(total_bytes)
    return BackendCapabilities(
        supported_dtypes=dtypes,
        devices=(facts.device,),
        max_batch_size=max_batch_size,
        max_sequence_length=max_sequence_length,
        supports_fp16=torch.float16 in dtypes,
        supports_bf16=torch.bfloat16 in dtypes,
        supports_int8=torch.int8 in dtypes,
        flash_attention="flash" in kernels,
        paged_attention=True,  # the engine pages its KV cache on every backend
        cuda_graphs=True,
        memory_alignment=CUDA_MEMORY_ALIGNMENT,
        total_memory_bytes=total_bytes,
        free_memory_bytes=min(max(free_bytes, 0), total_bytes),
        extras={
            "device_name": facts.name,
            "compute_capability": facts.compute_capability,
            "multi_processor_count": facts.multi_processor_count,
            "attention_kernels": kernels,
            "fp8": torch.float8_e4m3fn in dtypes,
            "cuda_version": facts.cuda_version,
        },
    )


class TorchCudaRuntime:
    """The live torch.cuda calls for GPU `index` (a DeviceRuntime)."""

    def __init__(self, index: int) -> None:
        self._index = index

    def memory_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self._index)
        return free, total

    def memory_held(self) -> int:
        return torch.cuda.memory_reserved(self._index)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self._index)

    def empty_cache(self) -> None:
        with torch.cuda.device(self._index):
            torch.cuda.empty_cache()


class CUDABackend(AcceleratorBackend):
    """One GPU through torch. `facts` as probe_cuda_device gives them; `runtime` defaults to the real
    torch.cuda calls for that GPU (tests pass a stub)."""

    def __init__(self, facts: CudaDeviceFacts, runtime: DeviceRuntime | None = None) -> None:
        super().__init__(runtime if runtime is not None else TorchCudaRuntime(facts.index))
        self._facts = facts

    @property
    def facts(self) -> CudaDeviceFacts:
        return self._facts

    @property
    def name(self) -> str:
        return self._facts.device

    @property
    def kind(self) -> str:
        return "cuda"

    def capabilities(self) -> BackendCapabilities:
        free_bytes, total_bytes = self._runtime.memory_info()
        return cuda_capabilities(self._facts, free_bytes, total_bytes)

    def version(self) -> str:
        return f"torch {torch.__version__}, CUDA {self._facts.cuda_version}"


def create_backends() -> list[ComputeBackend]:
    """One CUDABackend per visible GPU; a GPU whose probe fails is logged and left out."""
    backends: list[ComputeBackend] = []
    for index in range(torch.cuda.device_count()):
        try:
            backends.append(CUDABackend(probe_cuda_device(index)))
        except RuntimeError:
            logger.exception("could not probe cuda:%d; leaving it out", index)
    return backends
