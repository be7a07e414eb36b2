"""The server's configuration: defaults, under a YAML file, under `FERRUM_*` environment variables,
under command-line flags (each layer overrides the ones before it, key by key).

The YAML file's sections:

    model: hf://org/name                # a model location (see ferrum/weights/locations/uri.py)
    served_model_name: name
    host: 127.0.0.1
    port: 8000
    backend: auto                       # auto | cpu | cuda | cuda:N | mps
    requirements: {dtypes: [bfloat16]}  # what the chosen backend must offer (also quantization: [int4])
    engine: {max_num_seqs: 64, ...}     # EngineConfig's fields, and engine_process: auto | true | false
    quantization: {method: int4, group_size: 128, symmetric: false, skip: [lm_head]}  # or `quantization: int8`;
                                        # also engine.quantization (ferrum.config.quantization)
    weights: {cache_dir: ..., ...}      # how remote models are fetched and cached (WeightLoaderConfig)
    api: {keys: [...], ...}             # ferrum.config.server_settings.ApiConfig
    chat: {tool_call_parser: auto, reasoning_parser: qwen3}  # ferrum.config.server_settings.ChatConfig
    limits: {max_waiting_requests: ...} # ferrum.config.server_settings.LimitsConfig
    logging: {level: info, format: text | json, requests: true, prompts: false}
    shutdown_timeout_s: 30
    failed_start_linger_s: 3

Environment variables: `FERRUM_<KEY>` sets a top-level key (`FERRUM_PORT=9000`), and
`FERRUM_<SECTION>__<KEY>` a key of a section (`FERRUM_ENGINE__MAX_NUM_SEQS=16`,
`FERRUM_LIMITS__OVERLOAD_STATUS=503`); names are case-insensitive, values are read as YAML
scalars or lists (`16`, `true`, `[a, b]`). `FERRUM_QUANTIZATION` is `quantization.method` (`int4`,
`none`). `FERRUM_API_KEY` is `api.keys`, several keys separated by commas; `FERRUM_LOG_LEVEL` is
`logging.level`; `FERRUM_CACHE` is `weights.cache_dir` (the weights cache's folder; default
~/.cache/ferrum). Another `FERRUM_*` name is an error naming it. The
environment is read when the configuration is loaded, never at import.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ferrum.backends.capabilities import BackendRequirements
from ferrum.config.quantization import QUANTIZATION_KEYS, quantization_config
from ferrum.config.server_settings import (
    ApiConfig,
    ChatConfig,
    LifecycleConfig,
    LimitsConfig,
    LoggingConfig,
    ServerSettings,
)
from ferrum.engine.config import EngineConfig
from ferrum.weights.locations.uri import ModelLocationError, model_display_name, parse_model_location
from ferrum.weights.quantization.scheme import AUTO, QuantizationConfigError, parse_method
from ferrum.weights.spec.loader_config import MiB, WeightLoaderConfig


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
    weights: WeightLoaderConfig = field(default_factory=WeightLoaderConfig)
    server: ServerSettings = field(default_factory=ServerSettings)

    @property
    def model_name(self) -> str:
        if self.served_model_name:
            return self.served_model_name
        if isinstance(self.model, str) and "://" not in self.model:
            return Path(self.model.rstrip("/")).name
        return model_display_name(self.model)

    @property
    def log_level(self) -> str:
        return self.server.logging.level

    def engine_config(self) -> EngineConfig:
        return EngineConfig.from_mapping(self.engine)


# -- the keys of each section --------------------------------------------------------------------------

_TOP_KEYS = {"model", "served_model_name", "host", "port", "backend", "requirements", "shutdown_timeout_s",
             "failed_start_linger_s"}
_ENGINE_KEYS = {f.name for f in dataclasses.fields(EngineConfig)} | {"engine_process"}
# `weights:` keys: WeightLoaderConfig's fields, with sizes in GB / MB and `headers` for default_headers
_WEIGHTS_RENAMED = {"max_cache_size_gb": "max_cache_size_bytes", "chunk_size_mb": "chunk_size",
                    "headers": "default_headers"}
_WEIGHTS_KEYS = ({f.name for f in dataclasses.fields(WeightLoaderConfig)} - set(_WEIGHTS_RENAMED.values())) | set(
    _WEIGHTS_RENAMED)
_SECTIONS: dict[str, set[str]] = {
    "engine": _ENGINE_KEYS,
    "weights": _WEIGHTS_KEYS,
    "api": {f.name for f in dataclasses.fields(ApiConfig)},
    "chat": {f.name for f in dataclasses.fields(ChatConfig)},
    "limits": {f.name for f in dataclasses.fields(LimitsConfig)},
    "logging": {f.name for f in dataclasses.fields(LoggingConfig)},
    "quantization": set(QUANTIZATION_KEYS),  # lands in the engine config's `quantization`
}
_ALIASES = {"log_level": ("logging", "level")}  # older top-level spellings, still accepted

# command-line flags (argparse dests) that set a key of a section; any other flag is a top-level key
FLAG_KEYS: dict[str, tuple[str, str]] = {
    **{key: ("engine", key) for key in _ENGINE_KEYS},
    "quantization": ("quantization", "method"),
    "cache_dir": ("weights", "cache_dir"),
    "api_keys": ("api", "keys"),
    "api_key_file": ("api", "key_file"),
    "metrics_require_key": ("api", "metrics_require_key"),
    "cors_origins": ("api", "cors_origins"),
    "root_path": ("api", "root_path"),
    "ssl_keyfile": ("api", "ssl_keyfile"),
    "ssl_certfile": ("api", "ssl_certfile"),
    "ui": ("api", "ui"),
    "tool_call_parser": ("chat", "tool_call_parser"),
    "reasoning_parser": ("chat", "reasoning_parser"),
    **{key: ("limits", key) for key in _SECTIONS["limits"]},
    "log_level": ("logging", "level"),
    "log_format": ("logging", "format"),
    "log_requests": ("logging", "requests"),
    "log_prompts": ("logging", "prompts"),
}
_ENV_PREFIX = "FERRUM_"


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
    _check_keys("weights", raw, _WEIGHTS_KEYS)
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


def _fold_quantization(raw: dict[str, Any], where: str) -> None:
    """One layer's quantization as the `quantization` section, in place: `engine.quantization` moved
    there, a bare method (`quantization: int4`, `none`, null) made `{method: ...}`."""
    engine = raw.get("engine")
    if isinstance(engine, Mapping) and "quantization" in engine:
        if "quantization" in raw:
            raise ConfigError(f"quantization is set twice in {where}: as quantization and as engine.quantization")
        engine = dict(engine)
        raw["quantization"] = engine.pop("quantization")
        raw["engine"] = engine
    if "quantization" in raw and not isinstance(raw["quantization"], Mapping):
        value = raw["quantization"]
        if not (value is None or isinstance(value, (str, bool))):
            raise ConfigError(f"quantization: expected a method name or a mapping (in {where}), got {value!r}")
        raw["quantization"] = {"method": value}


def _check_keys(section: str, raw: Mapping[str, Any], valid: set[str]) -> None:
    unknown = sorted(str(k) for k in set(raw) - valid)
    if unknown:
        raise ConfigError(f"unknown {section} key(s): {', '.join(unknown)}; valid keys: {', '.join(sorted(valid))}")


# -- the three layers ------------------------------------------------------------------------------------


def _file_layer(path: str | Path | None) -> dict[str, Any]:
    if path is None:
        return {}
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
    _fold_quantization(raw, f"config file {p}")
    for section in _SECTIONS:
        if raw.get(section) is None:
            raw.pop(section, None)
        elif not isinstance(raw[section], Mapping):
            raise ConfigError(f"{section}: expected a mapping (config file {p})")
    for alias, (section, key) in _ALIASES.items():
        if alias in raw:
            raw.setdefault(section, {})
            raw[section] = {**raw[section], key: raw.pop(alias)}
    return raw


def _env_value(name: str, text: str) -> Any:
    try:
        return yaml.safe_load(text) if text.strip() else None
    except yaml.YAMLError:
        raise ConfigError(f"environment variable {name}: {text!r} is not a YAML value") from None


def _env_layer(environ: Mapping[str, str]) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    for name, text in sorted(environ.items()):
        upper = name.upper()
        if not upper.startswith(_ENV_PREFIX):
            continue
        key = upper[len(_ENV_PREFIX):].lower()
        if key == "cache":  # FERRUM_CACHE: the weights cache's folder, a path as written
            if text.strip():
                raw.setdefault("weights", {})["cache_dir"] = text
            continue
        if key == "api_key":
            keys = [k.strip() for k in text.split(",") if k.strip()]
            raw.setdefault("api", {})["keys"] = keys
            continue
        if key == "quantization":  # FERRUM_QUANTIZATION: the method (int8, int4, fp8, none)
            raw.setdefault("quantization", {})["method"] = text.strip()
            continue
        if key in _ALIASES:
            section, sub = _ALIASES[key]
            raw.setdefault(section, {})[sub] = _env_value(name, text)
            continue
        if "__" in key:
            section, sub = key.split("__", 1)
            if section not in _SECTIONS or sub not in _SECTIONS[section]:
                raise ConfigError(f"environment variable {name} names no setting ({section}.{sub})")
            value = _env_value(name, text)
            if section == "api" and sub in ("keys", "cors_origins") and isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            raw.setdefault(section, {})[sub] = value
            continue
        if key not in _TOP_KEYS:
            raise ConfigError(
                f"environment variable {name} names no setting; use FERRUM_<KEY> for one of "
                f"{', '.join(sorted(_TOP_KEYS))} or FERRUM_<SECTION>__<KEY> for a key of "
                f"{', '.join(sorted(_SECTIONS))}"
            )
        raw[key] = text if key in ("model", "served_model_name", "host", "backend") else _env_value(name, text)
    _fold_quantization(raw, "the environment")
    return raw


def _flag_layer(overrides: Mapping[str, Any]) -> dict[str, Any]:
    raw: dict[str, Any] = {}
    for key, value in overrides.items():
        if value is None:
            continue
        if key in FLAG_KEYS:
            section, sub = FLAG_KEYS[key]
            raw.setdefault(section, {})[sub] = value
        else:
            raw[key] = value
    return raw


def _merged(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Later layers win, key by key inside sections."""
    out: dict[str, Any] = {}
    for layer in layers:
        for key, value in layer.items():
            if key in _SECTIONS and isinstance(value, Mapping):
                out[key] = {**out.get(key, {}), **value}
            else:
                out[key] = value
    return out


