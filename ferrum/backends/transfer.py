"""Moving host bytes into tensors on a device, chosen once from the `Device` (`host_writer`):

    HostWriter     the CPU: bytes are read straight into the tensor's own memory; MPS: through a
                   host tensor and one copy
    PinnedWriter   CUDA: through a ring of pinned staging buffers and a copy stream of its own, so
                   that reading the next chunk from disk or the network overlaps the upload of the
                   last, and several threads read at once

A tensor already on the device (quantized there as it loaded) is copied on the device.

The weight loader says where a tensor's bytes come from with a `read(buffer, offset)` callable that
fills `buffer` with the source's bytes [offset, offset + len(buffer)); a writer calls it once per
staging chunk. Writers are thread-safe; `finish()` waits for every upload and frees the staging.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from typing import Protocol

import torch

from ferrum.backends.device import Device

ReadInto = Callable[[memoryview, int], None]  # (buffer, offset in the tensor's bytes) -> buffer filled

STAGING_CHUNK_BYTES = 32 * 2**20
STAGING_BUFFERS = 6


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 tensor over the same memory."""
    if not tensor.is_contiguous():
        raise ValueError("a tensor written from host bytes must be contiguous")
    return tensor.reshape(-1).view(torch.uint8)


class DeviceWriter(Protocol):
    def write(self, target: torch.Tensor, read: ReadInto) -> None:
        """Fills `target` (contiguous) with its `nbytes` bytes as `read` provides them. Blocking;
        the upload may still be in flight when it returns (see `finish`)."""
        ...

    def write_tensor(self, target: torch.Tensor, source: torch.Tensor) -> None:
        """Copies a tensor of `target`'s shape and dtype into it: from the host, or one already on
        a device (quantized there as it loaded): then copied on that device."""
        ...

    def finish(self) -> None:
        """Waits for every upload; the writer can be used again afterwards."""
        ...


def _host_bytes(source: torch.Tensor) -> memoryview:
    flat = source.contiguous().reshape(-1).view(torch.uint8)
    return flat.numpy().data


def _reader_of(source: torch.Tensor) -> ReadInto:
    data = _host_bytes(source)

    def read(buffer: memoryview, offset: int) -> None:
        buffer[:] = data[offset : offset + len(buffer)]

    return read


class HostWriter:
    """The CPU (bytes go straight into the tensor) and MPS (through one host tensor)."""

    def __init__(self, device: torch.device) -> None:
        self._direct = device.type == "cpu"

    def write(self, target: torch.Tensor, read: ReadInto) -> None:
        if self._direct:
            if target.numel():
                read(byte_view(target).numpy().data, 0)
            return
        host = torch.empty(target.shape, dtype=target.dtype)
        if host.numel():
            read(byte_view(host).numpy().data, 0)
        target.copy_(host)

    def write_tensor(self, target: torch.Tensor, source: torch.Tensor) -> None:
        target.copy_(source)

    def finish(self) -> None:
        """Every copy was synchronous (MPS: torch orders them before any later use)."""


class PinnedWriter:
    """CUDA: host bytes -> a free pinned buffer -> an asynchronous copy on the writer's stream. A
    buffer is reused once the event recorded after its copy has passed."""

    def __init__(self, device: torch.device, chunk_bytes: int = STAGING_CHUNK_BYTES,
                 buffers: int = STAGING_BUFFERS) -> None:
        self._device = device
        self._chunk = chunk_bytes
        self._count = buffers
        self._stream: torch.cuda.Stream | None = None
        self._free: queue.SimpleQueue[tuple[torch.Tensor, torch.cuda.Event]] | None = None
        self._copied_on_device = False  # write_tensor copied a source already on a device
        self._lock = threading.Lock()

    def _setup(self) -> queue.SimpleQueue[tuple[torch.Tensor, torch.cuda.Event]]:
        with self._lock:
            if self._free is None:
                self._stream = torch.cuda.Stream(self._device)
                free: queue.SimpleQueue[tuple[torch.Tensor, torch.cuda.Event]] = queue.SimpleQueue()
                for _ in range(self._count):
                    free.put((torch.empty(self._chunk, dtype=torch.uint8).pin_memory(), torch.cuda.Event()))
                self._free = free
            return self._free

    def write(self, target: torch.Tensor, read: ReadInto) -> None:
        free = self._setup()
        out = byte_view(target)
        total = out.numel()
        for offset in range(0, total, self._chunk):
            n = min(self._chunk, total - offset)
            buffer, done = free.get()
            try:
                done.synchronize()  # its last upload has finished: the buffer may be refilled
                read(buffer[:n].numpy().data, offset)
                with torch.cuda.stream(self._stream):
                    out[offset : offset + n].copy_(buffer[:n], non_blocking=True)
                    done.record(self._stream)
            finally:
                free.put((buffer, done))

    def write_tensor(self, target: torch.Tensor, source: torch.Tensor) -> None:
        if source.device.type == "cpu":
            self.write(target, _reader_of(source))
            return
        target.copy_(source)  # on the device, in its current stream's order (after the work that made it)
        self._copied_on_device = True

    def finish(self) -> None:
        with self._lock:
            stream, free = self._stream, self._free
            self._stream = self._free = None
            on_device, self._copied_on_device = self._copied_on_device, False
        if stream is not None:
            stream.synchronize()
        if on_device:
            torch.cuda.synchronize(self._device)
        del free  # the pinned buffers go back to torch's host allocator


def device_writer(device: Device) -> DeviceWriter:
    """The writer for `device`: pinned staging on CUDA, direct elsewhere."""
    if device.kind == "cuda":
        return PinnedWriter(device.torch_device)
    return HostWriter(device.torch_device)
