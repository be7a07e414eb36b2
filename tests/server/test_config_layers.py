"""Every setting from defaults, a YAML file, `FERRUM_*` environment variables and flags, each layer
winning over the ones before it, key by key; bad names and values named in the error."""

from __future__ import annotations

from pathlib import Path

import pytest

from ferrum.cli import build_parser, main
from ferrum.config.loader import ConfigError, load_config
from ferrum.config.server_settings import LimitsConfig
from ferrum.engine.warm_start import take
from ferrum.weights.quantization.scheme import QuantizationConfig
from tests.engines import without_default_quantization


def flags(*argv: str) -> dict[str, object]:
    args = build_parser().parse_args(["serve", *argv])
    return {k: v for k, v in vars(args).items() if k not in ("command", "config")}


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "ferrum.yaml"
    path.write_text(text)
    return path


FILE = """
model: from/file
port: 9000
engine: {max_num_seqs: 4, dtype: float32}
limits: {max_waiting_requests: 10, overload_status: 503, max_n: 3}
api: {keys: [file-key], cors_origins: ["https://a.example"]}
logging: {format: json, level: warning}
shutdown_timeout_s: 12
"""


def test_defaults() -> None:
    config = load_config(None, {"model": "m"}, environ={})
    s = config.server
    assert (config.host, config.port, config.backend) == ("127.0.0.1", 8000, "auto")
    assert s.api.keys == () and s.api.cors_origins == () and not s.api.metrics_require_key
    assert s.limits == LimitsConfig()
    assert (s.limits.overload_status, s.limits.max_n, s.limits.request_timeout_s) == (429, 16, None)
    assert (s.logging.format, s.logging.level, s.logging.requests, s.logging.prompts) == ("text", "info", True, False)
    assert s.lifecycle.shutdown_timeout_s == 30.0
    assert config.weights.cache_dir == Path("~/.cache/ferrum").expanduser()


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    path = write(tmp_path, FILE)
    from_file = load_config(path, {}, environ={})
    assert (from_file.model, from_file.port) == ("from/file", 9000)
    assert without_default_quantization(from_file.engine) == {"max_num_seqs": 4, "dtype": "float32"}
    assert from_file.server.limits.max_waiting_requests == 10 and from_file.server.limits.overload_status == 503
    assert from_file.server.api.keys == ("file-key",) and from_file.server.logging.format == "json"
    assert from_file.server.lifecycle.shutdown_timeout_s == 12.0

    env = {
        "FERRUM_PORT": "9100",
        "FERRUM_ENGINE__MAX_NUM_SEQS": "8",
        "FERRUM_LIMITS__MAX_WAITING_REQUESTS": "20",
        "FERRUM_API_KEY": "env-key-1, env-key-2",
        "ferrum_logging__level": "debug",  # names are case-insensitive
        "FERRUM_SHUTDOWN_TIMEOUT_S": "5",
        "FERRUM_CACHE": "/somewhere",  # weights.cache_dir
        "UNRELATED": "x",
    }
    from_env = load_config(path, {}, environ=env)
    assert from_env.port == 9100
    # the file's dtype stays: key by key
    assert without_default_quantization(from_env.engine) == {"max_num_seqs": 8, "dtype": "float32"}
    assert from_env.server.limits.max_waiting_requests == 20
    assert from_env.server.limits.overload_status == 503  # from the file
    assert from_env.server.api.keys == ("env-key-1", "env-key-2")
    assert from_env.server.logging.level == "debug" and from_env.server.logging.format == "json"
    assert from_env.server.lifecycle.shutdown_timeout_s == 5.0
    assert from_env.weights.cache_dir == Path("/somewhere")

    given = flags("--port", "9200", "--max-num-seqs", "16", "--max-waiting-requests", "30", "--api-key", "flag-key",
                  "--log-level", "error", "--shutdown-timeout", "1.5", "--overload-status", "429",
                  "--cache-dir", "/flag-cache")
    from_flags = load_config(path, given, environ=env)
    assert from_flags.port == 9200
    assert without_default_quantization(from_flags.engine) == {"max_num_seqs": 16, "dtype": "float32"}
    assert from_flags.server.limits.max_waiting_requests == 30 and from_flags.server.limits.overload_status == 429
    assert from_flags.server.api.keys == ("flag-key",)
    assert from_flags.server.logging.level == "error"
    assert from_flags.server.lifecycle.shutdown_timeout_s == 1.5
    assert from_flags.weights.cache_dir == Path("/flag-cache")
    assert from_flags.model == "from/file"  # set by the file alone


