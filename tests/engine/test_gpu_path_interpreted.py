"""The engine on the GPU path (the Triton attention backend, Triton layer ops, the GPU runner's
eager steps) picked from a Device, run in Triton's interpreter where there is no GPU: the same
greedy tokens as the CPU path, through LLMEngine itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from ferrum.engine.config import EngineConfig
from ferrum.engine.llm_engine import LLMEngine
from ferrum.engine.sampling_params import SamplingParams
from ferrum.engine.speculative.config import SpeculativeConfig
from ferrum.weights.locations.model_files import ModelFiles, local_weights
from ferrum.weights.spec.sources import File
from tests.engines import host_device
from tests.tiny_model import make_tiny_llama
from tests.triton_interpreter import gpu_path_device

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("gpu-path") / "tiny")


def _engine(folder: Path, device) -> LLMEngine:
    files = ModelFiles(File(folder), folder, local_weights(folder), complete=True)
    config = EngineConfig(dtype="float32", max_model_len=128, kv_cache_memory_gb=0.01, max_num_seqs=4,
                          max_num_batched_tokens=64, block_size=8)
    return LLMEngine(config, device, files)


def test_gpu_path_engine_gives_the_cpu_path_tokens(tiny: Path) -> None:
    cpu = _engine(tiny, host_device())
    gpu_path = _engine(tiny, gpu_path_device())
    assert gpu_path.attention.name == "triton_paged"
    assert cpu.attention.name in ("cpu_paged", "torch_paged")  # torch_paged where no C++ compiler builds the kernels
    assert gpu_path.runner.max_burst == 0  # no CUDA graphs on this device: eager steps, no bursts
    prompts = [cpu.tokenizer.encode(text) for text in ("hello there", "a b c d e f g h i j k l m n o p q r s t")]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    assert gpu_path.generate(prompts, params) == cpu.generate(prompts, params)
    assert gpu_path.stats().kv_blocks_used == 0


def test_gpu_path_speculates_as_the_cpu_path_decodes(tiny: Path) -> None:
    """Speculative decoding on the GPU path (its eager steps: the prefill kernel over each last token and its
    draft): the CPU path's plain greedy tokens, drafts verified and kept."""
    files = ModelFiles(File(tiny), tiny, local_weights(tiny), complete=True)
    spec = SpeculativeConfig(num_speculative_tokens=3, adaptive=False)
    config = EngineConfig(dtype="float32", max_model_len=128, kv_cache_memory_gb=0.01, max_num_seqs=4,
                          max_num_batched_tokens=64, block_size=8, speculative_config=spec)
    gpu_path = LLMEngine(config, gpu_path_device(), files)
    cpu = _engine(tiny, host_device())
    prompts = [cpu.tokenizer.encode("one two three four one two three four one two three")]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    assert gpu_path.generate(prompts, params) == cpu.generate(prompts, params)
    assert gpu_path.stats().spec_num_drafts > 0 and gpu_path.stats().kv_blocks_used == 0
