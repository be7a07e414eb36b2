"""Quantize on load: the arithmetic of each method against the full-precision weight (bounds stated
below), int4's packed layout on a hand-made tensor, and `Quantize` as the last transformation of a
TensorSpec: loaded alone, into a module's storage (rows of one destination filled by two specs, a
tensor-parallel Slice first), from a local file and from a URL, and the errors of each."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save, save_file

from ferrum.weights import File, TensorSpec, Url, WeightLoader
from ferrum.weights.errors import SpecMismatchError, TransformError, UnsupportedError
from ferrum.weights.quantization import arith
from ferrum.weights.quantization.arith import dequantize, quantize, unpack_int4
from ferrum.weights.quantization.scheme import QuantScheme
from ferrum.weights.quantization.tensor import QuantizedTensor
from ferrum.weights.spec.transforms import Cast, Quantize, Slice, TensorTransformation
from tests.conftest import weights_config
from tests.engines import host_device
from tests.fault_server import FaultServer

BF16 = torch.bfloat16
INT8, FP8 = QuantScheme("int8"), QuantScheme("fp8")
INT4_G32, INT4_G128 = QuantScheme("int4", 32), QuantScheme("int4", 128)
INT4_G32_SYM, INT4_G128_SYM = QuantScheme("int4", 32, symmetric=True), QuantScheme("int4", 128, symmetric=True)

# relative Frobenius error of dequantize(quantize(w)) on a Gaussian [64, 256] weight (measured: int8
# 0.7%, fp8 2.4%, int4 g32 7.2% / 8.7% symmetric, g128 9.3% / 10.5%; scale and zero from min..max, and
# fp8's scale amax / 448, gave fp8 2.6%, int4 7.9% / 9.2%, 10.0% / 11.4%: above these bounds)
REL_ERROR = {INT8: 0.01, FP8: 0.025, INT4_G32: 0.075, INT4_G32_SYM: 0.09, INT4_G128: 0.097, INT4_G128_SYM: 0.11}
SCHEMES = list(REL_ERROR)


def _weight(n: int = 64, k: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def _scale_per_element(qt: QuantizedTensor) -> torch.Tensor:
    scale = qt.parts["scale"].float()
    if qt.scheme.grouped:  # input k's group is k // g (the last group may be shorter)
        return scale.repeat_interleave(qt.scheme.group_size, dim=1)[:, : qt.shape[1]]
    return scale[:, None].expand(qt.shape)


def _nearest_level_error(qt: QuantizedTensor, w: torch.Tensor) -> torch.Tensor:
    """int4: each input's distance to the nearest of its group's 16 levels (q - 8) * scale + zero."""
    g, k = qt.scheme.group_size, qt.shape[1]
    scale = qt.parts["scale"].float().repeat_interleave(g, dim=1)[:, :k, None]
    zero = qt.parts["zero"].float().repeat_interleave(g, dim=1)[:, :k, None]
    levels = (torch.arange(16, dtype=torch.float32) - 8) * scale + zero
    return (levels - w.float()[..., None]).abs().amin(dim=-1)


# ------------------------------------------------------------------------------------------ arithmetic


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.describe())
@pytest.mark.parametrize("dtype", [torch.float32, BF16], ids=str)
def test_dequantized_close_to_the_original(scheme: QuantScheme, dtype: torch.dtype) -> None:
    w = _weight().to(dtype)
    qt = quantize(w, scheme)
    assert qt.shape == (64, 256) and qt.dtype == dtype and not qt.layout_problems()
    back = dequantize(qt, torch.float32)
    ref = w.float()
    err = (back - ref).abs()
    assert (err.norm() / ref.norm()).item() < REL_ERROR[scheme]
    scale = _scale_per_element(qt)
    if scheme.method == "fp8":  # e4m3: 3 mantissa bits (half a step: 2^-4 relative); subnormals: steps of 2^-9
        bound = ref.abs() * 2**-4 + scale * 2**-10
    elif scheme.method == "int8":  # round to nearest: half a step of the scale; the row's absmax is 127 steps
        bound = scale / 2
    else:  # round to the nearest level of the stored scale and zero (the range may clip a group's extremes)
        bound = _nearest_level_error(qt, w) + scale * 1e-5
    assert (err <= bound * (1 + 1e-5) + 1e-7).all()
    assert dequantize(qt).dtype == dtype


@pytest.mark.parametrize("scheme", [INT4_G128, INT4_G128_SYM], ids=lambda s: s.describe())
def test_int4_with_a_ragged_last_group(scheme: QuantScheme) -> None:
    """K = 576 in groups of 128: five groups, the last of 64 inputs, fitted to its own inputs alone (the
    padding takes no part: as the same 64 inputs quantized in one group of 64); bounds as for groups of 128."""
    w = _weight(k=576)
    w[:, 560:] *= 0.25  # the last group's range differs from a padded-with-zeros one's
    qt = quantize(w, scheme)
    assert qt.parts["scale"].shape == (64, 5) and not qt.layout_problems()
    back = dequantize(qt)
    err = (back - w).abs()
    assert (err.norm() / w.norm()).item() < REL_ERROR[scheme]
    assert (err <= _nearest_level_error(qt, w) * (1 + 1e-5) + 1e-7).all()
    alone = quantize(w[:, 512:], QuantScheme("int4", 64, symmetric=scheme.symmetric))
    for part in ("scale", "zero"):
        torch.testing.assert_close(qt.parts[part][:, 4], alone.parts[part][:, 0])


def test_int4_asymmetric_groups_have_no_mean_error() -> None:
    """Asymmetric int4 sets each group's zero so that its errors sum to about 0 (min..max onto 0..15
    left 4% of a step on average, up to 19%: measured 0.2%, up to 6%)."""
    w = _weight()
    qt = quantize(w, INT4_G32)
    mean_error = (dequantize(qt) - w).reshape(64, 8, 32).mean(dim=2).abs() / qt.parts["scale"]
    assert mean_error.mean().item() < 0.01 and mean_error.max().item() < 0.1


def test_fp8_scale_chosen_per_row_for_the_least_error() -> None:
    """fp8: each row's scale is amax / 448 times one of 2^(i/8), i = 0..7 (a row's max is never
    clipped), and its squared error no more than amax / 448's."""
    w = _weight()
    qt = quantize(w, FP8)
    base = w.abs().amax(dim=1) / 448
    steps = torch.log2(qt.parts["scale"] / base) * 8
    torch.testing.assert_close(steps, steps.round().clamp(0, 7), atol=1e-4, rtol=0)
    plain = (w / base[:, None]).to(torch.float8_e4m3fn).float() * base[:, None]
    assert (((dequantize(qt) - w) ** 2).sum(dim=1) <= ((plain - w) ** 2).sum(dim=1) * (1 + 1e-6)).all()