def load_config(
    path: str | Path | None, overrides: Mapping[str, Any], environ: Mapping[str, str] | None = None
) -> ServerConfig:
    """Reads `path` (if given), then `environ` (default: os.environ, read now), then `overrides`
    (flags by argparse dest; None values are ignored); each wins over the ones before it. Relative
    model paths are taken relative to the working directory."""
    raw = _merged(_file_layer(path), _env_layer(os.environ if environ is None else environ), _flag_layer(overrides))

    unknown = sorted(set(raw) - _TOP_KEYS - set(_SECTIONS))
    if unknown:
        valid = sorted(_TOP_KEYS | set(_SECTIONS))
        raise ConfigError(f"unknown config key(s): {', '.join(unknown)}; valid keys: {', '.join(valid)}")
    for section, valid_keys in _SECTIONS.items():
        _check_keys(section, raw.get(section, {}), valid_keys)

    engine = dict(raw.pop("engine", {}))
    engine_process = engine_process_mode(engine.pop("engine_process", "auto"))
    section = raw.pop("quantization", {"method": AUTO})  # the server's default: the engine chooses for its device
    quantization = _quantization(section)
    if quantization is not None:
        engine["quantization"] = quantization
    if not raw.get("model"):
        raise ConfigError("no model given: set `model:` in the config file, FERRUM_MODEL, or pass --model PATH")
    if not isinstance(raw["model"], Mapping):
        raw["model"] = str(raw["model"])
    try:
        parse_model_location(raw["model"])
    except ModelLocationError as exc:
        raise ConfigError(str(exc)) from None
    weights = weights_config(raw.pop("weights", None))
    log_settings: dict[str, Any] = {k: str(v) if k == "level" else v for k, v in raw.pop("logging", {}).items()}
    try:
        server = ServerSettings(
            api=_api(raw.pop("api", {})),
            chat=ChatConfig(**raw.pop("chat", {})),
            limits=LimitsConfig(**raw.pop("limits", {})),
            logging=LoggingConfig(**log_settings),
            lifecycle=LifecycleConfig(
                **{k: float(raw.pop(k)) for k in ("shutdown_timeout_s", "failed_start_linger_s") if k in raw}
            ),
        )
        raw["requirements"] = _requirements(raw.get("requirements") or {})
        raw["port"] = int(raw.get("port", 8000))
        config = ServerConfig(**raw, engine=engine, engine_process=engine_process, weights=weights, server=server)
        config.engine_config()  # validates the engine section now, not after start-up
        server.api.all_keys()  # a key file that cannot be read is named now
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"invalid config: {exc}") from None
    return config


def _quantization(raw: Mapping[str, Any]) -> dict[str, Any] | None:
    """The merged `quantization` section, checked, as EngineConfig.from_mapping takes it; None: off."""
    try:
        config = quantization_config(raw)
    except QuantizationConfigError as exc:
        raise ConfigError(str(exc)) from None
    return None if config is None else dataclasses.asdict(config)


def _requirements(raw: Mapping[str, Any]) -> BackendRequirements:
    requirements = BackendRequirements.from_mapping(raw)
    for method in requirements.quantization:
        try:
            parse_method(method)
        except QuantizationConfigError as exc:
            raise ConfigError(f"requirements.quantization: {exc}") from None
    return requirements


def _api(raw: Mapping[str, Any]) -> ApiConfig:
    values = dict(raw)
    for key in ("keys", "cors_origins"):
        if key in values:
            value = values[key]
            items = [value] if isinstance(value, str) else list(value or ())
            values[key] = tuple(str(v) for v in items)
    for key in ("key_file", "ssl_keyfile", "ssl_certfile"):
        if values.get(key) is not None:
            values[key] = Path(str(values[key])).expanduser()
    if values.get("root_path") is not None:
        values["root_path"] = str(values["root_path"]).rstrip("/")
    return ApiConfig(**values)
