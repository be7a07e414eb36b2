"""Sizes the KV cache on a GPU from what is left once the model and one full step fit.

The budget is gpu_memory_utilization of the device's memory, less the memory other programs
and the CUDA context hold, less the peak that loading the model and running one step of
max_num_batched_tokens tokens reached (measured, not guessed), less room for the decode CUDA
graphs' logits. What remains becomes KV blocks.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ferrum.engine.config import EngineConfig
from ferrum.engine.gpu_model_runner import GPUModelRunner
from ferrum.engine.sampling_params import SamplingParams
from ferrum.engine.scheduler import ScheduledSequence
from ferrum.engine.sequence import Sequence
from ferrum.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)

GRAPH_SLACK_BYTES = 256 * 2**20


@dataclass(frozen=True)
class GpuMemoryPlan:
    total_bytes: int
    weights_bytes: int
    peak_step_bytes: int  # torch's peak during the profiling step, weights included
    other_bytes: int  # CUDA context and other processes
    kv_cache_bytes: int
    num_blocks: int


def plan_kv_cache(model: LlamaForCausalLM, config: EngineConfig, max_model_len: int) -> GpuMemoryPlan:
    device = torch.device(config.device)
    cfg = model.config
    dtype = model.embed_tokens.weight.dtype
    block_bytes = GPUModelRunner.kv_bytes_per_token(cfg, dtype) * config.block_size
    torch.cuda.synchronize(device)
    weights = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    _profile_step(model, config, max_model_len)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    other = total - free - torch.cuda.memory_reserved(device)
    graphs = config.max_num_seqs * cfg.vocab_size * 6 + GRAPH_SLACK_BYTES  # logits (bf16 + fp32) per row
    if config.kv_cache_memory_gb is not None:
        kv_bytes = int(config.kv_cache_memory_gb * 2**30)
    else:
        kv_bytes = int(total * config.gpu_memory_utilization) - peak - other - graphs
    num_blocks = max(0, kv_bytes // block_bytes)
    plan = GpuMemoryPlan(total, weights, peak, other, kv_bytes, num_blocks)
    log.info(
        "GPU memory: %.1f GiB total, weights %.2f GiB, step peak %.2f GiB, other %.2f GiB -> KV cache %.2f GiB "
        "(%d blocks)", total / 2**30, weights / 2**30, peak / 2**30, other / 2**30, kv_bytes / 2**30, num_blocks,
    )
    return plan


def _profile_step(model: LlamaForCausalLM, config: EngineConfig, max_model_len: int) -> None:
    """One eager step of max_num_batched_tokens prompt tokens over a scratch cache of their size, with
    a decode beside it, so that it also compiles every kernel a mixed step uses before serving starts."""
    tokens = min(config.max_num_batched_tokens, max_model_len)
    blocks = -(-tokens // config.block_size)
    runner = GPUModelRunner(model, blocks + 2, config.block_size, config.device, config.max_num_seqs,
                            max_model_len, use_cuda_graphs=False)
    prompt = torch.randint(0, model.config.vocab_size, (tokens,)).tolist()
    seq = Sequence("profile", prompt, SamplingParams(max_tokens=1), 0.0)
    seq.block_table = list(range(blocks))
    decode = Sequence("profile-decode", prompt[:2], SamplingParams(max_tokens=1), 0.0)
    decode.block_table = [blocks]
    decode.num_computed_tokens = 1
    logits, _ = runner.execute([ScheduledSequence(decode, 1), ScheduledSequence(seq, tokens)])
    # the sampler's widest temporary: softmax over max_num_seqs rows of logits
    torch.softmax(logits[:1].expand(min(config.max_num_seqs, tokens), -1), dim=-1)
    runner.kv_caches = []
