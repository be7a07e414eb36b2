"""The torch CUDA backend: one backend per visible GPU, each named after its device ("cuda:0", ...).

Two kinds of probing, so that only the process that runs the engine holds a CUDA context:
- the registry's (`create_backends`): through NVML (ferrum.backends.nvml), without a CUDA context:
  name, compute capability, memory, plus what the torch build and Triton offer. Capabilities and
  selection need nothing more. Without NVML (no nvidia-ml-py, no driver library), torch.cuda
  probes instead, which creates a context on each GPU probed.
- the engine's (`CUDABackend.device()`): torch.cuda, in the process that will run on the GPU
  (the context is needed there anyway): multiprocessor count, peer access and the rest of the `Device`.

Live numbers and device work (free memory, memory held, synchronize, emptying the allocator's
cache) go through a `TorchCudaRuntime`: free memory from NVML until this process has initialised
CUDA, from cudaMemGetInfo after. Tests build a `CUDABackend` from stub facts and a stub runtime,
so all of this except the probes themselves runs on a machine without a GPU.

What the compute capability (cc) decides:

    fp32, fp16             always
    bf16                   cc >= 8.0 (native bf16 units; older GPUs only emulate it); preferred then
    fp8 (e4m3fn, e5m2)     cc >= 8.9
    "flash" attention      cc >= 8.0, torch built with FlashAttention and its SDPA backend enabled
    programmatic dependent launch (pdl)   cc >= 9.0, with Triton
    quantized weights      int8 and int4 always (Triton kernels, torch ops for large batches); fp8 at cc >= 8.9

int8 is not offered as a dtype: torch has no plain int8 matmul on CUDA and the engine has no int8 path.
Attention kernels besides "flash": "sdpa" (always), "triton_paged" (the engine's Triton
paged-attention kernels; Triton imports) and "flex" (torch's flex_attention imports, and Triton,
which it compiles to on a GPU, does too).

Memory: capabilities() reports free and total as the GPU has them, every process counted.
`memory_in_use_bytes()` (and so `status()`) is torch.cuda.memory_reserved(device): what this
process's caching allocator holds on the GPU, live tensors and cached blocks alike; it leaves out
the CUDA context itself. Release hooks, garbage collection and torch.cuda.empty_cache() (run by
`shutdown`) bring it back down. Set CUDA_VISIBLE_DEVICES to keep Ferrum off GPUs it must not touch.
"""

from __future__ import annotations

import functools
import importlib
import logging
import os
from dataclasses import dataclass, replace
from typing import TypedDict

import torch

from ferrum.backends.accelerator import AcceleratorBackend
from ferrum.backends.base import ComputeBackend
from ferrum.backends.capabilities import BackendCapabilities
from ferrum.backends.cpu import limits_from_memory
from ferrum.backends.device import Device, DeviceRuntime
from ferrum.backends.nvml import Nvml, NvmlGpu

logger = logging.getLogger(__name__)

BF16_MIN_CC = (8, 0)
FLASH_MIN_CC = (8, 0)
FP8_MIN_CC = (8, 9)
PDL_MIN_CC = (9, 0)
CUDA_MEMORY_ALIGNMENT = 256  # bytes; what cudaMalloc guarantees
BASE_DTYPES: frozenset[torch.dtype] = frozenset({torch.float32, torch.float16})
FP8_DTYPES: frozenset[torch.dtype] = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})


@dataclass(frozen=True)
class CudaDeviceFacts:
    """What one GPU is, as probed once (or, in tests, as declared). `multi_processor_count` is None
    when NVML probed it (no CUDA context yet): `CUDABackend.device()` probes it with torch, and
    `integrated` and `peers` with it."""

    index: int
    name: str
    compute_capability: tuple[int, int]
    total_memory_bytes: int
    flash_attention_built: bool  # torch was built with FlashAttention for SDPA
    flash_sdp_enabled: bool  # and its SDPA backend is switched on
    triton_available: bool
    flex_attention_available: bool
    cuda_version: str
    multi_processor_count: int | None = None
    nccl_available: bool = False  # torch.distributed with NCCL (tensor-parallel ranks sum through it)
    integrated: bool = False  # shares the host's memory (a Jetson); probed with torch
    peers: tuple[int, ...] = ()  # visible GPUs whose memory this one can map (peer access); probed with torch

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


class SoftwareFacts(TypedDict):
    """The CudaDeviceFacts that the torch build and the installed packages decide, whatever the GPU."""

    flash_attention_built: bool
    flash_sdp_enabled: bool
    triton_available: bool
    flex_attention_available: bool
    cuda_version: str
    nccl_available: bool