def test_every_flag_lands_in_its_setting(tmp_path: Path) -> None:
    keyfile = tmp_path / "keys.txt"
    keyfile.write_text("# operators\nkey-a\n\n  key-b  \n")
    config = load_config(None, flags(
        "--model", "m", "--api-key", "k1", "--api-key", "k2", "--api-key-file", str(keyfile), "--metrics-require-key",
        "--cors-origin", "https://a.example", "--cors-origin", "https://b.example", "--root-path", "/ferrum/",
        "--max-waiting-requests", "7", "--max-waiting-tokens", "5000", "--overload-status", "503", "--retry-after", "3",
        "--max-body-mb", "0.5", "--max-tokens-limit", "100", "--max-n", "2", "--request-timeout", "9.5",
        "--shutdown-timeout", "4", "--failed-start-linger", "0", "--log-format", "json", "--log-prompts",
        "--no-log-requests", "--log-level", "warning", "--cache-dir", str(tmp_path / "cache"),
    ), environ={})
    s = config.server
    assert s.api.keys == ("k1", "k2") and s.api.all_keys() == ("k1", "k2", "key-a", "key-b")
    assert s.api.metrics_require_key and s.api.cors_origins == ("https://a.example", "https://b.example")
    assert s.api.root_path == "/ferrum"
    assert s.limits == LimitsConfig(max_waiting_requests=7, max_waiting_tokens=5000, overload_status=503,
                                    retry_after_s=3, max_body_mb=0.5, max_tokens=100, max_n=2, request_timeout_s=9.5)
    assert s.lifecycle.shutdown_timeout_s == 4.0 and s.lifecycle.failed_start_linger_s == 0.0
    logs = s.logging
    assert (logs.format, logs.prompts, logs.requests, logs.level) == ("json", True, False, "warning")
    assert config.weights.cache_dir == tmp_path / "cache"


def test_environment_values_are_yaml_and_lists_split_on_commas() -> None:
    config = load_config(None, {}, environ={
        "FERRUM_MODEL": "hf://org/name",
        "FERRUM_ENGINE__ENABLE_PREFIX_CACHING": "false",
        "FERRUM_ENGINE__KV_CACHE_MEMORY_GB": "0.5",
        "FERRUM_API__CORS_ORIGINS": "https://a.example,https://b.example",
        "FERRUM_API__METRICS_REQUIRE_KEY": "true",
        "FERRUM_LIMITS__REQUEST_TIMEOUT_S": "2.5",
        "FERRUM_WEIGHTS__MAX_CONCURRENT_DOWNLOADS": "3",
    })
    assert config.model == "hf://org/name"
    assert without_default_quantization(config.engine) == {"enable_prefix_caching": False, "kv_cache_memory_gb": 0.5}
    assert config.server.api.cors_origins == ("https://a.example", "https://b.example")
    assert config.server.api.metrics_require_key
    assert config.server.limits.request_timeout_s == 2.5
    assert config.weights.max_concurrent_downloads == 3


@pytest.mark.parametrize("environ, fragment", [
    ({"FERRUM_PROT": "1"}, "FERRUM_PROT names no setting"),
    ({"FERRUM_ENGINE__MAX_NUM_SEQ": "1"}, "FERRUM_ENGINE__MAX_NUM_SEQ names no setting"),
    ({"FERRUM_NOPE__X": "1"}, "FERRUM_NOPE__X names no setting"),
    ({"FERRUM_LIMITS__OVERLOAD_STATUS": "500"}, "overload_status must be 429 or 503"),
    ({"FERRUM_LIMITS__MAX_N": "0"}, "max_n"),
    ({"FERRUM_PORT": "[1"}, "FERRUM_PORT"),
    ({"FERRUM_LOGGING__FORMAT": "xml"}, "logging.format must be text or json"),
])
def test_bad_environment_is_named(environ: dict[str, str], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, {"model": "m"}, environ=environ)
    assert fragment in str(info.value)


@pytest.mark.parametrize("text, fragment", [
    ("model: m\nlimits: {max_waiting: 3}\n", "unknown limits key(s): max_waiting"),
    ("model: m\napi: {key: x}\n", "unknown api key(s): key"),
    ("model: m\napi: {ssl_keyfile: k.pem}\n", "give both or neither"),
    ("model: m\napi: {keys: ['']}\n", "api.keys"),
    ("model: m\napi: {key_file: /no/such/file}\n", "/no/such/file"),
    ("model: m\nlimits: {request_timeout_s: 0}\n", "request_timeout_s"),
    ("model: m\nlimits: {max_body_mb: -1}\n", "max_body_mb"),
    ("model: m\nlogging: [json]\n", "logging: expected a mapping"),
    ("model: m\nshutdown_timeout_s: -1\n", "shutdown_timeout_s"),
])
def test_bad_file_settings_are_named(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), {}, environ={})
    assert fragment in str(info.value)


