"""Start-up: pick a backend, resolve the model, start the engine on that backend's device, serve HTTP.

The API process selects the backend from capabilities probed without a CUDA context (NVML), and
resolves the model location to its files (the small ones fetched; a remote model's weights are
streamed later, by whoever loads them). On an accelerator the engine runs in a process of its
own, which rebuilds the selected backend there and opens the device (ferrum.engine.builder);
on the CPU it runs on a worker thread of this process, on the same backend object.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from dataclasses import replace
from pathlib import Path

from ferrum.backends.base import ComputeBackend
from ferrum.backends.registry import create_default_registry
from ferrum.backends.selection import select_backend
from ferrum.config.loader import ConfigError, ServerConfig
from ferrum.engine.async_engine import AsyncEngine, EngineClient
from ferrum.engine.builder import EngineSpec, attach_engine
from ferrum.engine.llm_engine import LLMEngine
from ferrum.engine.process_client import ProcessEngineClient
from ferrum.engine.startup import StartupObserver, StartupProgress
from ferrum.engine.warm_start import discard as discard_prestarted_engine
from ferrum.models.config import load_model_config
from ferrum.weights.locations.gguf_file import is_gguf_location
from ferrum.weights.locations.model_files import ModelFiles, local_model_folder
from ferrum.weights.locations.uri import parse_model_location, resolve_model, resolve_model_folder
from ferrum.weights.spec.sources import File

log = logging.getLogger("ferrum")


class StartupError(RuntimeError):
    """Start-up cannot go on; the message is for the user, no traceback needed."""


def check_local_folder(config: ServerConfig) -> None:
    location = parse_model_location(config.model)
    if isinstance(location, File) and not is_gguf_location(location):  # a GGUF file: checked as it resolves
        try:
            os.stat(location.path / "config.json")
        except PermissionError:
            raise StartupError(
                f"model folder {location.path}: permission denied to this process (uid {os.getuid()}); "
                f"make the folder readable and searchable by that user"
            ) from None
        except OSError:
            pass
        load_model_config(location.path)  # an unsupported architecture is named before anything else
        local_model_folder(location.path)  # which files make a model folder: one rule for every source


async def model_files(config: ServerConfig) -> ModelFiles:
    """`config.model` resolved for serving (ferrum.weights.locations.uri.resolve_model), its config.json read
    (an unsupported architecture is named here, in the server, before any engine starts). Raises
    StartupError, ModelConfigError, or a WeightError naming what is missing."""
    check_local_folder(config)
    started = time.perf_counter()
    files = await resolve_model(config.model, config.weights)
    load_model_config(files.folder)
    if not isinstance(files.location, File):
        streamed = f"small files fetched; weights streamed from {files.weights.display}"
        how = "in the cache" if files.complete else streamed
        log.info("model %s: %s (%.1fs)", files.display, how, time.perf_counter() - started)
    return files


async def pull_model(config: ServerConfig) -> Path:
    """`ferrum pull`: the whole model fetched into the cache (or found there); its local folder."""
    started = time.perf_counter()
    folder = await resolve_model_folder(config.model, config.weights)
    log.info("model %s is in %s (%.1fs)", parse_model_location(config.model).display, folder,
             time.perf_counter() - started)
    return folder


def engine_in_own_process(setting: str, kind: str) -> bool:
    """`engine_process` auto: the engine loop in its own process on every backend. On the CPU too:
    as a thread of the server's process it shares the GIL with the HTTP loop, and a streamed
    request's TPOT was 18.7 ms there against 11.3 ms in its own process (SmolLM2-135M Q4_1 GGUF,
    2-core Zen 4, benchmarks/cpu-kernels.md). `off` keeps it on a thread (no spawn, one torch)."""
    del kind  # every kind gains from its own GIL; the parameter stays for a rule per kind
    return setting != "off"


async def build_engine(
    config: ServerConfig,
    on_progress: StartupObserver | None = None,
    selected: tuple[ComputeBackend, str] | None = None,
) -> tuple[EngineClient, ComputeBackend]:
    """The engine client, its model loaded (in its own process or on a worker thread), and the
    backend it runs on (`selected`, or chosen here). An in-process engine's device memory (weights,
    KV cache, CUDA graphs) is freed by the backend's shutdown; an engine process frees its own
    before it exits. Either way the engine's steps are counted as the backend's operations (GET
    /v1/backends). `on_progress` hears the start-up's phases on this event loop."""
    if selected is None:
        selected = await choose_backend(config)
    backend, device_name = selected
    report = on_progress or (lambda progress: None)
    report(StartupProgress("fetching"))
    files = await model_files(config)
    spec = EngineSpec(config.engine_config(), backend.name, device_name, files, config.weights)
    try:
        if engine_in_own_process(config.engine_process, backend.kind):
            log.info("engine: in its own process")
            client = await ProcessEngineClient.launch(spec, on_progress=report,
                                                      on_operations=backend.record_operation)
            return client, backend
        log.info("engine: on a thread of the server process")
        discard_prestarted_engine()
        device = backend.device(device_name)
        loop = asyncio.get_running_loop()

        def from_thread(progress: StartupProgress) -> None:
            loop.call_soon_threadsafe(report, progress)

        engine = await loop.run_in_executor(
            None, lambda: LLMEngine(spec.config, device, files, spec.weights, on_progress=from_thread)
        )
    except (OSError, ValueError) as exc:  # unreadable or invalid model files: the message names the file
        raise StartupError(f"cannot load the model from {files.display}: {exc}") from exc
    attach_engine(engine, backend)
    return AsyncEngine(engine), backend


async def choose_backend(config: ServerConfig) -> tuple[ComputeBackend, str]:
    registry = await create_default_registry()
    engine = config.engine_config()
    wanted = replace(config.requirements, tensor_parallel_size=engine.tensor_parallel_size)
    method = engine.quantization.method if engine.quantization is not None else None
    backend, device_name = await select_backend(registry, config.backend, wanted, method)
    log.info("backend %s (%s) on %s", backend.name, backend.version(), device_name)
    return backend, device_name


__all__ = ["ConfigError", "StartupError", "build_engine", "choose_backend", "engine_in_own_process", "model_files",
           "pull_model"]