def test_int4_packing_by_hand() -> None:
    """One row, group 32, symmetric: values (q - 8) * 0.5 for q = 0..15, 15..0 give scale 0.5
    (min -4 = -8 steps, max 3.5 = 7 steps); byte j holds q[2j] low, q[2j + 1] high."""
    q = list(range(16)) + list(range(15, -1, -1))
    w = (torch.tensor(q, dtype=torch.float32) - 8) * 0.5
    qt = quantize(w[None, :], INT4_G32_SYM)
    packed = qt.parts["qweight"]
    assert packed.dtype == torch.uint8 and packed.shape == (1, 16)
    expected = [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE, 0xEF, 0xCD, 0xAB, 0x89, 0x67, 0x45, 0x23, 0x01]
    assert packed[0].tolist() == expected
    assert qt.parts["scale"].tolist() == [[0.5]] and qt.parts["zero"].tolist() == [[0.0]]
    assert unpack_int4(packed)[0].tolist() == q
    assert torch.equal(dequantize(qt), w[None, :])
    # asymmetric: values on a grid of step 1 from 1 to 16 (each twice): scale 1, zero = the value of q = 8
    w2 = torch.arange(1.0, 17.0).repeat_interleave(2)[None, :]
    qt2 = quantize(w2, INT4_G32)
    assert qt2.parts["scale"].item() == 1.0 and qt2.parts["zero"].item() == 9.0
    assert unpack_int4(qt2.parts["qweight"])[0, [0, 31]].tolist() == [0, 15]


def test_int8_and_fp8_layout() -> None:
    w = _weight(4, 32)
    for scheme, qdtype in ((INT8, torch.int8), (FP8, torch.float8_e4m3fn)):
        qt = quantize(w.to(BF16), scheme)
        assert qt.parts["qweight"].dtype == qdtype and qt.parts["qweight"].shape == (4, 32)
        assert qt.parts["scale"].dtype == torch.float32 and qt.parts["scale"].shape == (4,)
        assert qt.nbytes == 4 * 32 + 4 * 4


