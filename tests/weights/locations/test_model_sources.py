"""Model locations end to end: `resolve_model_folder`, `ferrum pull` and `ferrum serve --model` with a
model kept on a Hugging Face Hub (olah, offline, on loopback), in S3 (moto) and behind an HTTP
server (the fault server), each started by the tests. For each source the demo model served from the
fetched folder must give the same greedy output as from the local folder.

olah's limits (see tests/hub_mirror.py) matter here in one place: a missing repository, file or
revision all come back from it as 401 "repository not found", so the not-found checks for the Hub
look for the repository's name, not for a more precise reason.
"""

from __future__ import annotations

import hashlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from ferrum.config.loader import ConfigError, load_config
from ferrum.engine.sampling_params import SamplingParams
from ferrum.weights import WeightLoaderConfig
from ferrum.weights.errors import IntegrityError, SourceNotFoundError
from ferrum.weights.locations.model_files import local_model_folder
from ferrum.weights.locations.uri import (
    ModelLocationError,
    model_display_name,
    parse_model_location,
    resolve_model_folder,
)
from ferrum.weights.spec.sources import S3, File, HuggingFace, Url
from tests.conftest import S3Bucket
from tests.engines import local_engine
from tests.fault_server import FaultServer
from tests.hub_mirror import HubMirror, olah_server
from tests.live_server import free_port
from tests.tiny_model import folder_files, make_tiny_llama

ROOT = Path(__file__).resolve().parents[3]
DEMO = ROOT / "models" / "SmolLM2-135M-Instruct"
QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "What is 2+2?"]
needs_demo = pytest.mark.skipif(not (DEMO / "model.safetensors").is_file(), reason="demo model not present")


# ------------------------------------------------------------------------------------------ helpers


@pytest.fixture(scope="module", autouse=True)
def one_thread() -> Iterator[None]:
    # 2 cores shared with other work: one intra-op thread keeps matmuls from waiting on a busy neighbour
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def greedy(folder: Path) -> list[list[int]]:
    engine = local_engine(folder, dtype="float32", kv_cache_memory_gb=0.05, max_model_len=512)
    prompts = [engine.tokenizer.encode_chat([{"role": "user", "content": q}]) for q in QUESTIONS]
    out = engine.generate(prompts, SamplingParams(max_tokens=16, temperature=0))
    del engine
    return out


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """Greedy output of the demo model from its local folder."""
    if not (DEMO / "model.safetensors").is_file():
        pytest.skip("demo model not present")
    return greedy(DEMO)


@pytest.fixture(scope="module")
def demo_files() -> dict[str, bytes]:
    if not (DEMO / "model.safetensors").is_file():
        pytest.skip("demo model not present")
    return folder_files(DEMO)


@pytest.fixture
def config(tmp_path: Path) -> WeightLoaderConfig:
    return WeightLoaderConfig(cache_dir=tmp_path / "cache", progress="off", max_retries=1)


def run_cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ferrum.cli", *args],
        check=False,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=dict(os.environ),
    )


def assert_one_clear_error(result: subprocess.CompletedProcess[str], *fragments: str) -> None:
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    lines = [line for line in result.stderr.splitlines() if line.startswith("ferrum: error:")]
    assert len(lines) == 1, result.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def disk_verdict(folder: Path, files: dict[str, bytes]) -> str:
    """The message that refuses a folder on disk holding `files` (written into `folder`)."""
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    with pytest.raises(SourceNotFoundError) as info:
        local_model_folder(folder)
    return info.value.message


def linked_into(folder: Path, cache: Path) -> None:
    """Every file of a remote model's folder is a link to a verified blob of the download cache."""
    for path in folder.iterdir():
        if path.name.startswith("."):
            continue
        assert path.is_symlink(), path
        assert path.resolve().parent == (cache / "blobs").resolve(), path.resolve()


# ------------------------------------------------------------------------------------------ parsing


