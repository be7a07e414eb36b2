"""Published quantized checkpoints (GPTQ, AWQ, compressed-tensors, FP8) served through the linear seam:
each written byte-exact to its documented packing (tests/models/published_writers.py) from random codes,
loaded, and compared with the dense weights it stands for served unquantized, in float32 on the CPU: the
repack is exact, so the logits agree to float32 rounding. Bad checkpoints stop start-up naming the
file and the tensor. (Fixtures written by the real tools: tests/models/test_published_fixtures.py.)"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from ferrum.backends.device import Device
from ferrum.engine.block_manager import BlockManager
from ferrum.engine.observer import StepRecord
from ferrum.engine.sampling_params import SamplingParams
from ferrum.engine.scheduler import ScheduledSequence
from ferrum.engine.sequence import Sequence
from ferrum.models.config import load_model_config
from ferrum.models.layers import layer_ops
from ferrum.models.layers.quantized_linear import QuantizedLinear
from ferrum.models.llama import LlamaForCausalLM
from ferrum.models.loader import load_model
from ferrum.tokenizer.synthetic import write_synthetic_tokenizer
from ferrum.weights.errors import WeightError
from ferrum.weights.loader import WeightLoader
from ferrum.weights.locations.model_files import local_weights
from ferrum.weights.quantization.scheme import QuantizationConfig, QuantizationConfigError
from tests.engines import host_device, local_engine, make_runner
from tests.models import published_writers as w
from tests.tiny_model import save_hf_model, tiny_config

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A float32 Llama whose linear layers have 128 or 256 inputs (groups of 32 and 128 divide them)."""
    folder = Path(tmp_path_factory.mktemp("published-base"))
    config = tiny_config("llama2-mha", hidden_size=128, intermediate_size=256, num_hidden_layers=2)
    save_hf_model(folder, config, dtype=torch.float32)
    return folder


Writer = Callable[[int, int, torch.Generator, str], tuple[dict[str, torch.Tensor], torch.Tensor]]


