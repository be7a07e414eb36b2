"""NVIDIA GPUs as NVML sees them (nvidia-ml-py), without a CUDA context.

Probing a GPU through torch.cuda (its properties, its free memory) creates a CUDA context on it,
a few hundred MiB that the process then holds for as long as it lives. The API server only picks a
backend, and the engine may run in a process of its own: so the registry probes GPUs through NVML,
and only the process that runs the engine opens a CUDA context (`CUDABackend.device()`).

CUDA numbers the GPUs this process may use by CUDA_VISIBLE_DEVICES (indices, or UUIDs and their
prefixes, as CUDA takes them; read when probing, never at import): `visible_gpus` maps each CUDA
ordinal to its NVML handle. With the variable unset, CUDA's order is assumed to be NVML's (PCI bus
order, which is CUDA's too with CUDA_DEVICE_ORDER=PCI_BUS_ID and on machines of one GPU model).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

_INIT_LOCK = threading.Lock()
_initialized: set[int] = set()  # ids of NVML modules initialized in this process


@dataclass(frozen=True)
class NvmlGpu:
    """One GPU this process may use, as NVML reports it."""

    ordinal: int  # its CUDA index here (cuda:N)
    handle: Any  # NVML's device handle
    name: str
    uuid: str
    compute_capability: tuple[int, int]
    total_memory_bytes: int


class Nvml:
    """NVML through nvidia-ml-py's `pynvml` module (tests pass a stand-in module)."""

    def __init__(self, module: ModuleType) -> None:
        self._nvml = module

    @classmethod
    def load(cls) -> Nvml | None:
        """NVML, initialized; None where nvidia-ml-py or the driver's library is missing."""
        try:
            import pynvml
        except ImportError:
            return None
        nvml = cls(pynvml)
        return nvml if nvml._init() else None

    def _init(self) -> bool:
        with _INIT_LOCK:
            if id(self._nvml) in _initialized:
                return True
            try:
                self._nvml.nvmlInit()
            except Exception as exc:  # NVMLError_LibraryNotFound, _DriverNotLoaded, ...
                log.debug("NVML unavailable: %s", exc)
                return False
            _initialized.add(id(self._nvml))
            return True

    def visible_gpus(self, environ: Mapping[str, str] | None = None) -> list[NvmlGpu]:
        """The GPUs CUDA_VISIBLE_DEVICES lets this process use, by CUDA ordinal."""
        nvml = self._nvml
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(nvml.nvmlDeviceGetCount())]
        uuids = [_text(nvml.nvmlDeviceGetUUID(h)) for h in handles]
        env = os.environ if environ is None else environ
        chosen = _visible(env.get("CUDA_VISIBLE_DEVICES"), uuids)
        gpus = []
        for ordinal, physical in enumerate(chosen):
            handle = handles[physical]
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
            gpus.append(NvmlGpu(
                ordinal=ordinal,
                handle=handle,
                name=_text(nvml.nvmlDeviceGetName(handle)),
                uuid=uuids[physical],
                compute_capability=(int(major), int(minor)),
                total_memory_bytes=int(nvml.nvmlDeviceGetMemoryInfo(handle).total),
            ))
        return gpus

    def memory_info(self, handle: Any) -> tuple[int, int]:
        """(free, total) bytes of the GPU now, every process counted."""
        info = self._nvml.nvmlDeviceGetMemoryInfo(handle)
        return int(info.free), int(info.total)

    def process_memory(self, handle: Any) -> dict[int, int]:
        """pid -> bytes for the compute processes on the GPU (those NVML can attribute)."""
        out: dict[int, int] = {}
        for process in self._nvml.nvmlDeviceGetComputeRunningProcesses(handle):
            out[int(process.pid)] = int(process.usedGpuMemory or 0)
        return out


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _visible(setting: str | None, uuids: list[str]) -> list[int]:
    """Physical NVML indices, in CUDA order, for a CUDA_VISIBLE_DEVICES value. As CUDA does, the
    list ends at the first entry that names no GPU (or a GPU named twice); MIG instances are not
    probed here (NVML gives them no index of this kind): their entry ends the list too."""
    if setting is None:
        return list(range(len(uuids)))
    chosen: list[int] = []
    for entry in (part.strip() for part in setting.split(",")):
        index = _entry_index(entry, uuids)
        if index is None or index in chosen:
            break
        chosen.append(index)
    return chosen


def _entry_index(entry: str, uuids: list[str]) -> int | None:
    if entry.isdigit() and entry.isascii():
        index = int(entry)
        return index if index < len(uuids) else None
    if entry.startswith("GPU-") and len(entry) > 4:
        matches = [i for i, uuid in enumerate(uuids) if uuid.startswith(entry)]
        return matches[0] if len(matches) == 1 else None
    return None