@pytest.mark.parametrize(
    "text, expected, name",
    [
        (
            "hf://HuggingFaceTB/SmolLM2-135M-Instruct",
            HuggingFace("HuggingFaceTB/SmolLM2-135M-Instruct", ""),
            "SmolLM2-135M-Instruct",
        ),
        ("hf://org/name@v1.0", HuggingFace("org/name", "", "v1.0"), "name"),
        ("hf://gpt2@refs/pr/1", HuggingFace("gpt2", "", "refs/pr/1"), "gpt2"),
        ("s3://bucket/models/demo", S3("bucket", "models/demo/"), "demo"),
        ("s3://bucket", S3("bucket", ""), "bucket"),
        ("https://host:8443/models/demo", Url("https://host:8443/models/demo/"), "demo"),
        ("http://host/demo/?token=x", Url("http://host/demo/?token=x"), "demo"),
        ("models/demo", File(Path("models/demo")), "demo"),
        ("file:///srv/models/demo", File(Path("/srv/models/demo")), "demo"),
        (
            {"source": "hf", "repo": "org/name", "revision": "abc1234"},
            HuggingFace("org/name", "", "abc1234"),
            "name",
        ),
        (
            {
                "source": "s3",
                "bucket": "bkt",
                "prefix": "p/q",
                "region": "eu-west-1",
                "endpoint": "http://127.0.0.1:9",
            },
            S3("bkt", "p/q/", "eu-west-1", "http://127.0.0.1:9"),
            "q",
        ),
        ({"source": "local", "path": "models/demo"}, File(Path("models/demo")), "demo"),
    ],
)
def test_locations_are_parsed(text: object, expected: object, name: str) -> None:
    assert parse_model_location(text) == expected  # type: ignore[arg-type]
    assert model_display_name(text) == name  # type: ignore[arg-type]


def test_url_mapping_keeps_pins_and_headers() -> None:
    digest = "AB" * 32
    loc = parse_model_location(
        {
            "source": "url",
            "url": "https://h/m",
            "sha256": {"model.safetensors": digest},
            "headers": {"Authorization": "Bearer t"},
        }
    )
    assert isinstance(loc, Url)
    assert loc.url == "https://h/m/" and dict(loc.pins) == {"model.safetensors": digest.lower()}
    child = loc.child("model.safetensors")
    assert child.url == "https://h/m/model.safetensors" and child.sha256 == digest.lower()
    assert dict(child.headers) == {"Authorization": "Bearer t"}


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("ftp://host/model", "unsupported scheme ftp://"),
        ("hf://a/b/c", "repo_id must look like 'org/name'"),
        ("s3://Not_A_Bucket/x", "not a valid bucket name"),
        ("https://host/model.safetensors", "the model's folder"),
        ({"source": "gcs", "bucket": "bkt"}, "must be one of hf, s3, url, local"),
        ({"source": "s3", "prefix": "p"}, "`bucket` is required"),
        ({"source": "url", "url": "https://h/", "bogus": 1}, "unknown key(s) bogus"),
        ({"source": "url", "url": "https://h/", "sha256": {"model.safetensors": 0}}, "quote it in YAML"),
    ],
)
def test_bad_locations_are_explained(text: object, fragment: str) -> None:
    with pytest.raises(ModelLocationError) as info:
        parse_model_location(text)  # type: ignore[arg-type]
    assert fragment in str(info.value)


def test_config_file_takes_a_location_mapping_and_a_weights_section(tmp_path: Path) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(
        "model: {source: s3, bucket: my-models, prefix: demo}\n"
        "weights: {cache_dir: /tmp/x, max_cache_size_gb: 2, chunk_size_mb: 8, max_concurrent_downloads: 3}\n"
    )
    config = load_config(cfg, {})
    assert config.model == {"source": "s3", "bucket": "my-models", "prefix": "demo"}
    assert config.model_name == "demo"
    assert config.weights.cache_dir == Path("/tmp/x") and config.weights.max_cache_size_bytes == 2 * 1024**3
    assert config.weights.chunk_size == 8 * 1024**2 and config.weights.max_concurrent_downloads == 3
    assert load_config(cfg, {"cache_dir": "/tmp/y"}).weights.cache_dir == Path("/tmp/y")  # --cache-dir wins


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("model: m\nweights: {cache_size: 3}\n", "unknown weights key(s): cache_size"),
        ("model: m\nweights: {max_concurrent_downloads: 0}\n", "max_concurrent_downloads"),
        ("model: m\nweights: [1]\n", "weights: expected a mapping"),
        ("model: ftp://x/y\n", "unsupported scheme ftp://"),
    ],
)
def test_bad_weights_sections_and_locations_in_config_files(tmp_path: Path, text: str, fragment: str) -> None:
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(cfg, {})
    assert fragment in str(info.value)


