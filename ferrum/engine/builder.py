"""Building an engine from the pipeline's parts, wherever it runs.

    EngineSpec     what an engine needs, picklable: the engine config, the backend the API process
                   selected (by name) and its device, the model's resolved files, the weights config
    build_engine   the spec's engine in this process: its backend rebuilt and its `Device` probed here
                   (ferrum.backends.registry.open_backend: a GPU's CUDA context belongs to the process
                   that runs on it, not the API server), the engine attached to the backend
    attach_engine  an engine's ties to the backend it runs on: its release on the backend's shutdown,
                   and its steps counted as the backend's operations (GET /v1/backends)
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
from ferrum.backends.registry import create_default_registry, open_backend
from ferrum.backends.selection import select_backend
from ferrum.engine.config import EngineConfig
from ferrum.engine.llm_engine import LLMEngine
from ferrum.engine.observer import StepRecord
from ferrum.engine.startup import StartupObserver
from ferrum.models.loader import run_sync
from ferrum.weights.locations.model_files import ModelFiles, ModelLocation
from ferrum.weights.locations.uri import resolve_model
from ferrum.weights.spec.loader_config import WeightLoaderConfig


@dataclass(frozen=True)
class EngineSpec:
    config: EngineConfig
    backend: str  # the registered backend's name, e.g. "cpu", "cuda:0"
    device: str  # the concrete device it serves, e.g. "cuda:0"
    files: ModelFiles
    weights: WeightLoaderConfig = field(default_factory=WeightLoaderConfig)


def build_engine(spec: EngineSpec, on_progress: StartupObserver | None = None) -> tuple[LLMEngine, ComputeBackend]:
    """The engine of `spec`, in this process (its own engine process), attached to its backend."""
    backend, device = run_sync(open_backend(spec.backend, spec.device))
    engine = LLMEngine(spec.config, device, spec.files, spec.weights, on_progress=on_progress)
    attach_engine(engine, backend)
    return engine, backend


def attach_engine(engine: LLMEngine, backend: ComputeBackend) -> None:
    """Ties `engine` to the backend whose device it runs on, in the process it runs in: the
    backend's shutdown frees the engine's device memory (a release hook), and every engine step is
    one of the backend's completed operations (a step observer)."""
    backend.add_release_hook(engine.device.name, engine.release)

    def count(record: StepRecord) -> None:
        backend.record_operation()

    engine.add_observer(count)


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
    method = config.quantization.method if config.quantization is not None else None

    async def select() -> tuple[ComputeBackend, str, ModelFiles]:
        registry = await create_default_registry()
        chosen, device = await select_backend(registry, backend, wanted, method)
        files = await resolve_model(model, weights)
        return chosen, device, files

    chosen, device_name, files = run_sync(select())
    return LLMEngine(config, chosen.device(device_name), files, weights)
