"""The server's configuration: a YAML file, with command-line flags over it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from ferrum.backends.capabilities import BackendRequirements
from ferrum.engine.config import EngineConfig


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class ServerConfig:
    model: str
    served_model_name: str | None = None  # default: the model folder's name
    host: str = "127.0.0.1"
    port: int = 8000
    backend: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    requirements: BackendRequirements = field(default_factory=BackendRequirements)
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields other than model/device
    log_level: str = "info"

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model.rstrip("/")).name

    def engine_config(self, device: str) -> EngineConfig:
        return EngineConfig(model=self.model, device=device, **self.engine)


_ENGINE_KEYS = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "device"}
_TOP_KEYS = {f.name for f in dataclasses.fields(ServerConfig)}


def load_config(path: str | Path | None, overrides: dict[str, Any]) -> ServerConfig:
    """Reads `path` (if given) and applies `overrides` (flags; None values are ignored).
    Relative model paths in a file are taken relative to the working directory."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        try:
            loaded = yaml.safe_load(p.read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {p} not found") from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {p} is not valid YAML: {exc}") from None
        if loaded is not None and not isinstance(loaded, dict):
            raise ConfigError(f"config file {p}: expected a mapping at the top level")
        raw = dict(loaded or {})
    engine = dict(raw.get("engine") or {})
    for key, value in overrides.items():
        if value is None:
            continue
        if key in _ENGINE_KEYS:
            engine[key] = value
        else:
            raw[key] = value
    raw["engine"] = engine

    unknown = sorted(set(raw) - _TOP_KEYS)
    if unknown:
        raise ConfigError(f"unknown config key(s): {', '.join(unknown)}; valid keys: {', '.join(sorted(_TOP_KEYS))}")
    bad_engine = sorted(set(engine) - _ENGINE_KEYS)
    if bad_engine:
        raise ConfigError(
            f"unknown engine key(s): {', '.join(bad_engine)}; valid keys: {', '.join(sorted(_ENGINE_KEYS))}"
        )
    if not raw.get("model"):
        raise ConfigError("no model given: set `model:` in the config file or pass --model PATH")
    try:
        raw["requirements"] = BackendRequirements.from_mapping(raw.get("requirements") or {})
        raw["model"] = str(raw["model"])
        raw["port"] = int(raw.get("port", 8000))
        config = ServerConfig(**raw)
        config.engine_config("cpu")  # validates the engine section now, not after start-up work
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid config: {exc}") from None
    return config