@pytest.mark.parametrize("name", ["s3.yaml", "hf.yaml", "url.yaml"])
def test_example_configs_are_valid(name: str) -> None:
    config = load_config(ROOT / "config" / "examples" / name, {})
    assert config.model_name == "SmolLM2-135M-Instruct"
    assert not isinstance(parse_model_location(config.model), File)


# ------------------------------------------------------------------------------------------ local


async def test_local_folder_is_used_where_it_is(config: WeightLoaderConfig, tmp_path: Path) -> None:
    assert await resolve_model_folder(str(DEMO), config) == DEMO
    with pytest.raises(SourceNotFoundError) as info:
        await resolve_model_folder("org-x/model-y", config)
    assert "no config.json" in str(info.value) and "hf://org-x/model-y" in str(info.value)
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceNotFoundError, match="no config.json"):
        await resolve_model_folder(tmp_path / "empty", config)


# ------------------------------------------------------------------------------------------ HTTP


@needs_demo
@pytest.mark.slow
async def test_url_folder_serves_the_demo_like_the_local_folder(
    fault_server: FaultServer,
    demo_files: dict[str, bytes],
    reference: list[list[int]],
    config: WeightLoaderConfig,
) -> None:
    fault_server.files.update({f"models/demo/{name}": data for name, data in demo_files.items()})
    folder = await resolve_model_folder(fault_server.url("models/demo/"), config)
    assert folder.parent == config.cache_dir / "models"
    assert folder_files(folder) == {
        **demo_files,
        ".ferrum-model.json": (folder / ".ferrum-model.json").read_bytes(),
    }
    linked_into(folder, config.cache_dir)
    assert greedy(folder) == reference

    fault_server.reset()
    assert await resolve_model_folder(fault_server.url("models/demo"), config) == folder
    assert fault_server.requests == [], "a second resolve must be a cache hit, with no request at all"


async def test_url_sharded_model_with_pins_and_missing_optional_files(
    fault_server: FaultServer, tmp_path: Path, config: WeightLoaderConfig
) -> None:
    tiny = make_tiny_llama(tmp_path / "tiny", max_shard_size="2MB")
    (tiny / "chat_template.jinja").unlink()  # optional files may be missing
    (tiny / "generation_config.json").unlink()
    files = folder_files(tiny)
    assert len([n for n in files if n.startswith("model-")]) == 2
    fault_server.files.update({f"tiny/{name}": data for name, data in files.items()})
    pins = {
        name: hashlib.sha256(data).hexdigest()
        for name, data in files.items()
        if name.endswith(".safetensors")
    }
    location = {"source": "url", "url": fault_server.url("tiny/"), "sha256": pins}
    folder = await resolve_model_folder(location, config)
    got = folder_files(folder)
    got.pop(".ferrum-model.json")
    assert got == files
    assert greedy_tiny(folder) == greedy_tiny(tiny)

    bad = {**pins, "model-00002-of-00002.safetensors": "0" * 64}
    with pytest.raises(IntegrityError) as info:
        await resolve_model_folder({**location, "sha256": bad}, config)
    assert "model-00002-of-00002.safetensors" in str(info.value)


def greedy_tiny(folder: Path) -> list[list[int]]:
    engine = local_engine(folder, dtype="float32", kv_cache_memory_gb=0.01, max_model_len=64)
    return engine.generate(
        [engine.tokenizer.encode("hello there")], SamplingParams(max_tokens=8, temperature=0)
    )