def _write(base: Path, out: Path, quantization_config: dict[str, Any], writer: Writer,
           skip: tuple[str, ...] = ()) -> Path:
    """`out` (quantized, config.json with `quantization_config`) and `out`-dense (the weights it stands
    for, unquantized); the modules named in `skip` stay unquantized in both."""
    dense_dir = out.parent / (out.name + "-dense")
    for folder in (out, dense_dir):
        shutil.copytree(base, folder)
    state = load_file(base / "model.safetensors")
    quantized, dense = dict(state), dict(state)
    gen = torch.Generator().manual_seed(5)
    for name in sorted(state):
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or module.split(".")[-1] not in PROJECTIONS or any(module.endswith(s) for s in skip):
            continue
        n, k = state[name].shape
        tensors, weight = writer(n, k, gen, module)
        del quantized[name]
        quantized.update({f"{module}.{role}": t for role, t in tensors.items()})
        dense[name] = weight.float().contiguous()
    save_file(quantized, out / "model.safetensors")
    save_file(dense, dense_dir / "model.safetensors")
    config = json.loads((base / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return out


def _load(folder: Path, quantization: QuantizationConfig | None = None, device: Device | None = None,
          dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    device = device or host_device()
    model, _ = load_model(load_model_config(folder), local_weights(folder), device, dtype,
                          layer_ops(device), WeightLoader(), quantization=quantization)
    return model


def _logits(model: LlamaForCausalLM, device: Device | None = None) -> torch.Tensor:
    """The prefill logits of two fixed prompts."""
    runner = make_runner(model, device or host_device(), 64, 8, enforce_eager=True)
    blocks = BlockManager(num_blocks=32, block_size=8)
    g = torch.Generator().manual_seed(2)
    seqs = [Sequence(f"r{i}", torch.randint(0, 512, (n,), generator=g).tolist(), SamplingParams(max_tokens=1), 0.0)
            for i, n in enumerate((7, 19))]
    for seq in seqs:
        blocks.grow(seq, seq.num_tokens)
    logits, _ = runner.execute([ScheduledSequence(s, s.num_tokens) for s in seqs])
    return logits.float().cpu()


def _check_equal(folder: Path, quantization: QuantizationConfig | None = None) -> LlamaForCausalLM:
    model = _load(folder, quantization)
    got = _logits(model)
    ref = _logits(_load(folder.parent / (folder.name + "-dense")))
    # exact repack: the same weights, summed in another order (observed max |diff| ~1e-6 of logits ~1)
    assert (got - ref).abs().max().item() < 1e-4 * max(1.0, ref.abs().max().item())
    return model


GPTQ_CASES: dict[str, dict[str, Any]] = {
    "v1-sym-g32": dict(g=32, bits=4, sym=True, desc_act=False, v2=False),
    "v2-asym-desc_act-g32": dict(g=32, bits=4, sym=False, desc_act=True, v2=True),
    "v1-asym-per-channel": dict(g=-1, bits=4, sym=False, desc_act=False, v2=False),
    "v1-8bit-per-channel": dict(g=-1, bits=8, sym=True, desc_act=False, v2=False),
    "v2-8bit-g32-desc_act": dict(g=32, bits=8, sym=True, desc_act=True, v2=True),
    "v1-8bit-asym-g32-desc_act": dict(g=32, bits=8, sym=False, desc_act=True, v2=False),
    "v2-8bit-asym-per-channel": dict(g=-1, bits=8, sym=False, desc_act=False, v2=True),
}


@pytest.mark.parametrize("case", list(GPTQ_CASES))
def test_gptq_repacks_exactly(base: Path, tmp_path: Path, case: str) -> None:
    c = GPTQ_CASES[case]
    config = {"quant_method": "gptq", "bits": c["bits"], "group_size": c["g"], "sym": c["sym"],
              "desc_act": c["desc_act"], "checkpoint_format": "gptq_v2" if c["v2"] else "gptq"}
    folder = _write(base, tmp_path / case, config,
                    lambda n, k, gen, m: w.gptq(n, k, c["g"], c["bits"], c["sym"], c["desc_act"], c["v2"], gen, m))
    model = _check_equal(folder)
    layers = model.quantized_layers()
    assert len(layers) == 2 * 4 and "lm_head" not in layers  # qkv, o, gate_up, down per layer
    method = "int8" if c["bits"] == 8 else "int4"
    assert {layer.scheme.method for layer in layers.values()} == {method}
    assert any(layer.input_order is not None for layer in layers.values()) == c["desc_act"]
    assert all(layer.scheme.offsets == (c["bits"] == 8 and not c["sym"]) for layer in layers.values())


def test_awq_and_its_flag(base: Path, tmp_path: Path) -> None:
    config = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": ["down_proj"]}
    folder = _write(base, tmp_path / "awq", config, lambda n, k, gen, m: w.awq(n, k, 32, gen), skip=("down_proj",))
    model = _check_equal(folder, QuantizationConfig("awq_marlin"))
    assert isinstance(model.get_submodule("layers.0.mlp.gate_up_proj"), QuantizedLinear)
    assert not isinstance(model.get_submodule("layers.0.mlp.down_proj"), QuantizedLinear)


CT_GROUP: dict[str, Any] = {"targets": ["Linear"], "input_activations": None,
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}


@pytest.mark.parametrize("case", ["group-sym", "group-asym", "channel"])
def test_compressed_tensors_pack_quantized(base: Path, tmp_path: Path, case: str) -> None:
    weights = dict(CT_GROUP["weights"])
    if case == "group-asym":
        weights["symmetric"] = False
    if case == "channel":
        weights.update(strategy="channel", group_size=None)
    config = {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
              "config_groups": {"group_0": {**CT_GROUP, "weights": weights}}}
    g = None if case == "channel" else 32
    _check_equal(_write(base, tmp_path / case, config,
                        lambda n, k, gen, m: w.compressed_pack(n, k, g, case != "group-asym", torch.float32, gen)))


def test_compressed_tensors_int8_and_fp8(base: Path, tmp_path: Path) -> None:
    int8 = {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
                "input_activations": {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True}}}}
    model = _check_equal(_write(base, tmp_path / "w8a8", int8, lambda n, k, gen, m: w.compressed_int8(n, k, gen)))
    assert {layer.scheme.method for layer in model.quantized_layers().values()} == {"int8"}
    fp8 = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    model = _check_equal(_write(base, tmp_path / "fp8", fp8, lambda n, k, gen, m: w.fp8(n, k, gen, True)),
                         QuantizationConfig("fp8"))
    assert {layer.scheme.method for layer in model.quantized_layers().values()} == {"fp8"}
    block = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [48, 32]}  # rows ragged
    model = _check_equal(_write(base, tmp_path / "fp8-block", block,
                                lambda n, k, gen, m: w.fp8_block(n, k, (48, 32), gen)))
    assert {layer.scheme.describe() for layer in model.quantized_layers().values()} == {"fp8 (group 32)"}
    int8_group = {"quant_method": "compressed-tensors", "format": "int-quantized", "ignore": ["lm_head"],
                  "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                      "num_bits": 8, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}}}

    def int8_groups(n: int, k: int, gen: torch.Generator, m: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        q = torch.randint(-127, 128, (n, k), generator=gen).to(torch.int8)
        s = (torch.rand(n, k // 32, generator=gen) * 0.002 + 0.0005).to(torch.bfloat16)
        return {"weight": q, "weight_scale": s}, q.float() * s.float().repeat_interleave(32, 1)

    model = _check_equal(_write(base, tmp_path / "w8a16-g32", int8_group, int8_groups))
    assert {layer.scheme.describe() for layer in model.quantized_layers().values()} == {"int8 (group 32)"}


FP8_STATIC = {"quant_method": "fp8", "activation_scheme": "static"}


def test_fp8_static_input_scales_are_kept_and_fused_layers_take_their_largest(base: Path, tmp_path: Path) -> None:
    """activation_scheme static: each layer keeps its checkpoint input_scale per output row (a fused layer
    its parts' side by side) and its activations take the largest; the weights are served as with dynamic
    scales (on the CPU, W8A16: the logits equal the dense weights')."""
    folder = _write(base, tmp_path / "fp8-static", FP8_STATIC, lambda n, k, gen, m: w.fp8_static(n, k, gen))
    model = _check_equal(folder)
    stored = load_file(folder / "model.safetensors")
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj"),
             "o_proj": ("o_proj",), "down_proj": ("down_proj",)}
    layers = model.quantized_layers()
    assert len(layers) == 8 and {layer.scheme.describe() for layer in layers.values()} == {"fp8 (static input scale)"}
    for name, layer in layers.items():
        block, projection = name.rsplit(".", 1)
        scales = [stored[f"model.{block}.{part}.input_scale"] for part in fused[projection]]
        at = model.shard_rows(projection, layer.out_features) if len(scales) > 1 else [0, layer.out_features]
        rows = torch.cat([scale.expand(at[i + 1] - at[i]) for i, scale in enumerate(scales)])
        assert torch.equal(layer.input_scale, rows), name
        scale = layer.activation_scale()
        assert scale is not None and torch.equal(scale, torch.stack(scales).amax().reshape(1)), name
        assert layer.kernel_weight().input_scale is not None
    dynamic = _load(_write(base, tmp_path / "fp8-dynamic", {"quant_method": "fp8"},
                           lambda n, k, gen, m: w.fp8(n, k, gen, True)))
    assert all(layer.activation_scale() is None for layer in dynamic.quantized_layers().values())


@pytest.mark.parametrize("case, message", [
    ("missing", "'model.layers.0.self_attn.k_proj.input_scale' is missing"),
    ("negative", "'model.layers.1.mlp.up_proj.input_scale': a static input scale must be finite and positive"),
    ("shape", "'model.layers.0.mlp.down_proj.input_scale' has shape (2,), expected (1,)"),
])
def test_bad_fp8_static_input_scale_names_file_and_tensor(base: Path, tmp_path: Path, case: str, message: str) -> None:
    folder = _write(base, tmp_path / "bad-static", FP8_STATIC, lambda n, k, gen, m: w.fp8_static(n, k, gen))
    if case == "missing":
        _edit(folder, lambda s: s.pop("model.layers.0.self_attn.k_proj.input_scale"))
    elif case == "negative":
        _edit(folder, lambda s: s.__setitem__("model.layers.1.mlp.up_proj.input_scale", torch.tensor([-0.5])))
    else:
        _edit(folder, lambda s: s.__setitem__("model.layers.0.mlp.down_proj.input_scale", torch.ones(2)))
    with pytest.raises(WeightError) as info:
        _load(folder)
    assert str(folder / "model.safetensors") in str(info.value) and message in str(info.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_published_layers_on_the_gpu(base: Path, tmp_path: Path) -> None:
    """Each format's storage through the GPU kernels (bf16 activations, float16/float32 scales, act
    order's reordered input, the W8A8 and FP8 paths), prefill and CUDA-graph decode, against the dense
    weights in float32 on the CPU: bf16 rounding only (observed below 1%)."""
    from ferrum.backends.cuda import CUDABackend, probe_cuda_device

    device = CUDABackend(probe_cuda_device(0)).device()
    cases: dict[str, tuple[dict[str, Any], Writer]] = {
        "gptq-sym": (GPTQ_4, lambda n, k, gen, m: w.gptq(n, k, 32, 4, True, False, False, gen)),
        "gptq-desc_act": ({**GPTQ_4, "sym": False, "desc_act": True, "checkpoint_format": "gptq_v2"},
                          lambda n, k, gen, m: w.gptq(n, k, 32, 4, False, True, True, gen, m)),
        "awq": ({"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"},
                lambda n, k, gen, m: w.awq(n, k, 32, gen)),
        "fp8": ({"quant_method": "fp8"}, lambda n, k, gen, m: w.fp8(n, k, gen, True)),
        "fp8-static": (FP8_STATIC, lambda n, k, gen, m: w.fp8_static(n, k, gen)),  # 26 rows: the static W8A8
        "fp8-block": ({"quant_method": "fp8", "weight_block_size": [48, 32]},
                      lambda n, k, gen, m: w.fp8_block(n, k, (48, 32), gen)),
        "gptq-8bit-g32": ({**GPTQ_4, "bits": 8}, lambda n, k, gen, m: w.gptq(n, k, 32, 8, True, False, False, gen)),
        "gptq-8bit-asym": ({**GPTQ_4, "bits": 8, "sym": False},  # int8 zeros per group: added by the layer
                           lambda n, k, gen, m: w.gptq(n, k, 32, 8, False, False, False, gen)),
    }
    for name, (config, writer) in cases.items():
        folder = _write(base, tmp_path / name, config, writer)
        ref = _logits(_load(folder.parent / (folder.name + "-dense")))
        model = _load(folder, device=device, dtype=torch.bfloat16)
        for got in (_logits(model, device), _decode_logits(model, device)):
            err = ((got - ref).norm() / ref.norm()).item()
            assert err < 0.02, f"{name}: relative error {err}"


def _decode_logits(model: LlamaForCausalLM, device: Device) -> torch.Tensor:
    """The logits of two prompts' prefill through the GPU runner with CUDA graphs, one row at a time
    (the decode path: GEMV kernels, or the reordering forward for act order)."""
    runner = make_runner(model, device, 64, 8)
    blocks = BlockManager(num_blocks=32, block_size=8)
    g = torch.Generator().manual_seed(2)
    rows = []
    for i, n in enumerate((7, 19)):
        prompt = torch.randint(0, 512, (n,), generator=g).tolist()
        seq = Sequence(f"d{i}", prompt[:-1], SamplingParams(max_tokens=2), 0.0)
        blocks.grow(seq, seq.num_tokens)
        _, done = runner.execute([ScheduledSequence(seq, seq.num_tokens)])
        seq.output_token_ids.append(prompt[-1])
        blocks.grow(seq, seq.num_tokens)
        logits, _ = runner.execute([ScheduledSequence(seq, 1)])
        rows.append(logits.float().cpu()[0])
    return torch.stack(rows)


# ------------------------------------------------------------------------------ bad checkpoints

GPTQ_4 = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "desc_act": False}


def _gptq(base: Path, folder: Path, config: dict[str, Any] | None = None) -> Path:
    return _write(base, folder, config or GPTQ_4, lambda n, k, gen, m: w.gptq(n, k, 32, 4, True, False, False, gen))


def _edit(folder: Path, change: Callable[[dict[str, torch.Tensor]], object]) -> None:
    state = load_file(folder / "model.safetensors")
    change(state)
    save_file(state, folder / "model.safetensors")


@pytest.mark.parametrize("case, message", [
    ("missing scales", "'model.layers.0.self_attn.q_proj.scales' is missing"),
    ("wrong bits", "'model.layers.0.self_attn.q_proj.qweight' has shape"),
    ("g_idx out of range", "'model.layers.1.mlp.down_proj.g_idx': group indices 0..99 are out of range"),
    ("zeros not symmetric", "'model.layers.0.self_attn.k_proj.qzeros': the config says sym"),
])
def test_bad_gptq_checkpoint_names_file_and_tensor(base: Path, tmp_path: Path, case: str, message: str) -> None:
    folder = _gptq(base, tmp_path / "bad")
    if case == "missing scales":
        _edit(folder, lambda s: s.pop("model.layers.0.self_attn.q_proj.scales"))
    elif case == "wrong bits":
        (folder / "config.json").write_text(json.dumps(
            {**json.loads((folder / "config.json").read_text()), "quantization_config": {**GPTQ_4, "bits": 8,
                                                                                          "group_size": -1}}))
    elif case == "g_idx out of range":
        _edit(folder, lambda s: s["model.layers.1.mlp.down_proj.g_idx"].__setitem__(3, 99))
    else:
        _edit(folder, lambda s: s.__setitem__("model.layers.0.self_attn.k_proj.qzeros",
                                              torch.zeros_like(s["model.layers.0.self_attn.k_proj.qzeros"])))
    with pytest.raises(WeightError) as info:
        _load(folder)
    assert str(folder / "model.safetensors") in str(info.value) and message in str(info.value)


@pytest.mark.parametrize("config, message", [
    ({**GPTQ_4, "bits": 3}, "GPTQ with bits=3: Ferrum serves 4- and 8-bit GPTQ"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes': bitsandbytes'"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "ModelOpt checkpoints (NVFP4, FP8) are not served"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "config_groups": {"g": {
        "targets": ["Linear"], "weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group"}}}},
     "format 'nvfp4-pack-quantized' is not served"),
    ({"quant_method": "fp8", "weight_block_size": [128, 100]}, "FP8 weight_block_size [128, 100]: Ferrum serves"),
])
def test_unserved_schemes_are_refused_by_name(base: Path, tmp_path: Path, config: dict[str, Any],
                                              message: str) -> None:
    folder = tmp_path / "unserved"
    shutil.copytree(base, folder)
    raw = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "quantization_config": config}))
    with pytest.raises(QuantizationConfigError, match="config.json") as info:
        load_model_config(folder)
    assert message in str(info.value)


