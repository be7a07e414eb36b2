"""The torch MPS backend: the Apple-silicon GPU through Metal, one device named "mps".

What does not change while the process runs is probed once by `probe_mps_device` into an
`MpsDeviceFacts`; live numbers and device work go through a `TorchMpsRuntime`. Tests build an
`MPSBackend` from stub facts and a stub runtime. This path has not been run on a Mac: only its
selection and bookkeeping are tested, with stubs, on Linux.

Dtypes: fp32 and fp16 always; bf16 when a tiny bf16 matmul on the device gives the right answer
(macOS 14 and later). No fp8, no int8. Attention: torch SDPA only ("sdpa"); no flash kernel, no
Triton, no CUDA graphs. No quantized weights: none of the quantized linears has been run on MPS.

Memory is unified with the host. Total is Metal's recommended working-set size
(torch.mps.recommended_max_memory()); free is that minus what this process's Metal driver has
allocated (torch.mps.driver_allocated_memory()), since Metal does not report other processes' use.
`memory_in_use_bytes()` (and so `status()`) is that driver-allocated figure: live tensors and
torch's cached blocks alike. `shutdown` ends with torch.mps.empty_cache().
"""

from __future__ import annotations

import platform
from dataclasses import dataclass

import torch

from ferrum.backends.accelerator import AcceleratorBackend
from ferrum.backends.base import ComputeBackend
from ferrum.backends.capabilities import BackendCapabilities
from ferrum.backends.cpu import limits_from_memory
from ferrum.backends.device import Device, DeviceRuntime

MPS_MEMORY_ALIGNMENT = 16_384  # bytes; the page size of Apple silicon
BASE_DTYPES: frozenset[torch.dtype] = frozenset({torch.float32, torch.float16})


@dataclass(frozen=True)
class MpsDeviceFacts:
    """What the MPS device is, as probed once (or, in tests, as declared)."""

    bf16_supported: bool
    macos_version: str  # "" when unknown


def bf16_matmul_works_on_mps() -> bool:
    """Whether a tiny bf16 matmul runs on the MPS device and gives the right answer."""
    try:
        ones = torch.ones(4, 4, dtype=torch.bfloat16, device="mps")
        return bool(((ones @ ones).to(device="cpu", dtype=torch.float32) == 4.0).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def probe_mps_device() -> MpsDeviceFacts:
    """The facts of this machine's MPS device, from torch.mps and the OS."""
    return MpsDeviceFacts(bf16_supported=bf16_matmul_works_on_mps(), macos_version=platform.mac_ver()[0])


def mps_capabilities(facts: MpsDeviceFacts, free_bytes: int, total_bytes: int) -> BackendCapabilities:
    """The capabilities of the MPS device, with `free_bytes` of `total_bytes` free now; limits follow
    the CPU backend's formula (ferrum.backends.cpu) on `total_bytes`."""
    dtypes = (BASE_DTYPES | {torch.bfloat16}) if facts.bf16_supported else BASE_DTYPES
    max_batch_size, max_sequence_length = limits_from_memory(total_bytes)
    return BackendCapabilities(
        supported_dtypes=dtypes,
        devices=("mps",),
        max_batch_size=max_batch_size,
        max_sequence_length=max_sequence_length,
        supports_fp16=True,
        supports_bf16=facts.bf16_supported,
        supports_int8=False,
        flash_attention=False,
        paged_attention=True,  # the engine pages its KV cache on every backend
        cuda_graphs=False,
        memory_alignment=MPS_MEMORY_ALIGNMENT,
        total_memory_bytes=total_bytes,
        free_memory_bytes=min(max(free_bytes, 0), total_bytes),
        quantization=frozenset(),
        quantization_needs={method: "quantized weights are not run on MPS" for method in ("int8", "int4", "fp8")},
        extras={"attention_kernels": ("sdpa",), "macos_version": facts.macos_version},
    )


class TorchMpsRuntime:
    """The live torch.mps calls (a DeviceRuntime). Metal keeps no peak of its own: the peak is
    this object's highest reading of `memory_held` since `reset_peak_memory`."""

    def __init__(self) -> None:
        self._peak = 0

    def memory_info(self) -> tuple[int, int]:
        total = torch.mps.recommended_max_memory()
        return max(total - torch.mps.driver_allocated_memory(), 0), total

    def memory_held(self) -> int:
        held = torch.mps.driver_allocated_memory()
        self._peak = max(self._peak, held)
        return held

    def memory_allocated(self) -> int:
        return torch.mps.current_allocated_memory()

    def peak_memory_held(self) -> int:
        return max(self._peak, self.memory_held())

    def reset_peak_memory(self) -> None:
        self._peak = 0

    def synchronize(self) -> None:
        torch.mps.synchronize()

    def empty_cache(self) -> None:
        torch.mps.empty_cache()

    def make_current(self) -> None:
        pass


class MPSBackend(AcceleratorBackend):
    """The Apple GPU through torch. `facts` as probe_mps_device gives them; `runtime` defaults to the
    real torch.mps calls (tests pass a stub)."""

    def __init__(self, facts: MpsDeviceFacts, runtime: DeviceRuntime | None = None) -> None:
        super().__init__(runtime if runtime is not None else TorchMpsRuntime())
        self._facts = facts

    @property
    def facts(self) -> MpsDeviceFacts:
        return self._facts

    @property
    def name(self) -> str:
        return "mps"

    @property
    def kind(self) -> str:
        return "mps"

    def capabilities(self) -> BackendCapabilities:
        free_bytes, total_bytes = self._runtime.memory_info()
        return mps_capabilities(self._facts, free_bytes, total_bytes)

    def version(self) -> str:
        macos = f", macOS {self._facts.macos_version}" if self._facts.macos_version else ""
        return f"torch {torch.__version__}, MPS{macos}"

    def _make_device(self, device: str) -> Device:
        capabilities = self.capabilities()
        macos = f", macOS {self._facts.macos_version}" if self._facts.macos_version else ""
        return Device(
            name="mps",
            kind="mps",
            description=f"Apple GPU (Metal{macos})",
            dtypes=capabilities.supported_dtypes,
            preferred_dtype=torch.bfloat16 if self._facts.bf16_supported else torch.float16,
            total_memory_bytes=capabilities.total_memory_bytes,
            runtime=self._runtime,
        )


def create_backends() -> list[ComputeBackend]:
    """The MPS backend when this machine has the device, else nothing."""
    if not torch.backends.mps.is_available():
        return []
    return [MPSBackend(probe_mps_device())]