async def test_url_folder_rebuilt_when_a_blob_was_evicted(
    fault_server: FaultServer, tmp_path: Path, config: WeightLoaderConfig
) -> None:
    tiny = make_tiny_llama(tmp_path / "tiny")
    fault_server.files.update({f"m/{name}": data for name, data in folder_files(tiny).items()})
    folder = await resolve_model_folder(fault_server.url("m/"), config)
    (folder / "model.safetensors").resolve().unlink()  # what LRU eviction of the download cache does
    fault_server.reset()
    again = await resolve_model_folder(fault_server.url("m/"), config)
    assert (
        again == folder
        and (again / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()
    )
    assert fault_server.count("GET") > 0


async def test_url_missing_files_are_named(
    fault_server: FaultServer, tmp_path: Path, config: WeightLoaderConfig
) -> None:
    tiny = make_tiny_llama(tmp_path / "tiny")
    files = folder_files(tiny)
    no_config = {n: d for n, d in files.items() if n != "config.json"}
    no_weights = {n: d for n, d in files.items() if n != "model.safetensors"}
    fault_server.files.update({f"no-config/{n}": d for n, d in no_config.items()})
    fault_server.files.update({f"no-weights/{n}": d for n, d in no_weights.items()})
    # the verdict and message of the same files on disk (model_files.model_folder_files)
    with pytest.raises(SourceNotFoundError) as info:
        await resolve_model_folder(fault_server.url("no-config/"), config)
    assert info.value.where == fault_server.url("no-config/")
    assert info.value.message == disk_verdict(tmp_path / "no-config", no_config)
    assert "no config.json" in info.value.message
    with pytest.raises(SourceNotFoundError) as info:
        await resolve_model_folder(fault_server.url("no-weights/"), config)
    assert info.value.message == disk_verdict(tmp_path / "no-weights", no_weights)
    assert "no weights" in str(info.value) and "model.safetensors" in str(info.value)


# ------------------------------------------------------------------------------------------ S3


def put_folder(bucket: S3Bucket, prefix: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        bucket.put(f"{prefix}{name}", data, ChecksumAlgorithm="SHA256")


@needs_demo
@pytest.mark.slow
async def test_s3_serves_the_demo_like_the_local_folder(
    s3_bucket: S3Bucket, demo_files: dict[str, bytes], reference: list[list[int]], config: WeightLoaderConfig
) -> None:
    put_folder(s3_bucket, "models/demo/", demo_files)
    location = {
        "source": "s3",
        "bucket": s3_bucket.name,
        "prefix": "models/demo",
        "endpoint": s3_bucket.endpoint,
    }
    folder = await resolve_model_folder(location, config)
    linked_into(folder, config.cache_dir)
    assert greedy(folder) == reference
    assert await resolve_model_folder(location, config) == folder


async def test_s3_uri_uses_the_aws_environment(
    s3_bucket: S3Bucket, tmp_path: Path, config: WeightLoaderConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny = make_tiny_llama(tmp_path / "tiny")
    put_folder(s3_bucket, "tiny/", folder_files(tiny))
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_bucket.endpoint)
    folder = await resolve_model_folder(f"s3://{s3_bucket.name}/tiny", config)
    assert (folder / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()
    with pytest.raises(SourceNotFoundError) as info:
        await resolve_model_folder(f"s3://{s3_bucket.name}/nothing-here", config)
    assert info.value.where == f"s3://{s3_bucket.name}/nothing-here/"
    assert info.value.message.startswith("not a model folder: no config.json")


# ------------------------------------------------------------------------------------------ Hub


@dataclass(frozen=True)
class Hub:
    endpoint: str
    tiny_v1: str
    tiny_main: str
    tiny_files_v1: dict[str, bytes]
    tiny_files_main: dict[str, bytes]
    hf_home: Path  # shared by the Hub tests of this module: the demo is fetched once


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    root = tmp_path_factory.mktemp("hub")
    mirror = HubMirror(root)
    if (DEMO / "model.safetensors").is_file():
        demo = mirror.create_repo("demo/SmolLM2-135M-Instruct")
        demo.put({p.name: p for p in DEMO.iterdir()})  # model.safetensors and tokenizer.json go to LFS
        demo.commit("the demo model")
    tiny = mirror.create_repo("acme/tiny-sharded")
    first = make_tiny_llama(root / "seed0", seed=0, max_shard_size="2MB")
    second = make_tiny_llama(root / "seed1", seed=1, max_shard_size="2MB")
    tiny.put({p.name: p for p in first.iterdir()})
    tiny.put({"README.md": b"---\nlicense: apache-2.0\n---\ntiny\n", "extra/unused.bin": os.urandom(2 << 20)})
    v1 = tiny.commit("seed 0")
    tiny.git("tag", "v1")
    tiny.put({p.name: p for p in second.iterdir()})
    main = tiny.commit("seed 1")
    broken = mirror.create_repo("acme/no-weights")
    broken.put({name: data for name, data in folder_files(first).items() if not name.startswith("model")})
    broken.commit("config and tokenizer only")
    unindexed = mirror.create_repo("acme/shards-no-index")
    unindexed.put({n: data for n, data in folder_files(first).items() if not n.endswith("index.json")})
    unindexed.commit("shards without their index")
    with olah_server(mirror) as server:
        yield Hub(server.endpoint, v1, main, folder_files(first), folder_files(second), root / "hf-home")


@pytest.fixture
def hf_env(hub: Hub, monkeypatch: pytest.MonkeyPatch) -> Hub:
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    monkeypatch.setenv("HF_HOME", str(hub.hf_home))
    for name in ("HF_HUB_OFFLINE", "HF_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    return hub


@needs_demo
@pytest.mark.slow
async def test_hub_serves_the_demo_like_the_local_folder(
    hf_env: Hub, reference: list[list[int]], config: WeightLoaderConfig
) -> None:
    folder = await resolve_model_folder("hf://demo/SmolLM2-135M-Instruct", config)
    assert folder.parent.name == "snapshots" and str(folder).startswith(str(hf_env.hf_home / "hub"))
    assert greedy(folder) == reference


@pytest.mark.parametrize("revision", ["v1", "main", "V1_COMMIT"])
async def test_hub_revisions_and_only_the_needed_files(
    hf_env: Hub, config: WeightLoaderConfig, revision: str
) -> None:
    rev = hf_env.tiny_v1 if revision == "V1_COMMIT" else revision
    files = hf_env.tiny_files_main if revision == "main" else hf_env.tiny_files_v1
    folder = await resolve_model_folder(f"hf://acme/tiny-sharded@{rev}", config)
    assert folder.name == (hf_env.tiny_main if revision == "main" else hf_env.tiny_v1)
    assert folder_files(folder) == files  # README.md and extra/unused.bin were not fetched


async def test_hub_model_folder_offline_after_a_pull(
    hf_env: Hub, config: WeightLoaderConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    online = await resolve_model_folder("hf://acme/tiny-sharded@v1", config)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")  # nothing may be asked
    assert await resolve_model_folder("hf://acme/tiny-sharded@v1", config) == online
    with pytest.raises(SourceNotFoundError) as info:
        await resolve_model_folder("hf://acme/never-fetched", config)
    assert "HF_HUB_OFFLINE" in str(info.value)


async def test_hub_errors_name_the_repository(
    hf_env: Hub, config: WeightLoaderConfig, tmp_path: Path
) -> None:
    with pytest.raises(SourceNotFoundError) as info:
        await resolve_model_folder("hf://acme/no-such-model", config)
    assert "acme/no-such-model" in str(info.value)
    # a repository that is no model folder gets the verdict and message the same files get on disk
    files = hf_env.tiny_files_v1
    for repo, kept in [
        ("acme/no-weights", {n: d for n, d in files.items() if not n.startswith("model")}),
        ("acme/shards-no-index", {n: d for n, d in files.items() if not n.endswith("index.json")}),
    ]:
        with pytest.raises(SourceNotFoundError) as info:
            await resolve_model_folder(f"hf://{repo}", config)
        assert info.value.where == f"hf://{repo}"
        assert info.value.message == disk_verdict(tmp_path / repo, kept)
        assert "no weights" in info.value.message


# ------------------------------------------------------------------------------------------ CLI


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_pull_prints_the_local_folder(
    fault_server: FaultServer, s3_bucket: S3Bucket, tmp_path: Path
) -> None:
    tiny = make_tiny_llama(tmp_path / "tiny")
    fault_server.files.update({f"tiny/{name}": data for name, data in folder_files(tiny).items()})
    cache = tmp_path / "cache"
    result = run_cli("pull", fault_server.url("tiny/"), "--cache-dir", str(cache))
    assert result.returncode == 0, result.stderr
    folder = Path(result.stdout.strip())
    assert folder.parent == cache / "models" and (folder / "config.json").is_file()

    put_folder(s3_bucket, "tiny/", folder_files(tiny))
    cfg = tmp_path / "s3.yaml"
    cfg.write_text(
        f"model: {{source: s3, bucket: {s3_bucket.name}, prefix: tiny, endpoint: '{s3_bucket.endpoint}'}}\n"
        f"weights: {{cache_dir: '{cache}'}}\n"
    )
    result = run_cli("pull", "--config", str(cfg))
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()).name.startswith(f"s3--{s3_bucket.name}-tiny")


async def test_pull_and_serve_errors_exit_2_with_one_line(
    fault_server: FaultServer,
    s3_bucket: S3Bucket,
    hf_env: Hub,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = str(tmp_path / "cache")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", s3_bucket.endpoint)
    # not found: an unknown Hub repository (olah: 401 "repository not found"); no model folder: S3, a URL
    assert_one_clear_error(
        run_cli("pull", "hf://acme/no-such-model", "--cache-dir", cache), "acme/no-such-model", "not found"
    )
    assert_one_clear_error(
        run_cli("pull", f"s3://{s3_bucket.name}/missing", "--cache-dir", cache),
        f"s3://{s3_bucket.name}/missing/: not a model folder: no config.json",
    )
    assert_one_clear_error(
        run_cli("pull", fault_server.url("nothing/"), "--cache-dir", cache),
        f"{fault_server.url('nothing/')}: not a model folder: no config.json",
    )
    assert_one_clear_error(
        run_cli(
            "serve",
            "--model",
            "hf://acme/no-such-model",
            "--backend",
            "cpu",
            "--port",
            str(free_port()),
            "--failed-start-linger",
            "0",
            "--cache-dir",
            cache,
        ),
        "acme/no-such-model",
    )
    assert_one_clear_error(
        run_cli(
            "serve",
            "--model",
            fault_server.url("nothing/"),
            "--backend",
            "cpu",
            "--port",
            str(free_port()),
            "--failed-start-linger",
            "0",
            "--cache-dir",
            cache,
        ),
        "not a model folder: no config.json",
    )
    # integrity: a pinned sha256 the file does not have
    tiny = make_tiny_llama(tmp_path / "tiny")
    fault_server.files.update({f"tiny/{name}": data for name, data in folder_files(tiny).items()})
    cfg = tmp_path / "pinned.yaml"
    cfg.write_text(
        f"model: {{source: url, url: '{fault_server.url('tiny/')}', "
        f"sha256: {{model.safetensors: '{'ab' * 32}'}}}}\nweights: {{cache_dir: '{cache}'}}\n"
    )
    assert_one_clear_error(run_cli("pull", "--config", str(cfg)), "model.safetensors", "sha256")
    # unavailable: nothing listens there (no retries, to keep it short)
    cfg = tmp_path / "down.yaml"
    cfg.write_text(
        f"model: http://127.0.0.1:{_closed_port()}/m/\nweights: {{cache_dir: '{cache}', max_retries: 0}}\n"
    )
    assert_one_clear_error(run_cli("pull", "--config", str(cfg)), "127.0.0.1")
    # a location that is not one
    assert_one_clear_error(run_cli("pull", "ftp://host/m"), "unsupported scheme ftp://")


@needs_demo
@pytest.mark.slow
def test_serve_a_hub_model_end_to_end(hf_env: Hub, tmp_path: Path) -> None:
    """`ferrum serve --model hf://...` fetches the model through huggingface_hub and answers."""
    openai = pytest.importorskip("openai")
    from tests.live_server import live_server

    with live_server(
        "--model",
        "hf://demo/SmolLM2-135M-Instruct",
        "--backend",
        "cpu",
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--kv-cache-memory-gb",
        "0.05",
        "--cache-dir",
        str(tmp_path / "cache"),
    ) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        assert client.models.list().data[0].id == "SmolLM2-135M-Instruct"
        reply = client.chat.completions.create(
            model="SmolLM2-135M-Instruct",
            messages=[{"role": "user", "content": QUESTIONS[0]}],
            temperature=0,
            max_tokens=16,
        )
        assert "Paris" in (reply.choices[0].message.content or "")
