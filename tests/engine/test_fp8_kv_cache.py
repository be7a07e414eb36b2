"""The fp8 (e4m3) KV cache (kv_cache_dtype fp8): where it runs, its scales (the checkpoint's, else measured
at start-up), and the served model against the same model with a cache in the serving dtype, through
the plain torch attention and through the GPU path's Triton kernels (interpreted where there is no GPU)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ferrum.engine.config import EngineConfig
from ferrum.engine.llm_engine import LLMEngine
from ferrum.engine.sampling_params import SamplingParams
from ferrum.kernels.config import KernelConfig
from ferrum.models.attention import select_attention
from ferrum.models.attention.layer import Attention
from ferrum.models.attention.layout import KVCacheLayout
from ferrum.tokenizer.synthetic import write_synthetic_tokenizer
from ferrum.weights.locations.model_files import ModelFiles, local_weights
from ferrum.weights.spec.sources import File
from tests.engines import host_device, local_engine
from tests.tiny_model import save_hf_model, tiny_config
from tests.triton_interpreter import gpu_path_device

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
FIXTURES = Path(__file__).resolve().parents[1] / "data" / "quantized"
# the chosen tokens' logprobs, fp8 cache against float32: measured 0.0011 (torch), 0.0019 (Triton) here
BOUND_LOGPROB = 0.03
NEAR_TIE = 0.05  # a top-2 margin the cache's rounding may turn


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A SmolLM2-shaped tiny model (head_dim 16: the GPU's dot products take no narrower)."""
    folder = tmp_path_factory.mktemp("fp8-kv") / "tiny"
    save_hf_model(folder, tiny_config("smollm2-like"))
    write_synthetic_tokenizer(folder, 512)
    return folder


def _engine(folder: Path, device, kv: str, max_model_len: int = 256, cpu_kernels: bool = True) -> LLMEngine:
    files = ModelFiles(File(folder), folder, local_weights(folder), complete=True)
    config = EngineConfig(dtype="float32", max_model_len=max_model_len, kv_cache_memory_gb=0.01, max_num_seqs=4,
                          max_num_batched_tokens=256, block_size=8, kv_cache_dtype=kv,
                          kernels=KernelConfig(cpu=cpu_kernels))
    return LLMEngine(config, device, files)


Step = tuple[int, float, float]  # a generated token, its logprob, the top-2 margin


def _run(engine: LLMEngine) -> list[list[Step]]:
    prompts = [engine.tokenizer.encode(t) for t in ("hello there, how", "a b c d e f g h i j k l m n o p q r s t")]
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2))
    steps: dict[str, list[Step]] = {"0": [], "1": []}
    while engine.has_work:
        for out in engine.step():
            for token, lp in zip(out.new_token_ids, out.new_logprobs or (), strict=True):
                steps[out.request_id].append((token, lp.logprob, lp.top[0].logprob - lp.top[1].logprob))
    return [steps["0"], steps["1"]]


def _compare(plain: list[list[Step]], fp8: list[list[Step]]) -> tuple[float, int]:
    """The largest logprob difference while the two runs' tokens agree, and how many sequences parted;
    each parting must be at a near-tie of the plain run (top-2 margin under NEAR_TIE)."""
    largest, parted = 0.0, 0
    for ours, ref in zip(fp8, plain, strict=True):
        for (token, lp, _), (ref_token, ref_lp, margin) in zip(ours, ref, strict=True):
            if token != ref_token:
                assert margin < NEAR_TIE, f"the fp8 cache changed a token with a top-2 margin of {margin:.4f}"
                parted += 1
                break
            largest = max(largest, abs(lp - ref_lp))
    return largest, parted


