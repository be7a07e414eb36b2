"""Weight formats: SafeTensors header validation (untrusted input), every format's round trip, the
refusals (full pickles, object arrays, ONNX), format detection, transformations and the spec check,
and the value types' own checks."""

from __future__ import annotations

import json
import pickle
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ferrum.weights import (
    S3,
    Cast,
    CorruptWeightsError,
    File,
    HuggingFace,
    Memory,
    RawLayout,
    Reshape,
    Scale,
    Slice,
    SpecMismatchError,
    TensorNotFoundError,
    TensorSpec,
    TransformError,
    Transpose,
    UnsupportedError,
    Url,
    WeightFormat,
    WeightLoader,
    WeightLoaderConfig,
    index_shards,
)
from ferrum.weights.formats.readers import detect_format, open_local
from ferrum.weights.formats.safetensors_header import (
    MAX_HEADER_BYTES,
    header_length,
    parse_header,
    read_header,
)

# ------------------------------------------------------------------------------------------ helpers


def st_bytes(
    header: dict[str, Any], data: bytes, *, length: int | None = None, raw_header: bytes | None = None
) -> bytes:
    """A SafeTensors file from a header dict (or raw header bytes) and a data section."""
    text = raw_header if raw_header is not None else json.dumps(header).encode()
    n = len(text) if length is None else length
    return struct.pack("<Q", n) + text + data