def _software_facts() -> SoftwareFacts:
    """What the torch build and the installed packages offer, whatever the GPU (no CUDA context)."""
    import torch.distributed as dist

    return {
        "flash_attention_built": torch.backends.cuda.is_flash_attention_available(),
        "flash_sdp_enabled": torch.backends.cuda.flash_sdp_enabled(),
        "triton_available": module_imports("triton"),
        "flex_attention_available": module_imports("torch.nn.attention.flex_attention"),
        "cuda_version": torch.version.cuda or "unknown",
        "nccl_available": dist.is_available() and dist.is_nccl_available(),
    }


def probe_peers(index: int) -> tuple[int, ...]:
    """The visible GPUs whose memory GPU `index` can map directly (CUDA peer access)."""
    return tuple(other for other in range(torch.cuda.device_count())
                 if other != index and torch.cuda.can_device_access_peer(index, other))


def probe_cuda_device(index: int) -> CudaDeviceFacts:
    """The facts of GPU `index` (as torch numbers the visible GPUs), from torch.cuda: this creates a
    CUDA context on it."""
    properties = torch.cuda.get_device_properties(index)
    return CudaDeviceFacts(
        index=index,
        name=properties.name,
        compute_capability=(properties.major, properties.minor),
        total_memory_bytes=properties.total_memory,
        multi_processor_count=properties.multi_processor_count,
        integrated=bool(properties.is_integrated),
        peers=probe_peers(index),
        **_software_facts(),
    )


def nvml_facts(gpu: NvmlGpu) -> CudaDeviceFacts:
    """The facts of one GPU from NVML and the torch build, without a CUDA context."""
    return CudaDeviceFacts(
        index=gpu.ordinal,
        name=gpu.name,
        compute_capability=gpu.compute_capability,
        total_memory_bytes=gpu.total_memory_bytes,
        **_software_facts(),
    )


def cuda_dtypes(compute_capability: tuple[int, int]) -> frozenset[torch.dtype]:
    """The dtypes a GPU of this compute capability computes natively."""
    dtypes = set(BASE_DTYPES)
    if compute_capability >= BF16_MIN_CC:
        dtypes.add(torch.bfloat16)
    if compute_capability >= FP8_MIN_CC:
        dtypes |= FP8_DTYPES
    return frozenset(dtypes)


def cuda_quantization(facts: CudaDeviceFacts) -> tuple[frozenset[str], dict[str, str]]:
    """The weight quantization methods this GPU runs, and what it lacks for the others."""
    cc = facts.compute_capability
    if cc >= FP8_MIN_CC:
        return frozenset({"int8", "int4", "fp8"}), {}
    need = (f"fp8 needs compute capability {FP8_MIN_CC[0]}.{FP8_MIN_CC[1]}; "
            f"{facts.device} ({facts.name}) has {cc[0]}.{cc[1]}")
    return frozenset({"int8", "int4"}), {"fp8": need}


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


def cuda_capabilities(
    facts: CudaDeviceFacts, free_bytes: int, total_bytes: int, span: int = 1
) -> BackendCapabilities:
    """The capabilities of the GPU `facts` describes, with `free_bytes` of `total_bytes` free now;
    `span`: the visible GPUs from this one on, which a tensor-parallel model can be split across.

    max_batch_size and max_sequence_length follow the CPU backend's formula (ferrum.backends.cpu)
    on the GPU's total memory.
    """
    dtypes = cuda_dtypes(facts.compute_capability)
    kernels = cuda_attention_kernels(facts)
    max_batch_size, max_sequence_length = limits_from_memory(total_bytes)
    quantization, quantization_needs = cuda_quantization(facts)
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
        supports_tensor_parallelism=True,  # NCCL between the ranks' GPUs
        max_tensor_parallel_size=max(1, span),
        quantization=quantization,
        quantization_needs=quantization_needs,
        extras={
            "device_name": facts.name,
            "compute_capability": facts.compute_capability,
            "attention_kernels": kernels,
            "fp8": torch.float8_e4m3fn in dtypes,
            "cuda_version": facts.cuda_version,
        },
    )


def cuda_device(facts: CudaDeviceFacts, runtime: DeviceRuntime) -> Device:
    """The `Device` of a GPU whose facts include its multiprocessor count."""
    assert facts.multi_processor_count is not None, "probe the GPU with torch first"
    cc = facts.compute_capability
    dtypes = cuda_dtypes(cc)
    return Device(
        name=facts.device,
        kind="cuda",
        description=facts.name,
        dtypes=dtypes,
        preferred_dtype=torch.bfloat16 if torch.bfloat16 in dtypes else torch.float16,
        total_memory_bytes=facts.total_memory_bytes,
        compute_capability=cc,
        multi_processor_count=facts.multi_processor_count,
        triton=facts.triton_available,
        cuda_graphs=True,
        pdl=facts.triton_available and cc >= PDL_MIN_CC,
        fp8=torch.float8_e4m3fn in dtypes,
        dedicated_memory=not facts.integrated,
        peers=tuple(f"cuda:{other}" for other in facts.peers),
        collective="nccl" if facts.nccl_available else None,
        runtime=runtime,
    )