def test_fp8_names_layout_and_where_it_is_read() -> None:
    for name in ("fp8", "fp8_e4m3"):
        assert EngineConfig(kv_cache_dtype=name).kv_dtype(torch.bfloat16) == torch.float8_e4m3fn
    layout = KVCacheLayout(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float8_e4m3fn, block_size=4)
    assert layout.fp8 and not layout.quantized and layout.bytes_per_token == 2 * 2 * 2 * 8  # half of bf16's
    with pytest.raises(ValueError, match="fp8 cannot be read on cpu: the CPU kernels' attention"):
        select_attention(host_device(), layout, KernelConfig(), cpu_kernels=True)
    no_fp8 = dataclasses.replace(gpu_path_device(), fp8=False)
    with pytest.raises(ValueError, match=r"has no fp8 \(compute capability 8.9\+\)"):
        select_attention(no_fp8, layout, KernelConfig())
    assert select_attention(host_device(), layout, KernelConfig()).name == "torch_paged"


@pytest.mark.parametrize("path", ["torch_paged", "triton_paged"])
def test_fp8_cache_serves_as_the_float32_cache(tiny: Path, path: str) -> None:
    device = host_device() if path == "torch_paged" else dataclasses.replace(gpu_path_device(), fp8=True)
    plain = _engine(tiny, device, "auto", cpu_kernels=path != "torch_paged")
    fp8 = _engine(tiny, device, "fp8", cpu_kernels=path != "torch_paged")
    assert fp8.attention.name == path
    assert fp8.rank.num_blocks >= 3 * plain.rank.num_blocks  # 1 byte a value against float32's 4
    scales = torch.stack([m.kv_scale for m in fp8.model.modules() if isinstance(m, Attention)])
    assert scales.dtype == torch.float32  # not the serving dtype the model was built in
    assert bool((scales != 1.0).all()) and bool((scales > 0).all())  # measured at start-up
    differ, parted = _compare(_run(plain), _run(fp8))
    print(f"{path}: sequences parted at a near-tie {parted} of 2, largest logprob difference before {differ:.4f}")
    assert differ < BOUND_LOGPROB
    assert fp8.stats().kv_cache_dtype == "float8_e4m3fn" and fp8.stats().kv_blocks_used == 0


def test_fp8_cache_takes_the_checkpoints_scales(tmp_path: Path) -> None:
    """compressed-tensors' kv_cache_scheme carries each layer's k_scale and v_scale: used as they are."""
    from safetensors import safe_open

    fixture = FIXTURES / "ct-fp8-static-kv"
    folder = tmp_path / fixture.name  # the fixture with a tokenizer of its vocabulary
    folder.mkdir()
    for file in fixture.iterdir():
        (folder / file.name).symlink_to(file)
    write_synthetic_tokenizer(folder, json.loads((fixture / "config.json").read_text())["vocab_size"])
    engine = _engine(folder, host_device(), "fp8", max_model_len=128, cpu_kernels=False)
    layers = [m for m in engine.model.modules() if isinstance(m, Attention)]
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for i, layer in enumerate(layers):
            stored = [f.get_tensor(f"model.layers.{i}.self_attn.{n}").float().reshape(()) for n in ("k_scale",
                                                                                                     "v_scale")]
            assert torch.equal(layer.kv_scale, torch.stack(stored)), i
    assert all(len(steps) == 12 for steps in _run(engine))


def test_fp8_cache_at_tensor_parallel_size_2(tmp_path: Path) -> None:
    """Every rank measures the scales of its own kv heads on the same prompt (their collectives meet);
    on gloo the two ranks give the single process's tokens."""
    folder = tmp_path / "tiny"
    save_hf_model(folder, tiny_config("llama3.2-gqa-tied-rope-scaling"), demo_tokenizer=True)
    prompts = [[5, 17, 42, 7, 99, 3, 250, 11, 64, 8, 301, 2, 77], [400, 1, 2, 3]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    settings: dict[str, Any] = dict(dtype="float32", kv_cache_memory_gb=0.01, kv_cache_dtype="fp8",
                                    kernels={"cpu": False})
    single = local_engine(folder, **settings)
    try:
        want = single.generate(prompts, params)
    finally:
        single.release()
    split = local_engine(folder, tensor_parallel_size=2, **settings)
    try:
        assert split.generate(prompts, params) == want
        assert all(bool((m.kv_scale != 1.0).all()) for m in split.model.modules() if isinstance(m, Attention))
    finally:
        split.release()