def test_the_environment_is_read_when_loading_not_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRUM_PORT", "9300")
    assert load_config(None, {"model": "m"}).port == 9300
    monkeypatch.setenv("FERRUM_PORT", "9400")
    assert load_config(None, {"model": "m"}).port == 9400


QUANTIZED_FILE = """
model: m
quantization: {method: int8, group_size: 64, skip: [lm_head, down_proj]}
"""


def test_quantization_from_file_then_environment_then_flag(tmp_path: Path) -> None:
    path = write(tmp_path, QUANTIZED_FILE)
    assert load_config(None, {"model": "m"}, environ={}).engine_config().quantization == QuantizationConfig("auto")
    from_file = load_config(path, {}, environ={}).engine_config().quantization
    assert from_file == QuantizationConfig("int8", group_size=64, skip=("lm_head", "down_proj"))
    env = {"FERRUM_QUANTIZATION": "int4", "FERRUM_QUANTIZATION__SYMMETRIC": "true"}
    from_env = load_config(path, {}, environ=env).engine_config().quantization
    assert from_env == QuantizationConfig("int4", group_size=64, symmetric=True, skip=("lm_head", "down_proj"))
    from_flag = load_config(path, flags("--quantization", "fp8"), environ={"FERRUM_QUANTIZATION": "int4"})
    assert from_flag.engine_config().quantization == QuantizationConfig("fp8", 64, skip=("lm_head", "down_proj"))
    assert load_config(path, flags("--quantization", "none"), environ=env).engine_config().quantization is None
    assert load_config(path, {}, environ={"FERRUM_QUANTIZATION": "NONE"}).engine_config().quantization is None


@pytest.mark.parametrize("text", ["model: m\nquantization: int4\n", "model: m\nengine: {quantization: int4}\n",
                                  "model: m\nengine: {quantization: {method: int4}}\n"])
def test_quantization_method_alone_or_under_engine(tmp_path: Path, text: str) -> None:
    assert load_config(write(tmp_path, text), {}, environ={}).engine_config().quantization == QuantizationConfig("int4")


@pytest.mark.parametrize("given, fragment", [
    (["--quantization", "bitsandbytes"], "quantization method 'bitsandbytes': bitsandbytes' formats are not supported"),
    (["--quantization", "nf4"], "NF4 (bitsandbytes) is not supported"),
    (["--quantization", "int3"], "unknown quantization method 'int3'; valid: int8, int4, fp8 (quantized on load), "
                                 "gptq, awq, compressed-tensors, gguf (the checkpoint's own)"),
])
def test_refused_and_unknown_methods_are_named(given: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, flags("--model", "m", *given), environ={})
    assert fragment in str(info.value)


@pytest.mark.parametrize("text, fragment", [
    ("model: m\nquantization: {method: int4, group_size: 100}\n", "int4 group_size must be a power of two"),
    ("model: m\nquantization: {method: int4, groups: 64}\n", "unknown quantization key(s): groups"),
    ("model: m\nquantization: {group_size: 64}\n", "group_size given without a method"),
    ("model: m\nquantization: {method: int8, symmetric: false}\n", "symmetric: false is for int4"),
    ("model: m\nquantization: {method: int4, symmetric: maybe}\n", "quantization.symmetric must be true or false"),
    ("model: m\nquantization: [int4]\n", "quantization: expected a method name or a mapping"),
    ("model: m\nquantization: int4\nengine: {quantization: int8}\n", "quantization is set twice"),
    ("model: m\nrequirements: {quantization: [bnb]}\n", "requirements.quantization: quantization method 'bnb'"),
])
def test_bad_quantization_settings_are_named(tmp_path: Path, text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), {}, environ={})
    assert fragment in str(info.value)


def test_a_quantization_requirement_is_read(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "model: m\nrequirements: {quantization: INT4}\n"), {}, environ={})
    assert config.requirements.quantization == ("int4",)


@pytest.mark.parametrize("argv", [["serve", "--model", "m"], ["bench", "offline", "--model", "m"], ["run", "m"]])
def test_a_refused_method_exits_2_without_a_traceback(argv: list[str], capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FERRUM_QUANTIZATION", raising=False)
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--quantization", "bitsandbytes"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "error: quantization method 'bitsandbytes'" in err and "Traceback" not in err
    assert take() is None  # `serve` spawned its engine process first; nothing took it, and it was let go
