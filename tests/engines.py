"""Engines, models and runners for the tests, built through the same pipeline as `ferrum serve`.

    host_device()                       the CPU's Device as its backend probes it
    local_engine(folder, **settings)    an LLMEngine for a model folder on the CPU (or `backend=`)
    load_test_model(folder, device, dtype)   our model of a folder, loaded through the WeightLoader
    make_runner(model, device, blocks, block_size)   the runner the engine would pick for `device`
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ferrum.backends.cpu import CPUBackend
from ferrum.backends.device import Device
from ferrum.engine.builder import create_engine
from ferrum.engine.config import EngineConfig
from ferrum.engine.llm_engine import LLMEngine
from ferrum.engine.model_rank import runner_for
from ferrum.kernels.config import KernelConfig
from ferrum.models.attention import select_attention
from ferrum.models.attention.layout import KVCacheLayout
from ferrum.models.config import load_model_config
from ferrum.models.layers import layer_ops
from ferrum.models.llama import LlamaForCausalLM
from ferrum.models.loader import load_model
from ferrum.weights.loader import WeightLoader
from ferrum.weights.locations.model_files import local_weights
from ferrum.weights.spec.loader_config import WeightLoaderConfig


def host_device() -> Device:
    return CPUBackend().device()


def local_engine(location: Any, backend: str = "cpu", **settings: Any) -> LLMEngine:
    """An engine for a model location (a folder, a URL, a mapping...), selected and resolved as
    `ferrum serve` does; `settings` are EngineConfig's fields, or `weights=` a WeightLoaderConfig."""
    return create_engine(location, backend=backend, **settings)


def load_test_model(folder: Path, device: Device, dtype: torch.dtype) -> LlamaForCausalLM:
    """Our model of the folder, on `device` in `dtype`, with the layer ops the engine would choose."""
    config = load_model_config(folder)
    loader = WeightLoader(WeightLoaderConfig(cache_enabled=False, progress="off"))
    return load_model(config, local_weights(folder), device, dtype, layer_ops(device), loader)[0]


def make_runner(model: LlamaForCausalLM, device: Device, num_blocks: int, block_size: int,
                max_model_len: int = 256, **settings: Any):
    """The runner the engine picks for `device` (the Torch runner, or the GPU runner: eager on a
    device without CUDA graphs), over a KV cache of `num_blocks` blocks."""
    dtype = model.embed_tokens.weight.dtype
    layout = KVCacheLayout.of(model.config, dtype, block_size)
    config = EngineConfig(block_size=block_size, max_num_seqs=settings.pop("max_num_seqs", 8), **settings)
    config = config.for_device(device)
    attention = select_attention(device, layout, config.kernels)
    return runner_for(model, device, layout, num_blocks, attention, config, max_model_len)


__all__ = ["KernelConfig", "host_device", "load_test_model", "local_engine", "make_runner"]


def without_default_quantization(engine: dict[str, Any]) -> dict[str, Any]:
    """The engine section less the server's default `quantization: {method: auto}`."""
    return {k: v for k, v in engine.items() if not (k == "quantization" and v.get("method") == "auto")}
