"""TorchModelRunner: the model and its paged KV cache on any torch device, attention in plain
PyTorch (torch_paged) or the CPU's kernels (cpu_paged). The CPU's runner: one eager forward a step,
logits back on the host; steps of few rows through the CPU's decode chain (ferrum.models.cpu_decode)
where the model's layers allow it."""

from __future__ import annotations

import torch

from ferrum.backends.device import Device
from ferrum.engine.runner import DraftedBurst, GreedyBurst, advance, pack_step, score_prompts
from ferrum.engine.scheduler import ScheduledSequence
from ferrum.engine.sequence import Sequence
from ferrum.models.attention.cpu_paged import CpuAttentionBatch, CpuPagedAttention
from ferrum.models.attention.layout import KVCacheLayout
from ferrum.models.attention.packed_step import host_ints
from ferrum.models.attention.torch_paged import TorchPagedAttention
from ferrum.models.cpu_decode import CpuDecodeChain
from ferrum.models.llama import LlamaForCausalLM


class TorchModelRunner:
    max_burst = 0  # no greedy bursts: every decode is one host round trip
    max_draft_rows = 0  # nor drafted ones
    max_verify_rows = 0  # every step eager
    step_seconds: dict[int, float] = {}  # nothing timed ahead: the speculation policy measures its steps

    def __init__(
        self, model: LlamaForCausalLM, device: Device, layout: KVCacheLayout, num_blocks: int,
        attention: TorchPagedAttention | CpuPagedAttention,
    ) -> None:
        if device.packed_bf16_linears and layout.dtype == torch.bfloat16:
            from ferrum.models.layers.packed_linear import pack_linears

            pack_linears(model)
        self.model = model
        self.device = device.torch_device
        self.layout = layout
        self.attention = attention
        # cpu_paged reads only the slots of positions already written: its cache is never zeroed; its
        # kernels read each kv head's keys of a block, and its blocks one after another, as runs of memory
        # (block_major: tiles stored head-major)
        cpu_paged = isinstance(attention, CpuPagedAttention)
        self.kv_caches = layout.allocate(num_blocks, self.device, zeroed=not cpu_paged, block_major=cpu_paged)
        self.chain = CpuDecodeChain.for_model(model) if cpu_paged else None

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSequence]) -> tuple[torch.Tensor, list[Sequence]]:
        plan = pack_step(scheduled, self.layout)
        batch = self.attention.step_inputs(plan.step, self.model.rotary)
        ids = host_ints(plan.step.input_ids).to(self.device)
        if self.chain is not None and len(ids) <= self.chain.max_rows:
            assert isinstance(batch, CpuAttentionBatch)
            hidden = self.chain.hidden(ids, self.kv_caches, batch)
        else:
            hidden = self.model(ids, self.kv_caches, batch)
        advance(scheduled)
        logits = torch.empty(0, self.model.config.vocab_size)
        if plan.sample_rows:
            rows = torch.tensor(plan.sample_rows, device=self.device)
            logits = self.model.compute_logits(hidden[rows]).cpu()
        if plan.prompt_rows:
            score_prompts(hidden, self.model.compute_logits, plan.prompt_rows)
        return logits, plan.sample_seqs

    def launch_greedy(self, seqs: list[Sequence], steps: int, continue_at: list[int] | None = None) -> GreedyBurst:
        raise NotImplementedError("TorchModelRunner runs no greedy bursts (max_burst is 0)")

    def read_greedy(self, burst: GreedyBurst) -> list[list[int]]:
        raise NotImplementedError("TorchModelRunner runs no greedy bursts (max_burst is 0)")

    def launch_drafted(self, seqs: list[Sequence], steps: int, k: int) -> DraftedBurst:
        raise NotImplementedError("TorchModelRunner runs no drafted bursts (max_draft_rows is 0)")

    def read_drafted(self, burst: DraftedBurst) -> list[list[list[int]]]:
        raise NotImplementedError("TorchModelRunner runs no drafted bursts (max_draft_rows is 0)")

    def release(self) -> None:
        """Drops the KV cache and the model (the memory returns to the allocator)."""
        self.kv_caches = []
        self.model = None  # type: ignore[assignment]
