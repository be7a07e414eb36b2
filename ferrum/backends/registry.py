"""The set of compute backends this process can use, and how the best one is picked."""

from __future__ import annotations

import asyncio
import builtins
import importlib
import logging

import torch

from ferrum.backends.base import ComputeBackend
from ferrum.backends.capabilities import BackendRequirements, dtype_names
from ferrum.backends.cpu import CPUBackend
from ferrum.backends.device import Device

logger = logging.getLogger(__name__)

KIND_PREFERENCE: tuple[str, ...] = ("cuda", "mps", "cpu")  # best first

# Each accelerator module exposes `create_backends() -> list[ComputeBackend]`: one backend per device.
ACCELERATOR_MODULES: tuple[tuple[str, str], ...] = (
    ("cuda", "ferrum.backends.cuda"),
    ("mps", "ferrum.backends.mps"),
)


def kind_rank(kind: str) -> int:
    """0 for cuda, 1 for mps, 2 for cpu; kinds outside KIND_PREFERENCE come after all of them."""
    return KIND_PREFERENCE.index(kind) if kind in KIND_PREFERENCE else len(KIND_PREFERENCE)


def preference_key(backend: ComputeBackend) -> tuple[int, int, str]:
    """Sort key, smallest best: kind (cuda, mps, cpu), then more free memory, then name."""
    return (kind_rank(backend.kind), -backend.capabilities().free_memory_bytes, backend.name)


def describe_backend(backend: ComputeBackend, requirements: BackendRequirements | None = None) -> str:
    """One line naming a backend, its devices and dtypes, and, given requirements, what it fails."""
    capabilities = backend.capabilities()
    line = (
        f"- {backend.name} (kind {backend.kind}): devices {', '.join(capabilities.devices) or 'none'}; "
        f"dtypes {dtype_names(capabilities.supported_dtypes)}"
    )
    if requirements is None:
        return line
    unmet = capabilities.unmet_requirements(requirements)
    return f"{line}; " + ("unmet: " + "; ".join(unmet) if unmet else "meets all requirements")


class BackendRegistry:
    """Backends by unique name, in registration order. An asyncio.Lock serializes changes."""

    def __init__(self) -> None:
        self._backends: dict[str, ComputeBackend] = {}
        self._lock = asyncio.Lock()

    async def register(self, backend: ComputeBackend) -> None:
        """Add `backend`; ValueError if its name is taken."""
        async with self._lock:
            if backend.name in self._backends:
                raise ValueError(f"a backend named {backend.name!r} is already registered")
            self._backends[backend.name] = backend

    async def unregister(self, name: str) -> ComputeBackend:
        """Remove and return the backend called `name`; KeyError if there is none."""
        async with self._lock:
            self._require(name)
            return self._backends.pop(name)

    def get(self, name: str) -> ComputeBackend:
        """The backend called `name`; KeyError listing the registered names if there is none."""
        return self._require(name)

    def list(self) -> builtins.list[ComputeBackend]:
        """All registered backends, in registration order."""
        return list(self._backends.values())

    def names(self) -> builtins.list[str]:
        return list(self._backends)

    def __len__(self) -> int:
        return len(self._backends)

    def __contains__(self, name: object) -> bool:
        return name in self._backends

    async def find_best(self, requirements: BackendRequirements | None = None) -> ComputeBackend | None:
        """The most preferred backend that meets `requirements` (all of them if None); None if none does.

        Order, best first: kind cuda, then mps, then cpu (then any other kind); within a kind, more
        free memory first; then the name, alphabetically, so the pick never depends on
        registration order.
        """
        async with self._lock:
            candidates = list(self._backends.values())
        wanted = requirements or BackendRequirements()
        qualifying = [backend for backend in candidates if backend.capabilities().meets_requirements(wanted)]
        return min(qualifying, key=preference_key, default=None)

    def explain(self, requirements: BackendRequirements | None = None) -> str:
        """One line per registered backend: name, devices, dtypes and the requirements it fails."""
        if not self._backends:
            return "no backends are registered"
        wanted = requirements or BackendRequirements()
        return "\n".join(describe_backend(backend, wanted) for backend in self._backends.values())

    def _require(self, name: str) -> ComputeBackend:
        backend = self._backends.get(name)
        if backend is None:
            registered = ", ".join(self._backends) or "none"
            raise KeyError(f"no backend named {name!r}; registered: {registered}")
        return backend


def device_kind_available(kind: str) -> bool:
    """Whether this process has a device of `kind` ("cpu" always; "cuda", "mps" where torch sees one)."""
    if kind == "cpu":
        return True
    if kind == "cuda":
        return torch.cuda.is_available()
    if kind == "mps":
        return torch.backends.mps.is_available()
    return False


async def _register_accelerator(registry: BackendRegistry, module_name: str) -> None:
    module = importlib.import_module(module_name)
    backends: builtins.list[ComputeBackend] = module.create_backends()
    for backend in backends:
        await registry.register(backend)


async def create_default_registry() -> BackendRegistry:
    """A registry holding the CPU backend and, where the hardware is present, one CUDA backend per
    visible GPU ("cuda:0", "cuda:1", ...) and the MPS backend ("mps"), from the `create_backends()`
    of `ferrum.backends.cuda` / `ferrum.backends.mps`. An accelerator module that fails to import or
    to create its backends is logged and skipped, so the server still starts on the CPU."""
    registry = BackendRegistry()
    await registry.register(CPUBackend())
    for kind, module_name in ACCELERATOR_MODULES:
        if not device_kind_available(kind):
            continue
        try:
            await _register_accelerator(registry, module_name)
        except Exception:
            logger.exception(
                "could not set up the %s backend from %s; continuing without it", kind, module_name
            )
    return registry


async def open_backend(name: str, device: str) -> tuple[ComputeBackend, Device]:
    """The registered backend `name` ("cpu", "cuda:1"), from a registry built in this process,
    initialised on `device`, and that device's `Device`, probed here: how a process that runs on a
    device another process selected (an engine process, a tensor-parallel worker) opens it, so that a
    GPU's CUDA context belongs to the process that computes on it."""
    registry = await create_default_registry()
    backend = registry.get(name)
    await backend.initialize(device)
    return backend, backend.device(device)