def test_flag_and_checkpoint_must_agree(base: Path, tmp_path: Path) -> None:
    folder = _gptq(base, tmp_path / "gptq")
    with pytest.raises(QuantizationConfigError, match=r"already quantized \(gptq .*--quantization int4 would"):
        _load(folder, QuantizationConfig("int4"))
    with pytest.raises(QuantizationConfigError, match="--quantization awq"):
        _load(folder, QuantizationConfig("awq"))
    with pytest.raises(QuantizationConfigError, match="expects a gptq checkpoint, but config.json has no"):
        _load(base, QuantizationConfig("gptq"))


def _tp_logits(folder: Path, size: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    engine = local_engine(folder, tensor_parallel_size=size, dtype="float32", max_num_seqs=4,
                          max_num_batched_tokens=64, kv_cache_memory_gb=0.01)
    records: list[StepRecord] = []
    remove = engine.add_observer(records.append)
    try:
        tokens = engine.generate([[5, 17, 42, 7, 99, 3, 250], [9] * 12], SamplingParams(max_tokens=3, temperature=0))
    finally:
        remove()
        engine.release()
    return tokens, [r.logits for r in records if r.logits is not None and r.logits.numel()]


def test_tensor_parallel_ranks_keep_their_shards_of_published_layers(base: Path, tmp_path: Path) -> None:
    """Two ranks (gloo) of a GPTQ checkpoint (asymmetric, groups of 32): each repacks a layer's
    tensors and keeps its rows (q/k/v, gate/up) or whole input groups (o_proj, down_proj): the logits
    equal one process's up to summation order."""
    config = {**GPTQ_4, "sym": False, "checkpoint_format": "gptq_v2"}
    folder = _write(base, tmp_path / "tp", config, lambda n, k, gen, m: w.gptq(n, k, 32, 4, False, False, True, gen))
    write_synthetic_tokenizer(folder, 512)
    one_tokens, one_logits = _tp_logits(folder, 1)
    two_tokens, two_logits = _tp_logits(folder, 2)
    assert two_tokens == one_tokens and len(two_logits) == len(one_logits) > 0
    for got, want in zip(two_logits, one_logits, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
