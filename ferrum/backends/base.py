"""The interface every compute backend implements, and the bookkeeping they share."""

from __future__ import annotations

import gc
import itertools
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ferrum.backends.capabilities import BackendCapabilities, device_is_served
from ferrum.backends.device import Device, DeviceRuntime

__all__ = ["BackendReleaseError", "BackendStatus", "ComputeBackend", "DeviceRuntime", "ReleaseFailure", "ReleaseHook"]

ReleaseHook = Callable[[], None]
"""Drops what its owner holds on one device (KV cache tensors, CUDA graphs, the model); no arguments."""


@dataclass(frozen=True)
class BackendStatus:
    """A snapshot of one backend's state."""

    initialized: bool  # initialize() has succeeded at least once
    ready: bool  # initialized and holding at least one active device (shutdown releases them all)
    active_devices: tuple[str, ...]
    memory_in_use_bytes: int
    operations_completed: int
    last_error: str | None


@dataclass(frozen=True)
class ReleaseFailure:
    """One step of releasing a device that raised: which device, which step, and the error."""

    device: str
    step: str  # "synchronize", "hook <name>", "release" or "free cached memory"
    error: BaseException

    def describe(self) -> str:
        return f"{self.device}: {self.step} raised {type(self.error).__name__}: {self.error}"


class BackendReleaseError(RuntimeError):
    """Raised by `shutdown` / `release_device` after every step has run, when some of them failed."""

    def __init__(self, backend_name: str, failures: Sequence[ReleaseFailure]) -> None:
        self.failures: tuple[ReleaseFailure, ...] = tuple(failures)
        lines = "; ".join(failure.describe() for failure in self.failures)
        super().__init__(f"backend {backend_name} did not release cleanly: {lines}")


def _call_hook(device: str, hook: ReleaseHook) -> ReleaseFailure | None:
    """Run one release hook; its error, if any, as a ReleaseFailure. A failure's traceback keeps this
    frame, and so only this one hook, alive."""
    try:
        hook()
    except Exception as error:
        name = getattr(hook, "__qualname__", None) or repr(hook)
        return ReleaseFailure(device, f"hook {name}", error)
    return None


