"""Start-up: pick a backend, fetch the model if it is remote, load it, start the engine, serve HTTP."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import uvicorn

from ferrum.backends.base import ComputeBackend
from ferrum.backends.registry import create_default_registry
from ferrum.backends.selection import select_backend
from ferrum.config import ConfigError, ServerConfig
from ferrum.engine.async_engine import AsyncEngine, EngineClient
from ferrum.engine.llm_engine import LLMEngine
from ferrum.engine.process_client import ProcessEngineClient
from ferrum.weights.uri import LocalModel, parse_model_location, resolve_model_folder

log = logging.getLogger("ferrum")


NO_FOLDER_HINT = " (the folder does not exist; `make serve` prepares the demo model)"


class StartupError(RuntimeError):
    """Start-up cannot go on; the message is for the user, no traceback needed."""


async def resolve_model(config: ServerConfig) -> Path:
    """The local folder of `config.model`: a local folder as it is (checked), a remote model fetched
    into the cache (or found there). Raises StartupError, or a WeightError naming what is missing."""
    location = parse_model_location(config.model)
    if isinstance(location, LocalModel):
        folder = location.path
        if not (folder / "config.json").is_file():
            hint = "" if folder.exists() else NO_FOLDER_HINT
            raise StartupError(f"model folder {folder} has no config.json{hint}")
        return folder
    started = time.perf_counter()
    log.info("model %s: fetching into the cache (or finding it there)", location.display)
    folder = await resolve_model_folder(location, config.weights)
    log.info("model %s is in %s (%.1fs)", location.display, folder, time.perf_counter() - started)
    return folder


def engine_in_own_process(setting: str, device: str) -> bool:
    """`engine_process` auto: its own process on an accelerator (cuda, cuda:N, mps), where the
    server's Python work would otherwise hold the GIL the engine needs to keep the GPU busy; a
    thread of the server's process on the CPU (no spawn, no second torch import)."""
    if setting == "auto":
        return not device.startswith("cpu")
    return setting == "on"


async def build_engine(config: ServerConfig) -> tuple[EngineClient, ComputeBackend]:
    """The engine client, its model loaded (in its own process or on a worker thread), and the
    backend it runs on. An in-process engine's device memory (weights, KV cache, CUDA graphs) is
    freed by the backend's shutdown; an engine process frees its own when it exits."""
    registry = await create_default_registry()
    backend, device = await select_backend(registry, config.backend, config.requirements)
    log.info("backend %s (%s) on %s", backend.name, backend.version(), device)
    folder = await resolve_model(config)
    engine_config = config.engine_config(device, folder)
    try:
        if engine_in_own_process(config.engine_process, device):
            log.info("engine: in its own process")
            return await ProcessEngineClient.launch(engine_config), backend
        log.info("engine: on a thread of the server process")
        engine = await asyncio.get_running_loop().run_in_executor(None, LLMEngine, engine_config)
    except (OSError, ValueError) as exc:  # unreadable or invalid model files: the message names the file
        raise StartupError(f"cannot load the model from {folder}: {exc}") from exc
    backend.add_release_hook(device, engine.release)
    return AsyncEngine(engine), backend


async def serve(config: ServerConfig) -> None:
    from ferrum.server.api import create_app

    started = time.perf_counter()
    engine, backend = await build_engine(config)
    try:
        await engine.start()
        app = create_app(engine, config.model_name)
        server = uvicorn.Server(
            uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level, access_log=False)
        )
        log.info("model %s loaded in %.2fs; listening on http://%s:%d", config.model_name,
                 time.perf_counter() - started, config.host, config.port)
        await server.serve()
    finally:
        await engine.shutdown()  # stops stepping first: then the backend may free the device
        await backend.shutdown()


__all__ = ["ConfigError", "StartupError", "build_engine", "engine_in_own_process", "resolve_model", "serve"]