def write(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


def one_f32(
    name: str = "w", shape: list[int] | None = None, offsets: list[int] | None = None
) -> dict[str, Any]:
    shape = [2, 2] if shape is None else shape
    return {name: {"dtype": "F32", "shape": shape, "data_offsets": offsets or [0, 16]}}


def refused(path: Path) -> CorruptWeightsError:
    """The error reading `path`'s header, checked to name the file."""
    with pytest.raises(CorruptWeightsError) as info:
        read_header(path)
    assert str(info.value).startswith(f"{path}: ")
    return info.value


async def load_all(source: Any, names_shapes: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    specs = [TensorSpec(n, tuple(t.shape), t.dtype, source=source) for n, t in names_shapes.items()]
    async with WeightLoader(WeightLoaderConfig(cache_enabled=False)) as loader:
        return await loader.load_tensors(specs)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype, name
        assert torch.equal(got[name], tensor), name


# ------------------------------------------------------------------------------------------ header


def test_valid_header_parses_with_metadata(tmp_path: Path) -> None:
    tensors = {"a": torch.arange(6, dtype=torch.float16).reshape(2, 3), "b": torch.ones(4, dtype=torch.int64)}
    path = tmp_path / "m.safetensors"
    save_file(tensors, path, metadata={"format": "pt"})
    header = read_header(path)
    assert header.metadata == {"format": "pt"}
    assert header.tensors["a"].shape == (2, 3) and header.tensors["a"].dtype == "F16"
    assert header.file_size == path.stat().st_size
    start, end = header.file_range("b")
    assert end - start == 32


def test_absurd_header_length(tmp_path: Path) -> None:
    path = write(tmp_path / "huge.safetensors", struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}")
    assert "absurd" in refused(path).message
    path = write(tmp_path / "max.safetensors", struct.pack("<Q", 2**64 - 1) + b"{}")
    assert "absurd" in refused(path).message


def test_header_longer_than_file(tmp_path: Path) -> None:
    path = write(tmp_path / "short.safetensors", st_bytes({}, b"", length=1000, raw_header=b"{}"))
    err = refused(path)
    assert "claims 1000 bytes" in err.message and "only 2" in err.message


def test_too_short_for_a_length(tmp_path: Path) -> None:
    assert "fewer than the 8-byte" in refused(write(tmp_path / "tiny.safetensors", b"\x01\x02")).message


@pytest.mark.parametrize(
    ("raw", "expect"),
    [
        (b"{not json", "not valid JSON"),
        (b"[1, 2, 3]", "must be a JSON object"),
        (b'{"w": NaN}', "not valid JSON"),
        (b"\xff\xfe{}", "not UTF-8"),
        (b'{"a": {"dtype": "F32", "shape": [], "data_offsets": [0, 4]}, "a": {}}', "key 'a' twice"),
    ],
)
def test_header_not_a_json_object(tmp_path: Path, raw: bytes, expect: str) -> None:
    assert expect in refused(write(tmp_path / "bad.safetensors", st_bytes({}, b"", raw_header=raw))).message


def test_unknown_dtype_names_tensor(tmp_path: Path) -> None:
    header = {"layer.weight": {"dtype": "F33", "shape": [1], "data_offsets": [0, 4]}}
    err = refused(write(tmp_path / "d.safetensors", st_bytes(header, bytes(4))))
    assert "'layer.weight'" in err.message and "unknown dtype 'F33'" in err.message


@pytest.mark.parametrize(
    ("entry", "expect"),
    [
        ({"dtype": "F32", "shape": [-1, 4], "data_offsets": [0, 16]}, "negative dimension"),
        ({"dtype": "F32", "shape": [2.0, 2], "data_offsets": [0, 16]}, "list of ints"),
        ({"dtype": "F32", "shape": [2, 2], "data_offsets": [0]}, "[begin, end] ints"),
        ({"dtype": "F32", "shape": [2, 2], "data_offsets": ["0", 16]}, "[begin, end] ints"),
        ({"dtype": "F32", "shape": [2, 2], "data_offsets": [16, 0]}, "not 0 <= begin <= end"),
        (
            {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 12]},
            "span 12 bytes but shape [2, 2] of F32 needs 16",
        ),
        ({"dtype": "F32", "shape": [2, 2]}, "lacks data_offsets"),
        ([1, 2], "must be an object"),
    ],
)
def test_bad_entries_name_tensor(tmp_path: Path, entry: Any, expect: str) -> None:
    err = refused(write(tmp_path / "e.safetensors", st_bytes({"w": entry}, bytes(16))))
    assert "tensor 'w'" in err.message and expect in err.message


def test_overlapping_offsets(tmp_path: Path) -> None:
    header = {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
    }
    err = refused(write(tmp_path / "o.safetensors", st_bytes(header, bytes(24))))
    assert "tensor 'b'" in err.message and "overlap tensor 'a'" in err.message


def test_offsets_beyond_the_file(tmp_path: Path) -> None:
    header = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    err = refused(write(tmp_path / "r.safetensors", st_bytes(header, bytes(8))))  # truncated data
    assert "tensor 'a'" in err.message and "beyond the data section, which has 8 bytes" in err.message


def test_gap_and_trailing_bytes_refused(tmp_path: Path) -> None:
    gap = {
        "a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
        "b": {"dtype": "F32", "shape": [1], "data_offsets": [8, 12]},
    }
    assert "unaccounted bytes" in refused(write(tmp_path / "g.safetensors", st_bytes(gap, bytes(12)))).message
    tail = {"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}
    assert (
        "belong to no tensor" in refused(write(tmp_path / "t.safetensors", st_bytes(tail, bytes(9)))).message
    )


def test_bad_metadata(tmp_path: Path) -> None:
    header = {"__metadata__": {"format": 1}, **one_f32()}
    assert (
        "__metadata__['format'] must be a string"
        in refused(write(tmp_path / "m.safetensors", st_bytes(header, bytes(16)))).message
    )
    header = {"__metadata__": ["x"], **one_f32()}
    assert (
        "__metadata__ must be an object"
        in refused(write(tmp_path / "n.safetensors", st_bytes(header, bytes(16)))).message
    )


def test_header_from_bytes_for_remote_readers() -> None:
    content = st_bytes(one_f32(), bytes(16))
    n = header_length(content[:8], file_size=len(content), name="https://h/m.safetensors")
    header = parse_header(content[8 : 8 + n], data_size=None, name="https://h/m.safetensors")
    assert header.tensors["w"].nbytes == 16
    with pytest.raises(CorruptWeightsError, match=r"^https://h/m.safetensors: .*absurd"):
        header_length(struct.pack("<Q", 10**12), file_size=None, name="https://h/m.safetensors")


async def test_loader_refuses_corrupt_file(tmp_path: Path) -> None:
    header = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}
    path = write(tmp_path / "c.safetensors", st_bytes(header, bytes(8)))
    with pytest.raises(CorruptWeightsError, match="beyond the data section"):
        await load_all(File(path), {"a": torch.zeros(4)})


# ------------------------------------------------------------------------------------------ round trips

TENSORS = {
    "f32": torch.randn(3, 5),
    "bf16": torch.randn(4, 4).to(torch.bfloat16),
    "f16": torch.randn(7).to(torch.float16),
    "i8": torch.randint(-128, 127, (2, 3), dtype=torch.int8),
    "i64": torch.arange(5, dtype=torch.int64),
    "bool": torch.tensor([True, False, True]),
    "u16": torch.arange(6, dtype=torch.int32).to(torch.uint16),
    "f8": torch.randn(8).to(torch.float8_e4m3fn),
    "scalar": torch.tensor(3.5),
    "empty": torch.zeros(0, 4),
}


async def test_safetensors_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file(TENSORS, path)
    assert_same(await load_all(File(path), TENSORS), TENSORS)


async def test_safetensors_unaligned_offsets_copied(tmp_path: Path) -> None:
    # An F32 tensor after a 3-byte one: its bytes are not 4-aligned, so it is copied, still right.
    header = {
        "u8": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
        "f32": {"dtype": "F32", "shape": [2], "data_offsets": [3, 11]},
    }
    text = json.dumps(header).encode()
    text += b" " * (-(len(text)) % 8)
    data = bytes([1, 2, 3]) + struct.pack("<2f", 1.5, -2.0)
    path = write(tmp_path / "u.safetensors", st_bytes({}, data, raw_header=text))
    got = await load_all(
        File(path), {"u8": torch.tensor([1, 2, 3], dtype=torch.uint8), "f32": torch.zeros(2)}
    )
    assert got["f32"].tolist() == [1.5, -2.0] and got["u8"].tolist() == [1, 2, 3]


def make_sharded(folder: Path, tensors: dict[str, torch.Tensor], per_shard: int = 3) -> Path:
    names = list(tensors)
    weight_map = {}
    shards = [names[i : i + per_shard] for i in range(0, len(names), per_shard)]
    for i, group in enumerate(shards, start=1):
        shard = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in group}, folder / shard)
        weight_map.update(dict.fromkeys(group, shard))
    index = folder / "model.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": weight_map}))
    return index