class ComputeBackend(ABC):
    """A source of compute (CPU, one or more CUDA GPUs, Apple MPS).

    Subclasses provide the facts (`name`, `kind`, `capabilities`, `version`, `memory_in_use_bytes`),
    the typed `Device` of each device they serve (`_make_device`, handed out by `device()`), and the
    device-specific work (`_prepare_device`, `synchronize`, optionally `_release` and
    `_free_cached_memory`). This base keeps the shared bookkeeping: which devices are active, how
    many operations completed and the last error, all of which `status()` reports. The engine running
    on a device counts each of its steps with `record_operation()` (ferrum.engine.builder.attach_engine;
    an engine in a process of its own has them mirrored here by its client); `record_error()` keeps
    the last error. Both are safe to call from worker threads.

    Whoever puts long-lived state on a device (the engine: model weights, KV cache, CUDA graphs)
    registers a release hook for it with `add_release_hook`. `release_device` and `shutdown` wait for
    the device, call its hooks (newest first), then collect garbage and return the allocator's cached
    memory to the driver, so the memory is really free afterwards.
    """

    def __init__(self) -> None:
        self._state_lock = threading.Lock()
        self._active_devices: list[str] = []
        self._initialized = False
        self._operations_completed = 0
        self._last_error: str | None = None
        self._release_hooks: dict[str, list[tuple[int, ReleaseHook]]] = {}
        self._hook_ids = itertools.count()
        self._devices: dict[str, Device] = {}

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
    def _make_device(self, device: str) -> Device:
        """The `Device` of `device` (a concrete device this backend serves), probed here."""

    @abstractmethod
    async def _prepare_device(self, device: str) -> None:
        """Device-specific setup for `initialize`; `device` is already known to be supported."""

    async def _release(self) -> None:
        """Device-specific teardown for `shutdown`, after the release hooks ran; nothing by default."""
        return

    def _free_cached_memory(self) -> None:
        """Return cached allocator memory to the driver (after the hooks ran and garbage was collected);
        nothing by default."""
        return

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

    def device(self, device: str | None = None) -> Device:
        """The typed `Device` for `device` ("cuda" means this backend's first GPU; default: its
        default device), probed once, in the calling process: for a GPU this opens the process's
        CUDA context, so call it where the engine runs. ValueError if the device is not served."""
        concrete = self.resolve_device(device if device is not None else self.default_device())
        with self._state_lock:
            known = self._devices.get(concrete)
        if known is None:
            known = self._make_device(concrete)
            with self._state_lock:
                known = self._devices.setdefault(concrete, known)
        return known

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

    def add_release_hook(self, device: str, hook: ReleaseHook) -> Callable[[], None]:
        """Have `hook` called when `device` is released (`release_device` or `shutdown`).

        `device` may be a bare kind ("cuda"), meaning this backend's first device of that kind;
        ValueError if this backend does not serve it. A hook runs once and is then forgotten; hooks
        of one device run newest first. Returns a function that unregisters the hook (a no-op once
        it has run), for owners that free their state themselves.
        """
        concrete_device = self.resolve_device(device)
        hook_id = next(self._hook_ids)
        with self._state_lock:
            self._release_hooks.setdefault(concrete_device, []).append((hook_id, hook))

        def remove() -> None:
            with self._state_lock:
                hooks = self._release_hooks.get(concrete_device, [])
                hooks[:] = [(other_id, other) for other_id, other in hooks if other_id != hook_id]

        return remove

    def release_hook_count(self, device: str | None = None) -> int:
        """How many release hooks are waiting, on `device` or on all devices."""
        concrete_device = None if device is None else self.resolve_device(device)
        with self._state_lock:
            if concrete_device is None:
                return sum(len(hooks) for hooks in self._release_hooks.values())
            return len(self._release_hooks.get(concrete_device, []))

    async def release_device(self, device: str) -> None:
        """Free what is held on one device: wait for its queued work, call its release hooks, collect
        garbage and return cached memory to the driver; the device is no longer active.

        Every step runs even when an earlier one fails; failures are recorded (`status().last_error`)
        and then raised together as one BackendReleaseError.
        """
        concrete_device = self.resolve_device(device)
        failures = await self._run_release_steps([concrete_device], include_backend_release=False)
        self._raise_if_failed(failures)

    async def shutdown(self) -> None:
        """Release every device, as `release_device` does, then the backend itself (`_release`); the
        backend is no longer ready until initialized again. Call it once nothing runs on the devices
        any more (the engine has stopped stepping)."""
        with self._state_lock:
            devices = list(dict.fromkeys([*self._active_devices, *self._release_hooks]))
        failures = await self._run_release_steps(devices, include_backend_release=True)
        self._raise_if_failed(failures)

    async def _run_release_steps(
        self, devices: Sequence[str], include_backend_release: bool
    ) -> list[ReleaseFailure]:
        failures: list[ReleaseFailure] = []
        try:
            for device in devices:
                failures.extend(await self._release_one_device(device))
            if include_backend_release:
                try:
                    await self._release()
                except Exception as error:
                    failures.append(ReleaseFailure(", ".join(devices) or self.name, "release", error))
            gc.collect()
            try:
                self._free_cached_memory()
            except Exception as error:
                failures.append(ReleaseFailure(", ".join(devices) or self.name, "free cached memory", error))
        finally:
            with self._state_lock:
                if include_backend_release:
                    self._active_devices.clear()
                else:
                    self._active_devices[:] = [d for d in self._active_devices if d not in devices]
        for failure in failures:
            self.record_error(failure.error)
        return failures

    async def _release_one_device(self, device: str) -> list[ReleaseFailure]:
        failures: list[ReleaseFailure] = []
        try:
            await self.synchronize(device)
        except Exception as error:
            failures.append(ReleaseFailure(device, "synchronize", error))
        with self._state_lock:
            hooks = self._release_hooks.pop(device, [])
        while hooks:  # newest first; popping leaves no hook referenced from this frame
            failure = _call_hook(device, hooks.pop()[1])
            if failure is not None:
                failures.append(failure)
        return failures

    def _raise_if_failed(self, failures: Sequence[ReleaseFailure]) -> None:
        if failures:
            raise BackendReleaseError(self.name, failures) from failures[0].error

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

    @property
    def operations_completed(self) -> int:
        """What `record_operation` has counted (cheap: no memory is read, unlike `status()`)."""
        with self._state_lock:
            return self._operations_completed

    def record_operation(self, count: int = 1) -> None:
        """Count `count` completed operations (engine steps: a forward pass and its sampling, or a
        greedy burst)."""
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
