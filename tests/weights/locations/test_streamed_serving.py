"""Serving a remote model (a URL folder, an S3 prefix) not yet in the cache: only its small files
are fetched before the engine starts; the WeightLoader streams the weights into the model's
parameters while it writes the verified cache, and the model folder is then published, so that a
restart loads from the cache with no request. The loader's faults through the serving path: a cut
connection resumes; a corrupt byte or a checksum mismatch stops start-up with one message naming
the file (exit status 2) and leaves nothing in the cache."""

from __future__ import annotations

import asyncio
import hashlib
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from ferrum.engine.sampling_params import SamplingParams
from ferrum.weights.locations.uri import resolve_model
from ferrum.weights.spec.loader_config import WeightLoaderConfig
from tests.conftest import S3Bucket
from tests.engines import local_engine
from tests.fault_server import FaultServer
from tests.live_server import free_port, live_server
from tests.tiny_model import folder_files, make_tiny_llama
from tests.weights.locations.test_model_sources import (
    assert_one_clear_error,
    linked_into,
    put_folder,
    run_cli,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

PROMPT = "hello there"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("streamed") / "tiny", max_shard_size="2MB")


@pytest.fixture(scope="module")
def expected(tiny: Path) -> list[int]:
    """Greedy output of the tiny model from its local folder."""
    return _greedy(tiny)


def _greedy(location: object, config: WeightLoaderConfig | None = None) -> list[int]:
    engine = local_engine(location, weights=config, dtype="float32", kv_cache_memory_gb=0.01, max_model_len=64)
    out = engine.generate([engine.tokenizer.encode(PROMPT)], SamplingParams(max_tokens=8, temperature=0))[0]
    engine.release()
    return out


def _weight_gets(server: FaultServer) -> list[str]:
    return [r.path for r in server.requests if r.method == "GET" and r.path.endswith(".safetensors")]


async def test_url_weights_are_streamed_into_the_engine_then_served_from_the_cache(
    fault_server: FaultServer, tiny: Path, expected: list[int], tmp_path: Path
) -> None:
    files = folder_files(tiny)
    fault_server.files.update({f"tiny/{name}": data for name, data in files.items()})
    config = WeightLoaderConfig(cache_dir=tmp_path / "cache", progress="off", chunk_size=256 * 1024)
    url = fault_server.url("tiny/")

    resolved = await resolve_model(url, config)  # what the server does before it starts the engine
    assert not resolved.complete and resolved.weights.display == fault_server.url("tiny/model.safetensors.index.json")
    assert _weight_gets(fault_server) == []  # not one byte of the weights yet
    assert (resolved.folder / "config.json").is_file() and (resolved.folder / "tokenizer.json").is_file()

    fault_server.reset()
    assert _greedy(url, config) == expected
    assert sorted({p.rsplit("/", 1)[1] for p in _weight_gets(fault_server)}) == sorted(
        n for n in files if n.endswith(".safetensors")
    )  # the engine read both shards from the server, in ranged chunks

    published = await resolve_model(url, config)
    assert published.complete and published.folder.parent == config.cache_dir / "models"
    linked_into(published.folder, config.cache_dir)
    fault_server.reset()
    assert _greedy(url, config) == expected
    assert fault_server.requests == [], "a restart loads from the cache, with no request at all"


async def test_s3_weights_are_streamed_into_the_engine(
    s3_bucket: S3Bucket, tiny: Path, expected: list[int], tmp_path: Path
) -> None:
    put_folder(s3_bucket, "tiny/", folder_files(tiny))
    config = WeightLoaderConfig(cache_dir=tmp_path / "cache", progress="off")
    location = {"source": "s3", "bucket": s3_bucket.name, "prefix": "tiny", "endpoint": s3_bucket.endpoint}
    assert not (await resolve_model(location, config)).complete
    assert _greedy(location, config) == expected
    assert (await resolve_model(location, config)).complete


def _serve_args(url: str, cache: Path) -> list[str]:
    return ["--model", url, "--backend", "cpu", "--dtype", "float32", "--max-model-len", "64",
            "--kv-cache-memory-gb", "0.01", "--cache-dir", str(cache)]