async def test_sharded_round_trip_through_index(tmp_path: Path) -> None:
    index = make_sharded(tmp_path, TENSORS)
    shards = index_shards(index)
    assert set(shards) == set(TENSORS) and len(set(shards.values())) == 4
    assert all(p.parent == tmp_path for p in shards.values())
    assert_same(await load_all(File(index), TENSORS), TENSORS)
    assert_same(await load_all(File(tmp_path), TENSORS), TENSORS)  # the folder finds its index


def test_index_refuses_escaping_shard_names(tmp_path: Path) -> None:
    index = tmp_path / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {"w": "../../etc/passwd"}}))
    with pytest.raises(CorruptWeightsError, match=r"shard of tensor 'w'.*plain relative path"):
        index_shards(index)
    index.write_text(json.dumps({"weights": {}}))
    with pytest.raises(CorruptWeightsError, match="weight_map"):
        index_shards(index)


async def test_pytorch_state_dict_round_trip(tmp_path: Path) -> None:
    plain = {k: v for k, v in TENSORS.items() if k != "f8"}
    path = tmp_path / "model.pt"
    torch.save(plain, path)
    assert_same(await load_all(File(path), plain), plain)
    legacy = tmp_path / "legacy.bin"
    old = {k: v for k, v in plain.items() if k != "u16"}  # torch's legacy format cannot read uint16 back
    torch.save(old, legacy, _use_new_zipfile_serialization=False)
    assert_same(await load_all(File(legacy), old), old)


async def test_pytorch_nested_and_single_tensor(tmp_path: Path) -> None:
    nested = tmp_path / "ckpt.pth"
    torch.save({"model": {"w": torch.ones(2), "layers": [torch.zeros(1)]}, "epoch": 3}, nested)
    got = await load_all(File(nested), {"model.w": torch.ones(2), "model.layers.0": torch.zeros(1)})
    assert got["model.w"].tolist() == [1.0, 1.0]
    single = tmp_path / "t.pt"
    torch.save(torch.arange(4.0), single)
    got = await load_all(File(single), {"anything": torch.arange(4.0)})
    assert got["anything"].tolist() == [0.0, 1.0, 2.0, 3.0]


