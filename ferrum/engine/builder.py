"""Building an engine from the pipeline's parts, wherever it runs.

    EngineSpec     what an engine needs, picklable: the engine config, the backend the API process
                   selected (by name) and its device, the model's resolved files, the weights config
    open_device    the spec's backend rebuilt in this process and its `Device` probed here (so that
                   a GPU's CUDA context is opened by the process that runs on it, not the API server)
    create_engine  an in-process engine from a model location and a backend choice (ferrum bench
                   offline, scripts, tests): select, resolve, build
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ferrum.backends.base import ComputeBackend
from ferrum.backends.capabilities import BackendRequirements
from ferrum.backends.device import Device
from ferrum.backends.registry import create_default_registry
from ferrum.backends.selection import select_backend
from ferrum.engine.config import EngineConfig
from ferrum.engine.llm_engine import LLMEngine
from ferrum.engine.startup import StartupObserver
from ferrum.models.loader import run_sync
from ferrum.weights.model_files import ModelFiles
from ferrum.weights.spec import WeightLoaderConfig
from ferrum.weights.uri import ModelLocation, resolve_model


@dataclass(frozen=True)
class EngineSpec:
    config: EngineConfig
    backend: str  # the registered backend's name, e.g. "cpu", "cuda:0"
    device: str  # the concrete device it serves, e.g. "cuda:0"
    files: ModelFiles
    weights: WeightLoaderConfig = field(default_factory=WeightLoaderConfig)


async def open_device(spec: EngineSpec) -> tuple[ComputeBackend, Device]:
    """The spec's backend, from a registry built in this process, initialised on its device, and
    that device's `Device`, probed here."""
    registry = await create_default_registry()
    backend = registry.get(spec.backend)
    await backend.initialize(spec.device)
    return backend, backend.device(spec.device)


def build_engine(spec: EngineSpec, on_progress: StartupObserver | None = None) -> tuple[LLMEngine, ComputeBackend]:
    """The engine of `spec`, in this process (its own engine process, or a worker thread), with its
    release registered on the backend (so that the backend's shutdown frees the device)."""
    backend, device = run_sync(open_device(spec))
    engine = LLMEngine(spec.config, device, spec.files, spec.weights, on_progress=on_progress)
    backend.add_release_hook(device.name, engine.release)
    return engine, backend


def create_engine(
    model: str | os.PathLike[str] | Mapping[str, Any] | ModelLocation,
    *,
    backend: str = "auto",
    requirements: BackendRequirements | None = None,
    weights: WeightLoaderConfig | None = None,
    **settings: Any,
) -> LLMEngine:
    """An engine in this process for `model` (any model location) on `backend` (auto, cpu, cuda,
    cuda:N, mps); `settings` are EngineConfig's fields."""
    config = EngineConfig(**settings)
    weights = weights or WeightLoaderConfig()
    wanted = replace(requirements or BackendRequirements(), tensor_parallel_size=config.tensor_parallel_size)

    async def select() -> tuple[ComputeBackend, str, ModelFiles]:
        registry = await create_default_registry()
        chosen, device = await select_backend(registry, backend, wanted)
        files = await resolve_model(model, weights)
        return chosen, device, files

    chosen, device_name, files = run_sync(select())
    return LLMEngine(config, chosen.device(device_name), files, weights)
