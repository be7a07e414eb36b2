"""The interface every compute backend implements, and the bookkeeping they share."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass

from ferrum.backends.capabilities import BackendCapabilities, device_is_served


@dataclass(frozen=True)
class BackendStatus:
    """A snapshot of one backend's state."""

    initialized: bool  # initialize() has succeeded at least once
    ready: bool  # initialized and holding at least one active device (shutdown releases them all)
    active_devices: tuple[str, ...]
    memory_in_use_bytes: int
    operations_completed: int
    last_error: str | None


class ComputeBackend(ABC):
    """A source of compute (CPU, one or more CUDA GPUs, Apple MPS).

    Subclasses provide the facts (`name`, `kind`, `capabilities`, `version`, `memory_in_use_bytes`)
    and the device-specific work (`_prepare_device`, `synchronize`, optionally `_release`). This base
    keeps the shared bookkeeping: which devices are active, how many operations completed and the
    last error, all of which `status()` reports. Engines call `record_operation()` and
    `record_error()`; both are safe to call from worker threads.
    """

    def __init__(self) -> None:
        self._state_lock = threading.Lock()
        self._active_devices: list[str] = []
        self._initialized = False
        self._operations_completed = 0
        self._last_error: str | None = None

    @property
    @abstractmethod
    def name(self) -> str:
        """The unique name this backend is registered under."""

    @property
    @abstractmethod
    def kind(self) -> str:
        """One of "cuda", "mps" or "cpu"; the registry ranks backends by it."""

    @abstractmethod
    def capabilities(self) -> BackendCapabilities:
        """What this backend offers now (free memory may change between calls)."""

    @abstractmethod
    def version(self) -> str:
        """The software stack behind this backend, e.g. "torch 2.13.0+cpu"."""

    @abstractmethod
    async def synchronize(self, device: str) -> None:
        """Return once all work queued on `device` has finished."""

    @abstractmethod
    def memory_in_use_bytes(self) -> int:
        """Memory this process currently holds on this backend's devices."""

    @abstractmethod
    async def _prepare_device(self, device: str) -> None:
        """Device-specific setup for `initialize`; `device` is already known to be supported."""

    async def _release(self) -> None:
        """Device-specific teardown for `shutdown`; nothing by default."""

    def supports_device(self, device: str) -> bool:
        """Whether `device` ("cuda" for any GPU, or "cuda:1" exactly) is one this backend serves."""
        try:
            return device_is_served(device, self.capabilities().devices)
        except ValueError:
            return False

    def default_device(self) -> str:
        """The device used when a caller names only the backend: the first one it offers."""
        devices = self.capabilities().devices
        if not devices:
            raise RuntimeError(f"backend {self.name} offers no devices")
        return devices[0]

    def resolve_device(self, device: str) -> str:
        """A concrete device of this backend for `device`: "cuda" becomes the first "cuda:N" offered."""
        for offered in self.capabilities().devices:
            if device_is_served(device, (offered,)):
                return offered
        raise ValueError(f"backend {self.name} does not serve device {device!r}")

    async def initialize(self, device: str) -> None:
        """Make `device` ready for work. Idempotent per device; ValueError if the device is not served."""
        if not self.supports_device(device):
            error = ValueError(
                f"backend {self.name} does not serve device {device!r}; "
                f"it serves {', '.join(self.capabilities().devices) or 'none'}"
            )
            self.record_error(error)
            raise error
        concrete_device = self.resolve_device(device)
        try:
            await self._prepare_device(concrete_device)
        except Exception as error:
            self.record_error(error)
            raise
        with self._state_lock:
            if concrete_device not in self._active_devices:
                self._active_devices.append(concrete_device)
            self._initialized = True

    async def shutdown(self) -> None:
        """Release all devices; the backend is no longer ready until initialized again."""
        try:
            await self._release()
        finally:
            with self._state_lock:
                self._active_devices.clear()

    def status(self) -> BackendStatus:
        memory_in_use_bytes = self.memory_in_use_bytes()
        with self._state_lock:
            active_devices = tuple(self._active_devices)
            return BackendStatus(
                initialized=self._initialized,
                ready=self._initialized and bool(active_devices),
                active_devices=active_devices,
                memory_in_use_bytes=memory_in_use_bytes,
                operations_completed=self._operations_completed,
                last_error=self._last_error,
            )

    def record_operation(self, count: int = 1) -> None:
        """Count `count` completed operations (a forward pass, a sampling step, ...)."""
        if count < 0:
            raise ValueError(f"count must not be negative, got {count}")
        with self._state_lock:
            self._operations_completed += count

    def record_error(self, error: BaseException) -> None:
        """Remember `error` as the last one this backend saw."""
        with self._state_lock:
            self._last_error = f"{type(error).__name__}: {error}"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} kind={self.kind!r}>"
