"""WeightLoader without a network: local files (memory-mapped, not read into memory), Memory sources,
concurrent loads, metadata / availability / preload, and the streaming path for remote SafeTensors
driven through the real Downloader by an in-process RemoteObject."""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save, save_file

import ferrum.weights.loader as loader_module
from ferrum.weights import (
    Cast,
    File,
    IntegrityError,
    Memory,
    RawLayout,
    Scale,
    SourceNotFoundError,
    TensorNotFoundError,
    TensorSpec,
    Transpose,
    UnsupportedError,
    Url,
    WeightFormat,
    WeightLoader,
    WeightLoaderConfig,
)
from ferrum.weights.download.remote import ObjectInfo

MiB = 1024 * 1024


def specs_for(source: Any, tensors: dict[str, torch.Tensor], prefix: str = "") -> list[TensorSpec]:
    return [
        TensorSpec(
            prefix + name,
            tuple(t.shape),
            t.dtype,
            source=File(source.path, name) if isinstance(source, File) else source,
        )
        for name, t in tensors.items()
    ]


@pytest.fixture
async def loader(tmp_path: Path) -> Any:
    async with WeightLoader(
        WeightLoaderConfig(cache_dir=tmp_path / "cache", progress="off")
    ) as weight_loader:
        yield weight_loader


# ------------------------------------------------------------------------------------------ mmap


