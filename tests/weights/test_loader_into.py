"""`WeightLoader.load_tensors(into=...)`: tensors written straight into their destinations (a model's
parameters, or rows of a fused one) on a Device, from local files, sharded checkpoints, and remote
files streamed as their bytes arrive, with the remote download's faults and verification."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save, save_file

from ferrum.weights import S3, File, TensorSpec, Url, WeightLoader
from ferrum.weights.errors import IntegrityError, SpecMismatchError
from ferrum.weights.spec.transforms import Cast
from tests.conftest import S3Bucket, weights_config
from tests.engines import host_device
from tests.fault_server import FaultServer

BF16 = torch.bfloat16


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "q": torch.randn(4, 16, generator=g).to(BF16),
        "k": torch.randn(2, 16, generator=g),  # float32: cast on the way in
        "norm": torch.randn(16, generator=g).to(BF16),
        "big": torch.randn(300, 256, generator=g).to(BF16),  # several staging chunks on a GPU
    }


def _specs(source_of, tensors: dict[str, torch.Tensor]) -> list[TensorSpec]:
    return [
        TensorSpec(name, tuple(t.shape), BF16, source=source_of(name),
                   transformations=(Cast(BF16),) if t.dtype != BF16 else ())
        for name, t in tensors.items()
    ]


def _destinations() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """q and k fill rows of one fused parameter, as the model's q/k/v do."""
    fused = torch.full((6, 16), float("nan"), dtype=BF16)
    into = {"q": fused[:4], "k": fused[4:], "norm": torch.full((16,), float("nan"), dtype=BF16),
            "big": torch.full((300, 256), float("nan"), dtype=BF16)}
    return fused, into


def _check(got: dict[str, torch.Tensor], into: dict[str, torch.Tensor], fused: torch.Tensor,
           tensors: dict[str, torch.Tensor]) -> None:
    for name, t in tensors.items():
        assert got[name] is into[name]
        assert torch.equal(into[name], t.to(BF16)), name
    assert torch.equal(fused, torch.cat([tensors["q"], tensors["k"].to(BF16)]))


async def test_local_file_into_destinations(tmp_path: Path) -> None:
    tensors = _tensors()
    path = tmp_path / "w.safetensors"
    save_file(tensors, path)
    fused, into = _destinations()
    async with WeightLoader(weights_config(tmp_path)) as loader:
        got = await loader.load_tensors(_specs(lambda n: File(path, tensor_name=n), tensors),
                                        into=into, device=host_device())
    _check(got, into, fused, tensors)


async def test_sharded_checkpoint_into_destinations(tmp_path: Path) -> None:
    tensors = _tensors()
    shards = {"a.safetensors": ["q", "big"], "b.safetensors": ["k", "norm"]}
    for shard, names in shards.items():
        save_file({n: tensors[n] for n in names}, tmp_path / shard)
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {n: s for s, names in shards.items() for n in names}}))
    fused, into = _destinations()
    async with WeightLoader(weights_config(tmp_path)) as loader:
        got = await loader.load_tensors(_specs(lambda n: File(index, tensor_name=n), tensors),
                                        into=into, device=host_device())
    _check(got, into, fused, tensors)


async def test_destinations_are_checked_before_any_read(tmp_path: Path) -> None:
    tensors = _tensors()
    path = tmp_path / "w.safetensors"
    save_file(tensors, path)
    specs = _specs(lambda n: File(path, tensor_name=n), tensors)
    _, into = _destinations()
    async with WeightLoader(weights_config(tmp_path)) as loader:
        with pytest.raises(ValueError, match="needs the device"):
            await loader.load_tensors(specs, into=into)
        with pytest.raises(ValueError, match="no destination for 'norm'"):
            await loader.load_tensors(specs, into={k: v for k, v in into.items() if k != "norm"}, device=host_device())
        wrong = {**into, "norm": torch.empty(15, dtype=BF16)}
        with pytest.raises(ValueError, match=r"destination of 'norm' is \(15,\)"):
            await loader.load_tensors(specs, into=wrong, device=host_device())
        # a stored float32 tensor without the Cast its float32 -> bf16 destination needs
        uncast = [TensorSpec("k", (2, 16), BF16, source=File(path, tensor_name="k"))]
        with pytest.raises(SpecMismatchError, match=f"{path}.*'k'.*stored as"):
            await loader.load_tensors(uncast, into={"k": torch.empty(2, 16, dtype=BF16)}, device=host_device())


def _served(fault_server: FaultServer, tensors: dict[str, torch.Tensor]) -> tuple[bytes, str]:
    data = save(tensors)
    fault_server.files["w.safetensors"] = data
    return data, fault_server.url("w.safetensors")


async def test_url_streams_into_destinations_and_resumes_a_cut_connection(
    fault_server: FaultServer, tmp_path: Path
) -> None:
    tensors = _tensors()
    data, url = _served(fault_server, tensors)
    fault_server.faults.cut_at_offset = len(data) // 2  # the connection drops once, half-way
    fault_server.faults.cut_times = 1
    fused, into = _destinations()
    config = weights_config(tmp_path)
    async with WeightLoader(config) as loader:
        got = await loader.load_tensors(
            _specs(lambda n: Url(url, tensor_name=n), tensors), into=into, device=host_device()
        )
    _check(got, into, fused, tensors)
    blobs = list((config.cache_dir / "blobs").iterdir())
    assert len(blobs) == 1 and blobs[0].read_bytes() == data  # the verified cache, written alongside
    assert fault_server.bytes_served < 2 * len(data)  # the cut cost the rest of a chunk, not the file


async def test_a_corrupt_byte_fails_the_load_and_leaves_nothing_in_the_cache(
    fault_server: FaultServer, tmp_path: Path
) -> None:
    tensors = _tensors()
    data, url = _served(fault_server, tensors)
    fault_server.faults.corrupt_offset = len(data) - 100
    _, into = _destinations()
    config = weights_config(tmp_path)
    pinned = hashlib.sha256(data).hexdigest()
    async with WeightLoader(config) as loader:
        with pytest.raises(IntegrityError) as info:
            await loader.load_tensors(_specs(lambda n: Url(url, sha256=pinned, tensor_name=n), tensors),
                                      into=into, device=host_device())
    assert "w.safetensors" in str(info.value) and "mismatch" in str(info.value)
    assert_nothing_cached(config.cache_dir)


def assert_nothing_cached(cache: Path) -> None:
    """No committed blob and no partial download left in the download cache."""
    for kind, pattern in (("blobs", "*"), ("partial", "*.partial")):
        folder = cache / kind
        assert not folder.exists() or not list(folder.glob(pattern)), list(folder.glob(pattern))


async def test_s3_streams_into_destinations(s3_bucket: S3Bucket, tmp_path: Path) -> None:
    tensors = _tensors()
    s3_bucket.put("m/w.safetensors", save(tensors), ChecksumAlgorithm="SHA256")
    fused, into = _destinations()
    async with WeightLoader(weights_config(tmp_path)) as loader:
        got = await loader.load_tensors(
            _specs(
                lambda n: S3(s3_bucket.name, "m/w.safetensors", endpoint=s3_bucket.endpoint, tensor_name=n), tensors
            ),
            into=into, device=host_device(),
        )
    _check(got, into, fused, tensors)