class TorchCudaRuntime:
    """The live calls for GPU `index` (a DeviceRuntime). None of them creates a CUDA context: until
    this process has initialised CUDA (its engine opened the device), free memory comes from NVML
    (`nvml`, `handle`), this process holds nothing and has nothing to wait for; after, everything
    comes from torch.cuda (cudaMemGetInfo for free memory)."""

    def __init__(self, index: int, nvml: Nvml | None = None, handle: object = None) -> None:
        self._index = index
        self._nvml = nvml
        self._handle = handle

    def memory_info(self) -> tuple[int, int]:
        if self._nvml is not None and not torch.cuda.is_initialized():
            return self._nvml.memory_info(self._handle)
        free, total = torch.cuda.mem_get_info(self._index)
        return free, total

    def memory_held(self) -> int:
        return torch.cuda.memory_reserved(self._index) if torch.cuda.is_initialized() else 0

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self._index) if torch.cuda.is_initialized() else 0

    def peak_memory_held(self) -> int:
        return torch.cuda.max_memory_reserved(self._index) if torch.cuda.is_initialized() else 0

    def reset_peak_memory(self) -> None:
        if torch.cuda.is_initialized():
            torch.cuda.reset_peak_memory_stats(self._index)

    def synchronize(self) -> None:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize(self._index)

    def make_current(self) -> None:
        torch.cuda.set_device(self._index)

    def empty_cache(self) -> None:
        if not torch.cuda.is_initialized():
            return
        # cuBLAS keeps a workspace per stream it ran on (a graph capture stream's too) until told
        clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear_workspaces is not None:
            clear_workspaces()
        with torch.cuda.device(self._index):
            torch.cuda.empty_cache()


class CUDABackend(AcceleratorBackend):
    """One GPU through torch. `facts` as nvml_facts or probe_cuda_device give them; `runtime`
    defaults to the real torch.cuda calls for that GPU (tests pass a stub)."""

    def __init__(self, facts: CudaDeviceFacts, runtime: DeviceRuntime | None = None, span: int = 1) -> None:
        """`span`: the visible GPUs from this one on (tensor parallelism can split a model across them)."""
        super().__init__(runtime if runtime is not None else TorchCudaRuntime(facts.index))
        self._facts = facts
        self._span = span

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
        return cuda_capabilities(self._facts, free_bytes, total_bytes, self._span)

    def version(self) -> str:
        return f"torch {torch.__version__}, CUDA {self._facts.cuda_version}"

    def _make_device(self, device: str) -> Device:
        """Probes the multiprocessor count with torch when NVML probed the rest (a CUDA context on
        the GPU from here on: call it in the process that runs the engine)."""
        if self._facts.multi_processor_count is None:
            probed = probe_cuda_device(self._facts.index)
            self._facts = replace(self._facts, multi_processor_count=probed.multi_processor_count,
                                  name=probed.name, total_memory_bytes=probed.total_memory_bytes,
                                  integrated=probed.integrated, peers=probed.peers)
        return cuda_device(self._facts, self._runtime)

    async def _prepare_device(self, device: str) -> None:
        """Also sets this process up for the GPU: torch's symmetric memory (the peer-mapped buffers of
        the tensor-parallel all-reduce, ferrum.engine.parallel.peer_all_reduce) never maps NVLink
        multicast (TORCH_SYMM_MEM_DISABLE_MULTICAST=1 unless set). Every process that runs on the GPU
        initializes its backend before it allocates any (the engine's, each tensor-parallel worker)."""
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        await super()._prepare_device(device)


def create_backends() -> list[ComputeBackend]:
    """One CUDABackend per visible GPU, probed through NVML (no CUDA context), or through torch.cuda
    where NVML is missing; a GPU whose probe fails is logged and left out. None with a CPU build
    of torch."""
    if torch.version.cuda is None:
        return []
    nvml = Nvml.load()
    if nvml is not None:
        try:
            gpus = nvml.visible_gpus()
        except Exception:
            logger.exception("NVML could not list the GPUs; probing them through torch.cuda instead")
        else:
            return [CUDABackend(nvml_facts(gpu), TorchCudaRuntime(gpu.ordinal, nvml, gpu.handle), span=len(gpus) - i)
                    for i, gpu in enumerate(gpus)]
    if not torch.cuda.is_available():
        return []
    backends: list[ComputeBackend] = []
    count = torch.cuda.device_count()
    for index in range(count):
        try:
            backends.append(CUDABackend(probe_cuda_device(index), span=count - index))
        except RuntimeError:
            logger.exception("could not probe cuda:%d; leaving it out", index)
    return backends
