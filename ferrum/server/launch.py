"""Start-up: pick a backend, load the model, start the engine, serve HTTP."""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import uvicorn

from ferrum.backends.registry import create_default_registry
from ferrum.backends.selection import select_backend
from ferrum.config import ConfigError, ServerConfig
from ferrum.engine.async_engine import AsyncEngine
from ferrum.engine.llm_engine import LLMEngine

log = logging.getLogger("ferrum")


class StartupError(RuntimeError):
    """Start-up cannot go on; the message is for the user, no traceback needed."""


async def build_engine(config: ServerConfig) -> AsyncEngine:
    registry = await create_default_registry()
    backend, device = await select_backend(registry, config.backend, config.requirements)
    log.info("backend %s (%s) on %s", backend.name, backend.version(), device)
    folder = Path(config.model)
    if not (folder / "config.json").is_file():
        raise StartupError(
            f"model folder {folder} has no config.json"
            + ("" if folder.exists() else " (the folder does not exist; `make serve` prepares the demo model)")
        )
    engine_config = config.engine_config(device)
    loop = asyncio.get_running_loop()
    try:
        engine = await loop.run_in_executor(None, LLMEngine, engine_config)
    except (OSError, ValueError) as exc:  # unreadable or invalid model files: the message names the file
        raise StartupError(f"cannot load the model from {folder}: {exc}") from exc
    return AsyncEngine(engine)


async def serve(config: ServerConfig) -> None:
    from ferrum.server.api import create_app

    started = time.perf_counter()
    engine = await build_engine(config)
    await engine.start()
    app = create_app(engine, config.model_name)
    server = uvicorn.Server(
        uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level, access_log=False)
    )
    log.info("model %s loaded in %.2fs; listening on http://%s:%d", config.model_name,
             time.perf_counter() - started, config.host, config.port)
    try:
        await server.serve()
    finally:
        await engine.shutdown()


__all__ = ["ConfigError", "StartupError", "build_engine", "serve"]
