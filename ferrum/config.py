"""The server's configuration: a YAML file, with command-line flags over it.

`model:` is a model location (see ferrum/weights/uri.py): a local folder, hf://org/name[@revision],
s3://bucket/prefix, https://host/folder/, or a mapping such as {source: s3, bucket: .., prefix: ..}.
`weights:` sets how remote models are fetched and cached (WeightLoaderConfig), e.g.

    weights:
      cache_dir: ~/.cache/ferrum
      max_cache_size_gb: 50
      max_concurrent_downloads: 8
      timeout_s: 60

`engine:` holds EngineConfig's fields (dtype, max_num_seqs, ..., `kernels:` for the GPU kernels'
settings) and `engine_process: auto | true | false`: whether the engine runs in a process of its
own (auto: on cuda and mps, not on the CPU).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ferrum.backends.capabilities import BackendRequirements
from ferrum.engine.config import EngineConfig
from ferrum.weights.spec import MiB, WeightLoaderConfig
from ferrum.weights.uri import ModelLocationError, model_display_name, parse_model_location


class ConfigError(ValueError):
    pass


EngineProcessMode = Literal["auto", "on", "off"]


@dataclass(frozen=True)
class ServerConfig:
    model: str | Mapping[str, Any]  # a model location: a folder, hf://..., s3://..., https://..., a mapping
    served_model_name: str | None = None  # default: the model folder's name
    host: str = "127.0.0.1"
    port: int = 8000
    backend: str = "auto"  # auto | cpu | cuda | cuda:N | mps
    requirements: BackendRequirements = field(default_factory=BackendRequirements)
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields other than model/device
    engine_process: EngineProcessMode = "auto"  # YAML: engine.engine_process; see ferrum.server.launch
    log_level: str = "info"
    weights: WeightLoaderConfig = field(default_factory=WeightLoaderConfig)

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if isinstance(self.model, str) and "://" not in self.model:
            return Path(self.model.rstrip("/")).name
        return model_display_name(self.model)

    def engine_config(self) -> EngineConfig:
        return EngineConfig.from_mapping(self.engine)


_ENGINE_KEYS = {f.name for f in dataclasses.fields(EngineConfig)} | {"engine_process"}
_TOP_KEYS = {f.name for f in dataclasses.fields(ServerConfig)} - {"engine_process"}  # it is an engine key
# `weights:` keys: WeightLoaderConfig's fields, with sizes in GB / MB and `headers` for default_headers
_WEIGHTS_RENAMED = {"max_cache_size_gb": "max_cache_size_bytes", "chunk_size_mb": "chunk_size",
                    "headers": "default_headers"}
_WEIGHTS_KEYS = {f.name for f in dataclasses.fields(WeightLoaderConfig)} - set(_WEIGHTS_RENAMED.values())
_WEIGHTS_KEYS |= set(_WEIGHTS_RENAMED)
_FLAG_WEIGHTS_KEYS = {"cache_dir"}  # flags that set a `weights:` key


def engine_process_mode(value: Any) -> EngineProcessMode:
    """`engine.engine_process` (auto, true or false; YAML's on/off and the flag's on/off too)."""
    if value is True or value in ("on", "true"):
        return "on"
    if value is False or value in ("off", "false"):
        return "off"
    if value == "auto":
        return "auto"
    raise ConfigError(f"engine_process must be auto, true or false, got {value!r}")


def weights_config(raw: Any) -> WeightLoaderConfig:
    """The `weights:` section as a WeightLoaderConfig (ConfigError naming the bad key or value)."""
    if raw is None:
        return WeightLoaderConfig()
    if not isinstance(raw, Mapping):
        raise ConfigError("weights: expected a mapping, e.g. {cache_dir: /data/cache, max_cache_size_gb: 50}")
    unknown = sorted(set(raw) - _WEIGHTS_KEYS)
    if unknown:
        raise ConfigError(
            f"unknown weights key(s): {', '.join(unknown)}; valid keys: {', '.join(sorted(_WEIGHTS_KEYS))}"
        )
    values = dict(raw)
    try:
        if values.get("max_cache_size_gb") is not None:
            values["max_cache_size_gb"] = int(float(values["max_cache_size_gb"]) * 1024**3)
        if values.get("chunk_size_mb") is not None:
            values["chunk_size_mb"] = int(float(values["chunk_size_mb"]) * MiB)
        kwargs = {_WEIGHTS_RENAMED.get(k, k): v for k, v in values.items() if v is not None}
        return WeightLoaderConfig(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid weights config: {exc}") from None


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
    weights = raw.get("weights")
    weights = dict(weights) if isinstance(weights, Mapping) else weights
    for key, value in overrides.items():
        if value is None:
            continue
        if key in _ENGINE_KEYS:
            engine[key] = value
        elif key in _FLAG_WEIGHTS_KEYS:
            weights = {**(weights if isinstance(weights, Mapping) else {}), key: value}
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
    raw["engine_process"] = engine_process_mode(engine.pop("engine_process", "auto"))
    if not raw.get("model"):
        raise ConfigError("no model given: set `model:` in the config file or pass --model PATH")
    if not isinstance(raw["model"], Mapping):
        raw["model"] = str(raw["model"])
    try:
        parse_model_location(raw["model"])
    except ModelLocationError as exc:
        raise ConfigError(str(exc)) from None
    raw["weights"] = weights_config(weights)
    try:
        raw["requirements"] = BackendRequirements.from_mapping(raw.get("requirements") or {})
        raw["port"] = int(raw.get("port", 8000))
        config = ServerConfig(**raw)
        config.engine_config()  # validates the engine section now, not after start-up
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid config: {exc}") from None
    return config