class Payload:
    """Unpickling this would call `_unsafe_side_effect`: weights_only must refuse before that."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_unsafe_side_effect, (self.marker,))


def _unsafe_side_effect(marker: str) -> None:
    Path(marker).write_text("executed")


async def test_pytorch_full_pickle_refused(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    path = tmp_path / "evil.pt"
    torch.save({"w": torch.ones(2), "payload": Payload(str(marker))}, path)
    with pytest.raises(UnsupportedError) as info:
        await load_all(File(path), {"w": torch.ones(2)})
    assert str(info.value).startswith(str(path))
    assert "weights_only=True" in info.value.message and "_unsafe_side_effect" in info.value.message
    assert not marker.exists()
    raw_pickle = tmp_path / "plain.pkl"
    raw_pickle.write_bytes(pickle.dumps(Payload(str(marker)), protocol=2))
    with pytest.raises(UnsupportedError):
        await load_all(File(raw_pickle, format=WeightFormat.PYTORCH), {"w": torch.ones(2)})
    assert not marker.exists()


async def test_pytorch_garbage_is_corrupt(tmp_path: Path) -> None:
    path = write(tmp_path / "junk.pt", b"this is not a checkpoint at all")
    with pytest.raises(CorruptWeightsError, match="not a readable PyTorch checkpoint"):
        await load_all(File(path), {"w": torch.ones(2)})


async def test_numpy_npy_and_npz_round_trip(tmp_path: Path) -> None:
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.save(tmp_path / "w.npy", array)
    got = await load_all(File(tmp_path / "w.npy"), {"w": torch.from_numpy(array)})
    assert torch.equal(got["w"], torch.from_numpy(array))
    big_endian = tmp_path / "be.npy"
    np.save(big_endian, array.astype(">f4"))
    assert torch.equal(
        (await load_all(File(big_endian), {"w": torch.from_numpy(array)}))["w"], torch.from_numpy(array)
    )
    # Any: mypy would check the values against savez's allow_pickle as well
    arrays: dict[str, Any] = {"a": np.ones((2, 2), dtype=np.float16), "b": np.arange(3, dtype=np.int64)}
    for save in (np.savez, np.savez_compressed):
        path = tmp_path / f"{save.__name__}.npz"
        save(path, **arrays)
        want = {k: torch.from_numpy(v) for k, v in arrays.items()}
        assert_same(await load_all(File(path), want), want)


async def test_numpy_object_arrays_refused(tmp_path: Path) -> None:
    path = tmp_path / "obj.npy"
    np.save(path, np.array([{"a": 1}, None], dtype=object), allow_pickle=True)
    with pytest.raises(UnsupportedError, match="allow_pickle=False"):
        await load_all(File(path), {"w": torch.zeros(2)})
    npz = tmp_path / "obj.npz"
    np.savez(npz, x=np.array([object()], dtype=object))
    with pytest.raises(UnsupportedError, match="allow_pickle=False"):
        await load_all(File(npz), {"x": torch.zeros(1)})


async def test_raw_round_trip_and_size_check(tmp_path: Path) -> None:
    tensor = torch.randn(3, 4).to(torch.bfloat16)
    path = write(tmp_path / "w.raw", tensor.view(torch.uint8).numpy().tobytes())
    got = await load_all(File(path, format=RawLayout(torch.bfloat16, (3, 4))), {"w": tensor})
    assert torch.equal(got["w"], tensor)
    got = await load_all(File(path), {"w": tensor})  # bare RAW (.raw): the spec's layout
    assert torch.equal(got["w"], tensor)
    t = TensorSpec(
        "w",
        (4, 3),
        torch.bfloat16,
        source=File(path, format=RawLayout("bf16", (3, 4))),  # type: ignore[arg-type]  # a dtype's name
        transformations=(Transpose(),),
    )
    async with WeightLoader() as loader:
        assert torch.equal(await loader.load_tensor(t), tensor.T)
    with pytest.raises(
        CorruptWeightsError, match=r"RAW data is 24 bytes but shape \(2, 4\) of float32 needs 32"
    ):
        await load_all(File(path, format=WeightFormat.RAW), {"w": torch.zeros(2, 4)})


async def test_onnx_not_supported(tmp_path: Path) -> None:
    path = write(tmp_path / "model.onnx", b"\x08\x07\x12\x04test")
    with pytest.raises(UnsupportedError, match=r"model.onnx: ONNX weights are not supported"):
        await load_all(File(path), {"w": torch.zeros(1)})
    with pytest.raises(UnsupportedError, match="ONNX"):
        await load_all(Memory(b"\x08\x07", WeightFormat.ONNX), {"w": torch.zeros(1)})


async def test_missing_tensor_named(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    save_file({"a": torch.zeros(1)}, path)
    with pytest.raises(TensorNotFoundError, match=r"no tensor 'b' \(it has 1: 'a'\)"):
        await load_all(File(path), {"b": torch.zeros(1)})


# ------------------------------------------------------------------------------------------ detection


def test_detection_by_name_and_magic(tmp_path: Path) -> None:
    assert detect_format("x.safetensors", b"", name="x") is WeightFormat.SAFETENSORS
    assert detect_format("pytorch_model.bin", b"", name="x") is WeightFormat.PYTORCH
    assert detect_format("w.NPZ", b"", name="x") is WeightFormat.NUMPY
    assert detect_format("m.onnx", b"", name="x") is WeightFormat.ONNX
    save_file({"a": torch.zeros(1)}, tmp_path / "st")
    np.save(tmp_path / "np.npy", np.zeros(2))
    (tmp_path / "np.npy").rename(tmp_path / "np")
    np.savez(tmp_path / "nz.npz", a=np.zeros(1))
    (tmp_path / "nz.npz").rename(tmp_path / "nz")
    torch.save({"a": torch.zeros(1)}, tmp_path / "pt")
    torch.save({"a": torch.zeros(1)}, tmp_path / "legacy", _use_new_zipfile_serialization=False)
    for name, fmt in [
        ("st", WeightFormat.SAFETENSORS),
        ("np", WeightFormat.NUMPY),
        ("nz", WeightFormat.NUMPY),
        ("pt", WeightFormat.PYTORCH),
        ("legacy", WeightFormat.PYTORCH),
    ]:
        reader = open_local(tmp_path / name, None)
        assert reader.format is fmt, name
        assert reader.tensor("a" if name not in ("np",) else "x").shape[0] in (1, 2)
    unknown = write(tmp_path / "mystery", b"hello world, who am I?")
    with pytest.raises(UnsupportedError, match="cannot tell the weights format"):
        open_local(unknown, None)


# ------------------------------------------------------------------------------------------ transformations


def spec(shape: tuple[int, ...], dtype: torch.dtype, *steps: Any) -> TensorSpec:
    source = File(Path("/nonexistent/w.safetensors"))
    return TensorSpec("w", shape, dtype, source=source, transformations=steps)


async def load_with(
    tmp_path: Path, tensor: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, *steps: Any
) -> torch.Tensor:
    path = tmp_path / "t.safetensors"
    save_file({"w": tensor}, path)
    async with WeightLoader() as loader:
        return await loader.load_tensor(
            TensorSpec("w", shape, dtype, source=File(path), transformations=steps)
        )


W = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)


@pytest.mark.parametrize(
    ("steps", "shape", "dtype", "want"),
    [
        ((Transpose(),), (4, 3, 2), torch.float32, W.permute(2, 1, 0)),
        ((Transpose((0, 2, 1)),), (2, 4, 3), torch.float32, W.transpose(1, 2)),
        ((Reshape((6, -1)),), (6, 4), torch.float32, W.reshape(6, 4)),
        ((Cast("bf16"),), (2, 3, 4), torch.bfloat16, W.to(torch.bfloat16)),  # type: ignore[arg-type]
        ((Scale(0.5),), (2, 3, 4), torch.float32, W * 0.5),
        ((Slice(1, 1, 3),), (2, 2, 4), torch.float32, W[:, 1:3]),
        ((Slice(-1, 0, None, 2),), (2, 3, 2), torch.float32, W[..., ::2]),
        (
            (Slice(0, 1), Reshape((3, 4)), Transpose(), Cast(torch.float16), Scale(2)),
            (4, 3),
            torch.float16,
            (W[1:].reshape(3, 4).T.to(torch.float16) * 2),
        ),
    ],
)
async def test_transformations(
    tmp_path: Path, steps: tuple[Any, ...], shape: tuple[int, ...], dtype: torch.dtype, want: torch.Tensor
) -> None:
    got = await load_with(tmp_path, W, shape, dtype, *steps)
    assert got.dtype == want.dtype and torch.equal(got, want) and got.is_contiguous()


@pytest.mark.parametrize(
    ("step", "expect"),
    [
        (
            Transpose((0, 1)),
            r"tensor 'w': Transpose\(dims=\(0, 1\)\): dims must be a permutation of the 3 dims",
        ),
        (Reshape((5, -1)), r"cannot reshape \(2, 3, 4\) \(24 elements\) to \(5, -1\)"),
        (Slice(3, 0, 1), r"dim 3 is out of range for shape \(2, 3, 4\)"),
    ],
)
async def test_transformation_errors(tmp_path: Path, step: Any, expect: str) -> None:
    with pytest.raises(TransformError, match=expect):
        await load_with(tmp_path, W, (2, 3, 4), torch.float32, step)


async def test_scale_refuses_integers(tmp_path: Path) -> None:
    with pytest.raises(TransformError, match="needs a floating tensor, got int64 \\(Cast first\\)"):
        await load_with(tmp_path, torch.arange(3), (3,), torch.int64, Scale(2.0))


async def test_spec_mismatch_message(tmp_path: Path) -> None:
    with pytest.raises(SpecMismatchError) as info:
        await load_with(tmp_path, W, (2, 3, 4), torch.float16, Transpose())
    message = str(info.value)
    assert message.startswith(str(tmp_path / "t.safetensors"))
    assert "tensor 'w'" in message and "after Transpose(dims=None)" in message
    assert (
        "shape (2, 3, 4) expected, got (4, 3, 2)" in message
        and "dtype float16 expected, got float32" in message
    )
    with pytest.raises(SpecMismatchError, match=r"tensor 'w': shape \(24,\) expected, got \(2, 3, 4\)$"):
        await load_with(tmp_path, W, (24,), torch.float32)


def test_transformation_values_checked() -> None:
    with pytest.raises(ValueError, match="step must be >= 1"):
        Slice(0, 0, 2, step=0)
    with pytest.raises(ValueError, match="at most one dimension may be -1"):
        Reshape((-1, -1))
    with pytest.raises(ValueError, match="finite"):
        Scale(float("inf"))
    with pytest.raises(ValueError, match="unknown dtype 'float17'"):
        Cast("float17")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------ value types


@pytest.mark.parametrize(
    "url", ["ftp://example.com/w.safetensors", "s3://bucket/key", "file:///tmp/w", "hf://org/name"]
)
def test_url_schemes_other_than_http_refused(url: str) -> None:
    with pytest.raises(UnsupportedError, match=r"URL scheme \w+:// is not supported"):
        Url(url)


def test_url_display_hides_secrets() -> None:
    url = Url(
        "https://user:secret@example.com/a/w.safetensors?X-Amz-Signature=abc", {"Authorization": "Bearer t"}
    )
    assert url.display == "https://example.com/a/w.safetensors?…" and url.filename == "w.safetensors"
    assert "secret" not in url.display and "abc" not in url.display
    assert hash(url) == hash(Url(url.url, {"Authorization": "Bearer t"})) and url == Url(
        url.url, {"Authorization": "Bearer t"}
    )
    with pytest.raises(ValueError, match="sha256 must be 64 hex digits"):
        Url("https://example.com/w", sha256="abc")


def test_source_checks() -> None:
    with pytest.raises(ValueError, match="repo_id"):
        HuggingFace("../x", "model.safetensors")
    with pytest.raises(ValueError, match="plain relative path"):
        HuggingFace("org/name", "../model.safetensors")
    with pytest.raises(ValueError, match="not a valid bucket name"):
        S3("Bad/Bucket", "k")
    with pytest.raises(TypeError, match="format"):
        File("x", format="safetensors")  # type: ignore[arg-type]
    assert HuggingFace("org/name", "m.safetensors", "v1").display == "hf://org/name@v1/m.safetensors"
    assert S3("bucket", "dir/m.safetensors").display == "s3://bucket/dir/m.safetensors"


def test_config_defaults_and_checks(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("FERRUM_CACHE", str(tmp_path / "c"))  # read by the server's config, not here
    config = WeightLoaderConfig()
    assert config.cache_dir == Path("~/.cache/ferrum").expanduser() and config.chunk_size == 16 * 1024 * 1024
    assert config.max_concurrent_downloads == 8 and config.max_retries == 5 and config.progress == "auto"
    assert WeightLoaderConfig(cache_dir="~/c").cache_dir == Path("~/c").expanduser()  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk_size"):
        WeightLoaderConfig(chunk_size=0)
    with pytest.raises(ValueError, match="progress"):
        WeightLoaderConfig(progress="loud")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="sha256"):
        WeightLoaderConfig(expected_sha256={"https://x/y": "nope"})


def test_spec_checks() -> None:
    with pytest.raises(ValueError, match="negative dimension"):
        TensorSpec("w", (-1,), torch.float32, source=File(Path("x")))
    with pytest.raises(TypeError, match="not a TensorTransformation"):
        TensorSpec("w", (1,), torch.float32, source=File("x"), transformations=("transpose",))  # type: ignore[arg-type]
    s = TensorSpec("w", [2, 3], "fp16", source=File("x", "model.w"))  # type: ignore[arg-type]  # normalised
    assert s.shape == (2, 3) and s.dtype is torch.float16 and s.stored_name == "model.w"