@pytest.mark.slow
def test_serve_resumes_a_cut_connection(fault_server: FaultServer, tiny: Path, tmp_path: Path) -> None:
    files = folder_files(tiny)
    fault_server.files.update({f"tiny/{name}": data for name, data in files.items()})
    shard = next(n for n in files if n.startswith("model-00001"))
    fault_server.faults.cut_at_offset = len(files[shard]) // 2  # the response that crosses it is cut, once
    fault_server.faults.fault_path = f"/tiny/{shard}"
    with live_server(*_serve_args(fault_server.url("tiny/"), tmp_path / "cache")) as base:
        import httpx

        reply = httpx.post(f"{base}/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 0},
                           timeout=60).json()
        assert reply["usage"]["completion_tokens"] == 4
    assert fault_server.cuts_done == 1


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["corrupt byte", "pinned checksum"])
def test_serve_stops_on_bad_weights_naming_the_file(
    fault_server: FaultServer, tiny: Path, tmp_path: Path, fault: str
) -> None:
    files = folder_files(tiny)
    fault_server.files.update({f"tiny/{name}": data for name, data in files.items()})
    shard = next(n for n in files if n.startswith("model-00002"))
    cache = tmp_path / "cache"
    config = tmp_path / "serve.yaml"
    pins = {shard: hashlib.sha256(files[shard]).hexdigest()}
    if fault == "corrupt byte":
        fault_server.faults.corrupt_offset = len(files[shard]) - 10
        fault_server.faults.fault_path = f"/tiny/{shard}"
    else:
        pins[shard] = "ab" * 32
    config.write_text(
        f"model: {{source: url, url: '{fault_server.url('tiny/')}', sha256: {{{shard}: '{pins[shard]}'}}}}\n"
        f"weights: {{cache_dir: '{cache}'}}\n"
    )
    result = run_cli("serve", "--config", str(config), "--backend", "cpu", "--port", str(free_port()),
                     "--failed-start-linger", "0")
    assert_one_clear_error(result, shard, "sha256")
    # the small files' blobs stay (verified); nothing of the bad shard, no partial file, no model folder
    assert all(blob.stat().st_size != len(files[shard]) for blob in (cache / "blobs").glob("*"))
    partial = cache / "partial"
    assert not partial.exists() or not list(partial.glob("*.partial"))
    assert not any(p.name.startswith("url--") for p in (cache / "models").iterdir())


@pytest.mark.slow
def test_a_bad_file_takes_the_partials_of_its_siblings_with_it(
    fault_server: FaultServer, tiny: Path, tmp_path: Path
) -> None:
    """Shard 1 is still arriving (stalled mid-body) when shard 2 fails its pinned checksum: start-up
    stops, and shard 1's partial, cancelled, is deleted rather than kept for a resume."""
    files = folder_files(tiny)
    fault_server.files.update({f"tiny/{name}": data for name, data in files.items()})
    first, second = sorted(n for n in files if n.startswith("model-0000"))
    fault_server.faults.stall_at_offset = len(files[first]) // 2
    fault_server.faults.stall_s = 20.0
    fault_server.faults.fault_path = f"/tiny/{first}"
    cache = tmp_path / "cache"
    config = tmp_path / "serve.yaml"
    config.write_text(
        f"model: {{source: url, url: '{fault_server.url('tiny/')}', sha256: {{{second}: '{'ab' * 32}'}}}}\n"
        f"weights: {{cache_dir: '{cache}'}}\n"
    )
    result = run_cli("serve", "--config", str(config), "--backend", "cpu", "--port", str(free_port()),
                     "--failed-start-linger", "0")
    assert_one_clear_error(result, second, "sha256")
    assert any(r.path == f"/tiny/{first}" and r.method == "GET" for r in fault_server.requests)
    assert not list((cache / "partial").glob("*")), "no partial, progress or lock file stays"
    assert all(blob.stat().st_size not in (len(files[first]), len(files[second]))
               for blob in (cache / "blobs").glob("*"))


async def test_fetching_starts_the_downloads_that_the_load_then_joins(
    fault_server: FaultServer, tiny: Path, tmp_path: Path
) -> None:
    """`WeightLoader.fetching` (what the engine does before building the model) downloads every
    shard of a remote index with nobody loading yet; the load inside the block joins those
    downloads: each shard's bytes come over the wire once, and the tensors are the checkpoint's."""
    from safetensors.torch import load_file

    from ferrum.weights.loader import WeightLoader
    from ferrum.weights.spec.sources import Url
    from ferrum.weights.spec.tensors import TensorSpec

    files = folder_files(tiny)
    fault_server.files.update({f"tiny/{name}": data for name, data in files.items()})
    shards = sorted(n for n in files if n.endswith(".safetensors"))
    expected = {k: v for shard in shards for k, v in load_file(tiny / shard).items()}
    config = WeightLoaderConfig(cache_dir=tmp_path / "cache", progress="off", chunk_size=256 * 1024)
    index = Url(fault_server.url("tiny/model.safetensors.index.json"))
    specs = [TensorSpec(name, tuple(t.shape), t.dtype, source=replace(index, tensor_name=name))
             for name, t in expected.items()]
    async with WeightLoader(config) as loader, loader.fetching(index):
        for _ in range(500):  # both shards arrive with nobody loading
            if len(list((config.cache_dir / "blobs").glob("*"))) >= len(shards) + 1:  # + the index
                break
            await asyncio.sleep(0.01)
        else:
            pytest.fail("fetching did not download the shards")
        fault_server.reset()
        got = await loader.load_tensors(specs)
    assert _weight_gets(fault_server) == []  # the load read the shards from the downloads: no GET twice
    assert all(torch.equal(got[name], t) for name, t in expected.items())
