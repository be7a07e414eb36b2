"""The engine on the GPU path (the Triton attention backend, Triton layer ops, the GPU runner's
eager steps) picked from a Device, run in Triton's interpreter where there is no GPU: the same
greedy tokens as the CPU path, through LLMEngine itself."""

from __future__ import annotations

from pathlib import Path

import pytest

from ferrum.engine.config import EngineConfig
from ferrum.engine.llm_engine import LLMEngine
from ferrum.engine.sampling_params import SamplingParams
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