# ------------------------------------------------------------------------------------------ loading


def _checkpoint(tmp_path: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    tensors = {
        "q": _weight(4, 128, seed=1).to(BF16),
        "k": _weight(2, 128, seed=2),  # float32: Cast to bf16 before Quantize
        "down": _weight(6, 256, seed=3).to(BF16),
        "bias": torch.randn(128).to(BF16),
        "ids": torch.arange(256).reshape(2, 128),
    }
    path = tmp_path / "w.safetensors"
    save_file(tensors, path)
    return path, tensors


def _quantized(name: str, shape: tuple[int, int], scheme: QuantScheme, source: File | Url,
               *steps: TensorTransformation) -> TensorSpec:
    return TensorSpec(name, shape, BF16, source=source, transformations=(*steps, Quantize(scheme)))


@pytest.mark.parametrize("scheme", [INT8, INT4_G32, FP8], ids=lambda s: s.describe())
async def test_load_makes_a_quantized_tensor(tmp_path: Path, scheme: QuantScheme) -> None:
    path, tensors = _checkpoint(tmp_path)
    src = lambda n: File(path, tensor_name=n)  # noqa: E731
    specs = [
        _quantized("q", (4, 128), scheme, src("q")),
        _quantized("k", (2, 128), scheme, src("k"), Cast(BF16)),
        _quantized("down.rank1", (6, 128), scheme, src("down"), Slice(1, 128, 256)),  # a row-parallel shard
        TensorSpec("bias", (128,), BF16, source=src("bias")),
    ]
    async with WeightLoader(weights_config(tmp_path)) as loader:
        got = await loader.load(specs)
    expect = {"q": tensors["q"], "k": tensors["k"].to(BF16), "down.rank1": tensors["down"][:, 128:]}
    for name, weight in expect.items():
        qt = got[name]
        assert isinstance(qt, QuantizedTensor) and qt.scheme == scheme and qt.shape == tuple(weight.shape)
        for part, value in quantize(weight, scheme).parts.items():
            assert torch.equal(qt.parts[part].view(torch.uint8), value.view(torch.uint8)), (name, part)
    bias = got["bias"]
    assert isinstance(bias, torch.Tensor) and torch.equal(bias, tensors["bias"])


@pytest.mark.parametrize("scheme", [INT8, INT4_G32, FP8], ids=lambda s: s.describe())
async def test_load_into_a_modules_storage(tmp_path: Path, scheme: QuantScheme) -> None:
    """q and k fill rows of one fused storage (as q/k/v do); the second rank's rows of `down` fill
    a storage of their own, sliced before they are quantized."""
    path, tensors = _checkpoint(tmp_path)
    src = lambda n: File(path, tensor_name=n)  # noqa: E731
    fused = QuantizedTensor.empty(scheme, 6, 128, BF16)
    down = QuantizedTensor.empty(scheme, 3, 256, BF16)
    bias = torch.empty(128, dtype=BF16)
    for part in (*fused.parts.values(), *down.parts.values()):
        part.view(torch.uint8).fill_(0xFF)
    specs = [
        _quantized("q", (4, 128), scheme, src("q")),
        _quantized("k", (2, 128), scheme, src("k"), Cast(BF16)),
        _quantized("down", (3, 256), scheme, src("down"), Slice(0, 3, 6)),  # a column-parallel shard
        TensorSpec("bias", (128,), BF16, source=src("bias")),
    ]
    into: dict[str, torch.Tensor | QuantizedTensor] = {
        "q": fused.rows(0, 4), "k": fused.rows(4, 6), "down": down, "bias": bias}
    seen: list[tuple[int, int]] = []
    async with WeightLoader(weights_config(tmp_path)) as loader:
        got = await loader.load(specs, into=into, device=host_device(), progress=lambda d, t: seen.append((d, t)))
        assert loader.bytes_read == (4 * 128 + 2 * 128 * 2 + 3 * 256 + 128) * 2  # k is float32; down: its 3 rows
    assert all(got[name] is into[name] for name in into)
    expect_fused = quantize(torch.cat([tensors["q"], tensors["k"].to(BF16)]), scheme)
    for name, value in expect_fused.parts.items():
        assert torch.equal(fused.parts[name].view(torch.uint8), value.view(torch.uint8)), name
    for name, value in quantize(tensors["down"][3:], scheme).parts.items():
        assert torch.equal(down.parts[name].view(torch.uint8), value.view(torch.uint8)), name
    assert torch.equal(bias, tensors["bias"])
    total = fused.nbytes + down.nbytes + bias.nbytes
    assert max(seen) == (total, total) and len(seen) == 4  # the destinations' stored bytes


async def test_url_streams_a_quantized_spec(fault_server: FaultServer, tmp_path: Path) -> None:
    weight = _weight(4, 64).to(BF16)
    fault_server.files["w.safetensors"] = save({"w": weight})
    source = Url(fault_server.url("w.safetensors"), tensor_name="w")
    storage = QuantizedTensor.empty(INT4_G32, 2, 64, BF16)
    async with WeightLoader(weights_config(tmp_path)) as loader:
        alone = await loader.load([_quantized("w", (4, 64), INT4_G32, source)])
        await loader.load([_quantized("w", (2, 64), INT4_G32, source, Slice(0, 2, 4))],
                          into={"w": storage}, device=host_device())
    assert isinstance(alone["w"], QuantizedTensor)
    assert torch.equal(dequantize(alone["w"]), dequantize(quantize(weight, INT4_G32)))
    assert torch.equal(dequantize(storage), dequantize(quantize(weight[2:], INT4_G32)))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
async def test_quantized_into_gpu_storage(tmp_path: Path) -> None:
    """q quantized on the GPU (its parts copied on the device), k on the host (through the pinned
    staging), into rows of one storage on the GPU; and a spec quantized on the GPU, returned."""
    from ferrum.backends.cuda import CUDABackend, probe_cuda_device

    path, tensors = _checkpoint(tmp_path)
    device = CUDABackend(probe_cuda_device(0)).device()
    storage = QuantizedTensor.empty(INT4_G32, 6, 128, BF16, device=device.torch_device)
    specs = [
        TensorSpec("q", (4, 128), BF16, source=File(path, tensor_name="q"),
                   transformations=(Quantize(INT4_G32, "cuda"),)),
        TensorSpec("k", (2, 128), BF16, source=File(path, tensor_name="k"),
                   transformations=(Cast(BF16), Quantize(INT4_G32))),
    ]
    on_gpu = TensorSpec("down", (6, 256), BF16, device="cuda", source=File(path, tensor_name="down"),
                        transformations=(Quantize(INT8, "cuda"),))
    async with WeightLoader(weights_config(tmp_path)) as loader:
        await loader.load(specs, into={"q": storage.rows(0, 4), "k": storage.rows(4, 6)}, device=device)
        got = (await loader.load([on_gpu]))["down"]
    expect = quantize(torch.cat([tensors["q"], tensors["k"].to(BF16)]), INT4_G32)
    for name, value in expect.parts.items():
        assert torch.equal(storage.parts[name].cpu(), value), name
    assert isinstance(got, QuantizedTensor) and got.device.type == "cuda"
    assert torch.equal(dequantize(got).cpu(), dequantize(quantize(tensors["down"], INT8)))


# ------------------------------------------------------------------------------------------ errors


def test_quantize_must_be_last_and_fit_the_spec(tmp_path: Path) -> None:
    source = File(tmp_path / "w.safetensors", tensor_name="w")
    with pytest.raises(TransformError, match=r"w\.safetensors: tensor 'w': Quantize\(int8\) must be the last"):
        TensorSpec("w", (4, 32), BF16, source=source, transformations=(Quantize(INT8), Cast(BF16)))
    with pytest.raises(TransformError, match=r"w\.safetensors: tensor 'w': .*makes a floating \[N, K\] weight; "
                       r"the spec says \(32,\) bfloat16"):
        TensorSpec("w", (32,), BF16, source=source, transformations=(Quantize(INT8),))
    with pytest.raises(TransformError, match=r"tensor 'w': int4 packs two inputs per byte; 47 input features"):
        TensorSpec("w", (4, 47), BF16, source=source, transformations=(Quantize(INT4_G32),))
    with pytest.raises(TypeError, match="scheme must be a QuantScheme"):
        Quantize("int8")  # type: ignore[arg-type]


async def test_load_errors_name_the_file_and_tensor(tmp_path: Path) -> None:
    path, _ = _checkpoint(tmp_path)
    src = lambda n: File(path, tensor_name=n)  # noqa: E731
    async with WeightLoader(weights_config(tmp_path)) as loader:
        where = re.escape(str(path))
        with pytest.raises(TransformError, match=rf"{where}: tensor 'bias': Quantize\(int8\): needs a floating "
                           r"\[N, K\] tensor, got \(128,\) bfloat16"):
            await loader.load([_quantized("bias", (1, 128), INT8, src("bias"))])
        with pytest.raises(TransformError, match=r"tensor 'ids': .*needs a floating \[N, K\] tensor, got \(2, 128\) "
                           "int64"):
            await loader.load([_quantized("ids", (2, 128), INT8, src("ids"))])
        with pytest.raises(TransformError, match=rf"{where}: tensor 'down': int4 packs two inputs per byte; 95 "
                           "input features"):  # the stored tensor, sliced, is not what the spec says
            await loader.load([_quantized("down", (6, 128), QuantScheme("int4", 64), src("down"), Slice(1, 0, 95))])
        with pytest.raises(SpecMismatchError, match=rf"{where}: tensor 'down' after .*: shape \(3, 256\) expected, "
                           r"got \(6, 256\)"):
            await loader.load([_quantized("down", (3, 256), INT8, src("down"))])
        with pytest.raises(ValueError, match="'q' ends in Quantize.*use WeightLoader.load"):
            await loader.load_tensors([_quantized("q", (4, 128), INT8, src("q"))])


async def test_wrong_destinations_refused_before_any_read(tmp_path: Path) -> None:
    spec = _quantized("q", (4, 128), INT4_G32, File(tmp_path / "absent.safetensors", tensor_name="q"))
    wide = QuantizedTensor.empty(INT4_G32, 4, 256, BF16)
    bad_scale = QuantizedTensor(INT4_G32, (4, 128), BF16,
                                {**QuantizedTensor.empty(INT4_G32, 4, 128, BF16).parts, "scale": torch.empty(4, 4)})
    cases: list[tuple[torch.Tensor | QuantizedTensor, str]] = [
        (torch.empty(4, 128, dtype=BF16), r"\(4, 128\) torch.bfloat16, the spec says a QuantizedTensor"),
        (QuantizedTensor.empty(INT8, 4, 128, BF16), "in int8, the spec says a QuantizedTensor .* in int4"),
        (QuantizedTensor.empty(INT4_G32, 4, 128, torch.float16), r"\(4, 128\) torch.float16"),
        (QuantizedTensor(INT4_G32, (4, 128), BF16, {n: p[:, : p.shape[1] // 2] for n, p in wide.parts.items()}),
         "part 'qweight' is not contiguous"),
        (bad_scale, r"part 'scale' is \(4, 4\) torch.float32, expected \(4, 4\) torch.bfloat16"),
    ]
    async with WeightLoader(weights_config(tmp_path)) as loader:
        for target, message in cases:
            with pytest.raises(ValueError, match=rf"the destination of 'q' is .*{message}"):
                await loader.load([spec], into={"q": target}, device=host_device())
        plain = TensorSpec("b", (4,), BF16, source=File(tmp_path / "absent.safetensors"))
        with pytest.raises(ValueError, match=r"the destination of 'b' is a QuantizedTensor .* the spec says \(4,\)"):
            await loader.load([plain], into={"b": QuantizedTensor.empty(INT8, 4, 4, BF16)}, device=host_device())


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here")
async def test_quantizing_on_an_absent_gpu_refused_before_any_io(tmp_path: Path) -> None:
    spec = TensorSpec("w", (4, 32), BF16, source=File(tmp_path / "absent.safetensors"),
                      transformations=(Quantize(INT8, "cuda"),))
    with pytest.raises(UnsupportedError, match=r"absent.safetensors: tensor 'w': Quantize\(int8, on cuda\): "
                       "quantizing on cuda needs a cuda device, which is not here"):
        async with WeightLoader(weights_config(tmp_path)) as loader:
            await loader.load([spec])


@pytest.mark.parametrize("scheme", [INT8, INT4_G32, FP8], ids=lambda s: s.describe())
def test_blocks_of_rows_quantize_as_the_whole(scheme: QuantScheme, monkeypatch: pytest.MonkeyPatch) -> None:
    w = _weight(7, 64).to(BF16)
    whole = quantize(w, scheme)
    monkeypatch.setattr(arith, "_BLOCK_ELEMENTS", 2 * 64)  # two rows a block, the last block one row
    blocks = quantize(w, scheme)
    for name, part in whole.parts.items():
        assert torch.equal(blocks.parts[name].view(torch.uint8), part.view(torch.uint8)), name
