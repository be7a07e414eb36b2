"""What the CUDA and MPS backends share: one device behind a DeviceRuntime."""

from __future__ import annotations

import asyncio

from ferrum.backends.base import ComputeBackend
from ferrum.backends.device import DeviceRuntime


class AcceleratorBackend(ComputeBackend):
    """A backend of one accelerator device whose live calls go through `runtime` (torch.cuda or
    torch.mps; tests pass a stub). Subclasses give the facts: name, kind, capabilities, version."""

    def __init__(self, runtime: DeviceRuntime) -> None:
        super().__init__()
        self._runtime = runtime

    def memory_in_use_bytes(self) -> int:
        return self._runtime.memory_held()

    async def _prepare_device(self, device: str) -> None:
        """Checks the device answers (its memory is read), off the event loop. This opens no CUDA
        context: the process that runs the engine opens it, through `device()`."""
        await asyncio.to_thread(self._runtime.memory_info)

    async def synchronize(self, device: str) -> None:
        """Waits, in a worker thread, for all work queued on the device."""
        if not self.supports_device(device):
            raise ValueError(f"backend {self.name} does not serve device {device!r}")
        await asyncio.to_thread(self._runtime.synchronize)

    def _free_cached_memory(self) -> None:
        self._runtime.empty_cache()