def sparse_safetensors(path: Path, count: int, numel: int) -> None:
    """A SafeTensors file of `count` F32 tensors of zeros, written sparse (fast, no disk used)."""
    header = {
        f"t{i}": {"dtype": "F32", "shape": [numel], "data_offsets": [i * numel * 4, (i + 1) * numel * 4]}
        for i in range(count)
    }
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        f.truncate(8 + len(text) + count * numel * 4)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def read_at(path: Path, offset: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read(n)


def file_mappings(path: Path) -> list[tuple[int, int]]:
    """[start, end) of this process's mappings of `path`."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            if len(parts) == 6 and parts[5].strip() == str(path):
                start, end = (int(x, 16) for x in parts[0].split("-"))
                out.append((start, end))
    return out


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
async def test_local_safetensors_is_memory_mapped_not_read(loader: WeightLoader, tmp_path: Path) -> None:
    path = tmp_path / "big.safetensors"
    count, numel = 50, MiB  # 50 tensors of 4 MiB: 200 MiB
    sparse_safetensors(path, count, numel)
    size = path.stat().st_size
    specs = [TensorSpec(f"t{i}", (numel,), torch.float32, source=File(path)) for i in range(count)]
    before = rss_bytes()
    tensors = await loader.load_tensors(specs)
    grown = rss_bytes() - before
    assert grown < size // 8, f"RSS grew by {grown} bytes loading a {size}-byte file: it was read, not mapped"
    mappings = file_mappings(path)
    assert mappings, "the file is not mapped"
    for name, tensor in tensors.items():
        start, end = tensor.data_ptr(), tensor.data_ptr() + tensor.nbytes
        assert any(lo <= start and end <= hi for lo, hi in mappings), (
            f"{name} is not a view of the file's mapping"
        )
    # The mapping is private: writing into a tensor does not write into the file.
    tensors["t0"][0] = 7.0
    assert read_at(path, size - count * numel * 4, 4) == bytes(4)
    assert tensors["t0"][0].item() == 7.0


# ------------------------------------------------------------------------------------------ concurrency


async def test_concurrent_load_of_many_specs(
    loader: WeightLoader, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(0)
    files: dict[Path, dict[str, torch.Tensor]] = {}
    for f in range(6):
        tensors = {f"layer{i}.weight": torch.randn(16, 8) for i in range(30)}
        path = tmp_path / f"part{f}.safetensors"
        save_file(tensors, path)
        files[path] = tensors
    opened: list[Path] = []
    real_open = loader_module.open_local

    def counting_open(path: Path, *args: Any, **kwargs: Any) -> Any:
        opened.append(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(loader_module, "open_local", counting_open)
    specs: list[TensorSpec] = []
    want: dict[str, torch.Tensor] = {}
    for f, (path, tensors) in enumerate(files.items()):
        for name, tensor in tensors.items():
            key = f"{f}/{name}"
            if len(specs) % 3 == 0:  # a third of them transformed (made in threads of their own)
                steps = (Transpose(), Cast(torch.float16), Scale(0.5))
                specs.append(
                    TensorSpec(key, (8, 16), torch.float16, source=File(path, name), transformations=steps)
                )
                want[key] = (tensor.T.to(torch.float16) * 0.5).contiguous()
            else:
                specs.append(TensorSpec(key, (16, 8), torch.float32, source=File(path, name)))
                want[key] = tensor
    memory = {"m": torch.arange(10, dtype=torch.int32)}
    specs.append(
        TensorSpec(
            "memory",
            (10,),
            torch.int32,
            source=Memory(save(memory), WeightFormat.SAFETENSORS, tensor_name="m"),
        )
    )
    want["memory"] = memory["m"]
    got = await loader.load_tensors(specs)
    assert list(got) == [s.name for s in specs]
    for key, tensor in want.items():
        assert torch.equal(got[key], tensor), key
    assert sorted(opened) == sorted(files), "each file must be opened exactly once"


async def test_duplicate_spec_names_refused(loader: WeightLoader) -> None:
    spec = TensorSpec("w", (1,), torch.float32, source=File(Path("/nonexistent.safetensors")))
    with pytest.raises(ValueError, match="two TensorSpecs are named 'w'"):
        await loader.load_tensors([spec, spec])


async def test_one_failure_fails_the_call(loader: WeightLoader, tmp_path: Path) -> None:
    save_file({"a": torch.zeros(2)}, tmp_path / "ok.safetensors")
    specs = [
        TensorSpec("a", (2,), torch.float32, source=File(tmp_path / "ok.safetensors")),
        TensorSpec("b", (2,), torch.float32, source=File(tmp_path / "missing.safetensors")),
    ]
    with pytest.raises(SourceNotFoundError, match=r"missing.safetensors: no such file"):
        await loader.load_tensors(specs)


# ------------------------------------------------------------------------------------------ Memory


async def test_memory_sources(loader: WeightLoader) -> None:
    tensor = torch.randn(3, 4)
    buffer = io.BytesIO()
    torch.save({"w": tensor}, buffer)
    npy = io.BytesIO()
    np.save(npy, tensor.numpy())
    npz = io.BytesIO()
    np.savez(npz, w=tensor.numpy())
    raw = tensor.numpy().tobytes()
    sources = {
        "st": Memory(save({"w": tensor}), WeightFormat.SAFETENSORS),
        "pt": Memory(buffer.getvalue(), WeightFormat.PYTORCH, tensor_name="w"),
        "npy": Memory(npy.getvalue(), WeightFormat.NUMPY),
        "npz": Memory(npz.getvalue(), WeightFormat.NUMPY, tensor_name="w"),
        "raw": Memory(raw, RawLayout(torch.float32, (3, 4))),
        "bare_raw": Memory(bytearray(raw), WeightFormat.RAW),  # type: ignore[arg-type]  # copied into bytes
    }
    specs = [
        TensorSpec(key if key != "st" else "w", (3, 4), torch.float32, source=src)
        for key, src in sources.items()
    ]
    got = await loader.load_tensors(specs)
    for key, value in got.items():
        assert torch.equal(value, tensor), key
    got["w"].zero_()  # a copy: the source bytes are untouched
    assert torch.equal((await loader.load_tensor(specs[0])), tensor)


async def test_memory_metadata_and_errors(loader: WeightLoader) -> None:
    source = Memory(
        save({"a": torch.zeros(2, 3, dtype=torch.bfloat16)}, metadata={"k": "v"}), WeightFormat.SAFETENSORS
    )
    meta = await loader.get_metadata(source)
    assert meta.tensors == {"a": ((2, 3), torch.bfloat16)} and meta.extra == {"k": "v"}
    assert meta.total_size_bytes == 12 and meta.dtypes == {torch.bfloat16}
    assert await loader.is_available(source)
    with pytest.raises(UnsupportedError, match="nothing to preload"):
        await loader.preload(source)
    with pytest.raises(TensorNotFoundError, match=r"<memory> \(\d+ bytes\): no tensor 'b'"):
        await loader.load_tensor(TensorSpec("b", (2, 3), torch.bfloat16, source=source))


# ------------------------------------------------------------------------------------------ metadata & co


async def test_local_metadata_availability_preload(loader: WeightLoader, tmp_path: Path) -> None:
    tensors = {
        "x": torch.zeros(2, 2),
        "y": torch.ones(3, dtype=torch.int64),
        "z": torch.zeros(1, dtype=torch.float16),
    }
    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"x": tensors["x"], "y": tensors["y"]}, folder / "model-00001-of-00002.safetensors")
    save_file({"z": tensors["z"]}, folder / "model-00002-of-00002.safetensors")
    weight_map = {
        "x": "model-00001-of-00002.safetensors",
        "y": "model-00001-of-00002.safetensors",
        "z": "model-00002-of-00002.safetensors",
    }
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    meta = await loader.get_metadata(File(folder))
    assert meta.format is WeightFormat.SAFETENSORS and meta.extra == {"shards": "2"}
    assert meta.tensors == {
        "x": ((2, 2), torch.float32),
        "y": ((3,), torch.int64),
        "z": ((1,), torch.float16),
    }
    assert meta.total_size_bytes == 16 + 24 + 2
    shard_meta = await loader.get_metadata(File(folder / "model-00002-of-00002.safetensors"))
    assert shard_meta.tensors == {"z": ((1,), torch.float16)}
    assert await loader.is_available(File(folder))
    assert not await loader.is_available(File(tmp_path / "nope.safetensors"))
    assert not await loader.is_available(File(tmp_path))  # a folder with no weights
    assert (
        await loader.preload(File(folder / "model.safetensors.index.json"))
        == folder / "model.safetensors.index.json"
    )
    with pytest.raises(SourceNotFoundError):
        await loader.preload(File(tmp_path / "nope.safetensors"))
    np.save(tmp_path / "v.npy", np.zeros((4, 5), dtype=np.float32))
    assert (await loader.get_metadata(File(tmp_path / "v.npy"))).tensors == {"v": ((4, 5), torch.float32)}


def test_capabilities() -> None:
    caps = WeightLoader().capabilities()
    assert caps.formats == {
        WeightFormat.SAFETENSORS,
        WeightFormat.PYTORCH,
        WeightFormat.NUMPY,
        WeightFormat.RAW,
        WeightFormat.GGUF,
    }
    assert caps.sources == {"file", "url", "huggingface", "s3", "memory"}
    assert caps.streaming and caps.concurrent
    assert caps.transformations == {"Transpose", "Reshape", "Cast", "Scale", "Slice", "Dequantize", "Quantize"}


async def test_tensor_name_differs_from_spec_name(loader: WeightLoader, tmp_path: Path) -> None:
    save_file({"model.layers.0.w": torch.arange(3.0)}, tmp_path / "m.safetensors")
    spec = TensorSpec("w0", (3,), torch.float32, source=File(tmp_path / "m.safetensors", "model.layers.0.w"))
    assert (await loader.load_tensor(spec)).tolist() == [0.0, 1.0, 2.0]


# ------------------------------------------------------------------------------------------ streaming


class SlowObject:
    """An in-process RemoteObject over `data`, serving ranges a little at a time; counts what it served."""

    def __init__(self, name: str, data: bytes, delay: float = 0.002) -> None:
        self.name = name
        self.cache_key = "test-" + hashlib.sha256(name.encode() + data).hexdigest()[:24]
        self.data = data
        self.delay = delay
        self.served = 0

    async def info(self) -> ObjectInfo:
        return ObjectInfo(size=len(self.data), sha256=None, md5=None, etag='"e"', accepts_ranges=True)

    async def read_range(self, start: int, end: int) -> bytes:
        await asyncio.sleep(self.delay)
        self.served += end - start
        return self.data[start:end]


@pytest.fixture
def remote(monkeypatch: pytest.MonkeyPatch) -> dict[str, SlowObject]:
    """URL -> SlowObject, used by the loader in place of HTTP."""
    objects: dict[str, SlowObject] = {}
    monkeypatch.setattr(WeightLoader, "_remote_object", lambda self, source: objects[source.url])
    return objects


def streaming_config(tmp_path: Path) -> WeightLoaderConfig:
    return WeightLoaderConfig(
        cache_dir=tmp_path / "cache", chunk_size=64 * 1024, max_concurrent_downloads=2, progress="off"
    )


async def test_remote_safetensors_streams_tensors_as_bytes_arrive(
    tmp_path: Path, remote: dict[str, SlowObject], monkeypatch: pytest.MonkeyPatch
) -> None:
    torch.manual_seed(1)
    tensors = {f"w{i}": torch.randn(128, 64) for i in range(16)}  # 32 KiB each, 512 KiB in all: 8 chunks
    data = save(tensors)
    url = "https://example.com/org/model.safetensors"
    remote[url] = obj = SlowObject(url, data)
    seen: list[int] = []
    real = loader_module._streamed_tensor

    def recording(*args: Any) -> Any:
        seen.append(obj.served)
        return real(*args)

    monkeypatch.setattr(loader_module, "_streamed_tensor", recording)
    source = Url(url, sha256=hashlib.sha256(data).hexdigest())
    async with WeightLoader(streaming_config(tmp_path)) as loader:
        got = await loader.load_tensors(
            [
                TensorSpec(n, (128, 64), torch.float32, source=Url(url, tensor_name=n, sha256=source.sha256))
                for n in tensors
            ]
        )
        for name, tensor in tensors.items():
            assert torch.equal(got[name], tensor), name
        assert min(seen) < len(data), "no tensor was made before the download finished"
        assert obj.served == len(data)  # the whole file once, into the cache
        cached = await loader.preload(source)  # already there: no new request
        assert cached.read_bytes() == data and obj.served == len(data)


async def test_remote_checksum_mismatch_fails_the_load(tmp_path: Path, remote: dict[str, SlowObject]) -> None:
    data = save({"w": torch.ones(4)})
    url = "https://example.com/m.safetensors"
    remote[url] = SlowObject(url, data, delay=0)
    async with WeightLoader(streaming_config(tmp_path)) as loader:
        with pytest.raises(IntegrityError):
            await loader.load_tensor(TensorSpec("w", (4,), torch.float32, source=Url(url, sha256="0" * 64)))


async def test_remote_metadata_reads_only_the_header(tmp_path: Path, remote: dict[str, SlowObject]) -> None:
    data = save({"a": torch.zeros(1000, 100), "b": torch.zeros(3, dtype=torch.int8)})
    url = "https://example.com/m.safetensors"
    remote[url] = obj = SlowObject(url, data, delay=0)
    async with WeightLoader(streaming_config(tmp_path)) as loader:
        meta = await loader.get_metadata(Url(url))
        assert meta.tensors == {"a": ((1000, 100), torch.float32), "b": ((3,), torch.int8)}
        assert obj.served < 1024 and await loader.is_available(Url(url))


async def test_remote_index_and_other_formats(tmp_path: Path, remote: dict[str, SlowObject]) -> None:
    base = "https://example.com/org/model"
    shard1, shard2 = save({"x": torch.arange(4.0)}), save({"y": torch.ones(2, 2)})
    index = json.dumps({"weight_map": {"x": "a.safetensors", "y": "b.safetensors"}}).encode()
    npy = io.BytesIO()
    np.save(npy, np.arange(6, dtype=np.int16))
    for name, data in [
        ("model.safetensors.index.json", index),
        ("a.safetensors", shard1),
        ("b.safetensors", shard2),
        ("v.npy", npy.getvalue()),
    ]:
        remote[f"{base}/{name}"] = SlowObject(f"{base}/{name}", data, delay=0)
    async with WeightLoader(streaming_config(tmp_path)) as loader:
        src = Url(f"{base}/model.safetensors.index.json")
        got = await loader.load_tensors(
            [
                TensorSpec("x", (4,), torch.float32, source=src),
                TensorSpec("y", (2, 2), torch.float32, source=src),
                TensorSpec("v", (6,), torch.int16, source=Url(f"{base}/v.npy")),
            ]
        )
        assert got["x"].tolist() == [0.0, 1.0, 2.0, 3.0] and torch.equal(got["y"], torch.ones(2, 2))
        assert got["v"].tolist() == list(range(6))
        meta = await loader.get_metadata(src)
        assert set(meta.tensors) == {"x", "y"} and meta.extra["shards"] == "2"


async def test_rewritten_file_is_read_anew(loader: WeightLoader, tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"w": torch.zeros(4)}, path)
    spec = TensorSpec("w", (4,), torch.float32, source=File(path))
    assert (await loader.load_tensor(spec)).tolist() == [0.0] * 4
    save_file({"w": torch.ones(4), "extra": torch.zeros(8)}, path)  # same path, new header
    assert (await loader.load_tensor(spec)).tolist() == [1.0] * 4
    assert set((await loader.get_metadata(File(path))).tensors) == {"w", "extra"}
