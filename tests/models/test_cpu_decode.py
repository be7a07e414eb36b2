"""The CPU's decode chain (ferrum.models.cpu_decode: every layer of a step of few rows in one C++
call) against the layered forward it stands for, and the int8 LM head (ferrum.models.layers.int8_head)
against its dequantized weight: quantization auto on tiny models (int4 groups of 32 through the
integer GEMV)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch import nn

from ferrum.engine.config import EngineConfig
from ferrum.engine.llm_engine import LLMEngine
from ferrum.engine.sampling_params import SamplingParams
from ferrum.kernels.cpu.build import compiler, load_cpu_kernels
from ferrum.models.cpu_decode import CpuDecodeChain
from ferrum.models.layers.int8_head import Int8Head
from ferrum.weights.locations.model_files import ModelFiles, local_weights
from ferrum.weights.quantization.scheme import QuantizationConfig
from ferrum.weights.spec.sources import File
from tests.engines import host_device
from tests.tiny_model import DEMO, save_hf_model, tiny_config

pytestmark = [
    pytest.mark.skipif(compiler() is None, reason="no C++ compiler to build the CPU kernels with"),
    pytest.mark.skipif(not (DEMO / "tokenizer.json").is_file(), reason="the demo model is not prepared (`make model`)"),
]

PROMPTS = [[5, 17, 99, 3, 250, 7], [11, 12], [400, 3, 3, 3, 60, 61, 62, 63, 64, 65, 66, 9, 10]]


def auto_engine(folder: Path) -> LLMEngine:
    """quantization auto on this CPU, told its cache holds 64 KiB: a tiny model's weights then count as
    streamed from memory, and auto quantizes them as it would a real model's."""
    files = ModelFiles(File(folder), folder, local_weights(folder), complete=True)
    config = EngineConfig(dtype="bfloat16", max_model_len=128, kv_cache_memory_gb=0.01, enable_prefix_caching=False,
                          quantization=QuantizationConfig("auto"))
    return LLMEngine(config, replace(host_device(), cache_bytes=2**16), files)


def run(engine: LLMEngine, prompts: list[list[int]]) -> list[list[tuple[int, float, tuple[tuple[int, float], ...]]]]:
    """Each request's tokens with their logprobs and top 3, greedy, all three requests batched."""
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    got: dict[str, list[tuple[int, float, tuple[tuple[int, float], ...]]]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_work:
        for out in engine.step():
            for lp in out.new_logprobs or ():
                got[out.request_id].append((lp.token_id, lp.logprob, tuple((t.token_id, t.logprob) for t in lp.top)))
    return list(got.values())


@pytest.mark.parametrize("family", ["smollm2-like", "qwen2-qkv-bias"])
def test_the_chain_equals_the_layered_forward(tmp_path: Path, family: str) -> None:
    """Bit for bit (same kernels, same order): prefills of up to 13 rows and decodes of 3 rows, with
    and without qkv biases; the chain is what auto's steps take."""
    save_hf_model(tmp_path, tiny_config(family), dtype=torch.bfloat16, demo_tokenizer=True)
    engine = auto_engine(tmp_path)
    try:
        runner = engine.runner
        assert isinstance(runner.chain, CpuDecodeChain)  # type: ignore[attr-defined]
        # every projection int4: the chain takes steps of fewer rows than the kernels' dense products
        assert runner.chain.max_rows == torch.ops.ferrum_cpu.int4_dense_rows() - 1  # type: ignore[attr-defined]
        chained = run(engine, PROMPTS)
        runner.chain = None  # type: ignore[attr-defined]
        layered = run(engine, PROMPTS)
        assert chained == layered
        assert all(len(tokens) == 8 for tokens in chained)
    finally:
        engine.release()


def test_int8_head_is_its_dequantized_weight_in_float32() -> None:
    """Every step takes the int8 weight with float activations; the logits equal the float32 product with
    the dequantized weight up to summation order, and that weight is within half a step (max |w| of its
    group of 32 / 254) of the bf16 one. Each row's logits are the same bits in a step of any size (a verify
    step's rows score as one-row decodes; a request's greedy answer does not depend on its batch)."""
    load_cpu_kernels(Path("~/.cache/ferrum/kernels").expanduser())
    torch.manual_seed(1)
    dense = nn.Linear(96, 1000, bias=False).to(torch.bfloat16)
    head = Int8Head(dense)
    weight = dense.weight.float()
    step = weight.view(1000, 3, 32).abs().amax(-1, keepdim=True) / 127
    assert ((head.dequantized().view(1000, 3, 32) - weight.view(1000, 3, 32)).abs() <= step / 2 + 1e-7).all()
    with torch.no_grad():
        for rows in (1, 4, 5, 8, 9, 67):
            x = torch.randn(rows, 96).to(torch.bfloat16)
            logits = head(x)
            assert logits.dtype == torch.float32 and logits.shape == (rows, 1000)
            torch.testing.assert_close(logits, x.float() @ head.dequantized().t(), rtol=1e-5, atol=1e-5)
            assert torch.equal(logits, torch.cat([head(row) for row in x.split(1)]))
