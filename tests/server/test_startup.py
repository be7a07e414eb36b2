"""`ferrum serve` start-up: config handling and the errors a user sees before anything is served."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ferrum.config.loader import ConfigError, load_config
from tests.engines import host_device, without_default_quantization
from tests.live_server import free_port

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "models" / "SmolLM2-135M-Instruct"


def run_serve(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`ferrum serve ARGS` to its end (a failed start exits at once: no linger)."""
    return subprocess.run(
        [sys.executable, "-m", "ferrum.cli", "serve", *args, "--failed-start-linger", "0"],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
    )


def test_flags_override_the_config_file(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: some/folder\nport: 9000\nbackend: cpu\nengine: {max_num_seqs: 4, dtype: float32}\n")
    config = load_config(cfg, {"port": 9100, "host": None, "max_num_seqs": 8})
    assert config.port == 9100  # flag wins
    assert config.host == "127.0.0.1"  # None flag leaves the default
    assert config.backend == "cpu"
    assert without_default_quantization(config.engine) == {"max_num_seqs": 8, "dtype": "float32"}
    assert config.model_name == "folder"


def test_gpu_engine_flags_reach_the_engine_config() -> None:
    from ferrum.cli import build_parser

    args = build_parser().parse_args(
        ["serve", "--model", "m", "--gpu-memory-utilization", "0.5", "--enforce-eager", "--no-prefix-caching",
         "--max-num-batched-tokens", "2048"]
    )
    overrides = {k: v for k, v in vars(args).items() if k not in ("command", "config")}
    engine = load_config(None, overrides).engine_config()
    assert (engine.gpu_memory_utilization, engine.enforce_eager, engine.enable_prefix_caching) == (0.5, True, False)
    assert engine.max_num_batched_tokens == 2048
    gpu = dataclasses.replace(host_device(), name="cuda:0", kind="cuda", cuda_graphs=True)
    defaults = load_config(None, {"model": "m"}).engine_config().for_device(gpu)
    assert defaults.gpu_memory_utilization == 0.9
    assert (defaults.enforce_eager, defaults.enable_prefix_caching) == (False, True)
    assert (defaults.max_num_seqs, defaults.max_num_batched_tokens) == (256, 8192)


def test_default_config_file_is_valid() -> None:
    config = load_config(ROOT / "config" / "default.yaml", {})
    assert config.model == "models/SmolLM2-135M-Instruct"
    assert config.engine_config().block_size == 16


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("model: m\nbogus: 1\n", "unknown config key(s): bogus"),
        ("model: m\nengine: {max_num_seq: 4}\n", "unknown engine key(s): max_num_seq"),
        ("model: m\nrequirements: {dtypes: [float7]}\n", "dtypes"),
        ("model: m\nengine: {block_size: 0}\n", "block_size"),
        ("port: 8000\n", "no model given"),
        ("- a\n- b\n", "expected a mapping"),
        ("model: [unclosed\n", "not valid YAML"),
    ],
)
def test_bad_config_files_are_named_and_explained(tmp_path: Path, text: str, fragment: str) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(cfg, {})
    assert fragment in str(info.value)


def test_missing_backend_fails_with_one_clear_message() -> None:
    result = run_serve("--model", str(DEMO), "--backend", "cuda", "--port", str(free_port()))
    assert result.returncode == 2
    err = result.stderr
    assert "Traceback" not in err
    assert "ferrum: error:" in err
    assert "'cuda' was requested" in err
    assert "Available backends" in err and "cpu" in err  # lists what the machine has


def test_unmet_requirements_name_the_failed_requirement(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"model: {DEMO}\nrequirements: {{requires_flash_attention: true}}\n")
    result = run_serve("--config", str(cfg), "--port", str(free_port()))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "flash attention" in result.stderr
    assert "cpu" in result.stderr


def test_invalid_backend_spec_lists_valid_forms() -> None:
    result = run_serve("--model", str(DEMO), "--backend", "tpu", "--port", str(free_port()))
    assert result.returncode == 2
    assert "invalid backend 'tpu'" in result.stderr and "cuda:N" in result.stderr


def test_missing_model_folder(tmp_path: Path) -> None:
    result = run_serve("--model", str(tmp_path / "nope"), "--backend", "cpu", "--port", str(free_port()))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "nope" in result.stderr and "config.json" in result.stderr


def test_unsupported_architecture_names_the_supported_ones(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    result = run_serve("--model", str(tmp_path), "--backend", "cpu", "--port", str(free_port()))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "GPT2LMHeadModel" in result.stderr
    for name in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert name in result.stderr


def test_missing_weights_name_the_folder(tmp_path: Path) -> None:
    config = json.loads((DEMO / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((DEMO / name).read_bytes())
    result = run_serve("--model", str(tmp_path), "--backend", "cpu", "--port", str(free_port()))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert str(tmp_path) in result.stderr and "safetensors" in result.stderr


def test_corrupt_weights_name_the_file(tmp_path: Path) -> None:
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_bytes((DEMO / name).read_bytes())
    (tmp_path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    result = run_serve("--model", str(tmp_path), "--backend", "cpu", "--port", str(free_port()))
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert "model.safetensors" in result.stderr


def test_default_config_serves_the_demo_model_in_its_default_dtype() -> None:
    """What `make serve` runs (config/default.yaml, dtype auto: bf16 where the CPU has bf16 units)."""
    openai = pytest.importorskip("openai")
    from tests.live_server import live_server

    with live_server("--config", "config/default.yaml") as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_tokens=24,
        )
        assert "Paris" in (reply.choices[0].message.content or "")
        assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
