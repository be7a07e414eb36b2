"""GPUModelRunner: the model and its paged KV cache on a GPU, attention through the Triton
kernels that read the paged cache (triton_paged).

Decode steps replay CUDA graphs (ferrum.engine.cuda_graphs), which also run greedy bursts and drafted
bursts (ferrum.engine.draft_bursts), and so do speculative steps whose rows (each sequence's last token
and its draft's) fit a graph's batch. Other steps (prefills, chunks, mixed batches) run eagerly: their
decode rows through the decode kernel, their prompts through the prefill kernel, the step padded to a
token-count bucket that start-up has already run once (a new GEMM shape costs cuBLAS a kernel choice and
a module load mid-serving). Logits stay on the device for sampling. A step that scores prompt tokens (a
request asking for prompt logprobs; never a decode-only step) runs eagerly like any prefill, its scores
read back at its end. Without CUDA graphs (`enforce_eager`, or a device without them: Triton's interpreter
in tests) every step runs eagerly and there are no bursts.
"""

from __future__ import annotations

import logging
import time

import torch

from ferrum.backends.device import Device
from ferrum.engine.config import EngineConfig
from ferrum.engine.cuda_graphs import DecodeGraphs, GraphBurst, graph_batch_sizes
from ferrum.engine.draft_bursts import DraftBurst, DraftBursts
from ferrum.engine.runner import DraftedBurst, GreedyBurst, advance, pack_step, score_prompts
from ferrum.engine.sampling_params import SamplingParams
from ferrum.engine.scheduler import ScheduledSequence
from ferrum.engine.sequence import Sequence
from ferrum.models.attention.layout import KVCacheLayout
from ferrum.models.attention.packed_step import host_ints
from ferrum.models.attention.triton_paged import TritonPagedAttention
from ferrum.models.fused_decode import FusedDecode
from ferrum.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


def eager_bucket(num_tokens: int) -> int:
    """Token count an eager step is padded to: a multiple of 16 up to 256, then of 256."""
    step = 16 if num_tokens <= 256 else 256
    return -(-num_tokens // step) * step


def eager_buckets(max_tokens: int) -> list[int]:
    return sorted({eager_bucket(n) for n in [*range(16, 257, 16), *range(512, max_tokens + 256, 256)]})


def prompt_keys(scheduled: list[ScheduledSequence]) -> int:
    """The keys the rows of the step's prompt chunks attend to (each row its context: past tokens and the chunk's
    up to its own); decodes and drafts count nothing (a verify step's rows go through the graphs at any length)."""
    keys = 0
    for s in scheduled:
        n = s.num_new_tokens
        if n > 1 and not s.draft:
            keys += n * s.seq.num_computed_tokens + n * (n + 1) // 2
    return keys


class GPUModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        device: Device,
        layout: KVCacheLayout,
        num_blocks: int,
        attention: TritonPagedAttention,
        config: EngineConfig,
        max_model_len: int,
        *,
        graph_sizes: list[int] | None = None,
    ) -> None:
        """`config` has its device defaults filled in; `graph_sizes`: the decode graphs to capture
        (default: every bucket up to max_num_seqs; none with enforce_eager or without CUDA graphs)."""
        self.model = model
        self.runtime = device.runtime
        self.device = device.torch_device
        self.layout = layout
        self.attention = attention
        self.trash_block = num_blocks  # one block past the allocator's: padded rows write here
        self.trash_slot = num_blocks * layout.block_size
        self.kv_caches = layout.allocate(num_blocks + 1, self.device)
        self.graphs: DecodeGraphs | None = None
        self.drafted: DraftBursts | None = None
        self.max_burst = 0
        self.max_draft_rows = 0
        self.max_verify_rows = 0
        self.step_seconds: dict[int, float] = {}
        self.graph_prompt_keys = config.kernels.graph_prompt_keys  # prompt chunks through run_rows up to these
        if device.cuda_graphs and not config.enforce_eager:
            kernels = config.kernels
            chained = kernels.fused_decode_rows
            fused = FusedDecode(model, kernels, attention.pdl) if chained else None
            max_num_seqs = config.seqs_per_step
            self.graphs = DecodeGraphs(
                model, self.kv_caches, layout, attention, fused, fused.max_rows if fused else 0, max_num_seqs,
                layout.blocks_for(max_model_len), max(1, config.num_scheduler_steps), self.trash_block, self.device,
            )
            self.graphs.capture(graph_sizes if graph_sizes is not None else graph_batch_sizes(max_num_seqs))
            self.max_burst = self.graphs.max_burst
            largest = self.graphs.sizes[-1] if self.graphs.sizes else 0
            self.max_verify_rows = largest if self.graphs.holds_rows(largest) else 0
            spec = config.speculative_config
            if spec is not None and model.tp.size == 1:  # the policy's prior: a step's device time by rows
                self.step_seconds = self.graphs.replay_seconds()  # (not under TP: each rank would have to replay)
            if spec is not None and spec.method == "ngram":
                self.drafted = DraftBursts(self.graphs, spec.num_speculative_tokens, spec.prompt_lookup_min,
                                           spec.prompt_lookup_max)
                self.max_draft_rows = self.drafted.max_rows if self.graphs.holds_rows(self.drafted.max_rows) else 0

    @torch.inference_mode()
    def warm_up(self, max_tokens: int) -> None:
        """Runs one eager step at every padded token count up to max_tokens, largest first (the
        smaller steps then reuse the largest one's cached memory instead of adding to it), so that
        serving meets no GEMM shape and no kernel for the first time."""
        started = time.perf_counter()
        probe = Sequence("warm-up", [0, 0], SamplingParams(max_tokens=1), 0.0)
        probe.block_table = [self.trash_block]
        for size in reversed(eager_buckets(max_tokens)):
            probe.num_computed_tokens = 0
            self._run_eager([ScheduledSequence(probe, 2)], pad_to=size)
        self.runtime.synchronize()
        log.info("warmed up eager steps of up to %d tokens in %.1fs", max_tokens, time.perf_counter() - started)

    # -- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSequence]) -> tuple[torch.Tensor, list[Sequence]]:
        graphs = self.graphs
        if graphs is not None and all(s.is_decode for s in scheduled) and graphs.holds(len(scheduled)):
            seqs = [s.seq for s in scheduled]
            logits = graphs.decode(seqs)
        elif (graphs is not None and not any(s.seq.scores_prompt for s in scheduled)
              and graphs.holds_rows(sum(s.num_new_tokens for s in scheduled))
              and prompt_keys(scheduled) <= self.graph_prompt_keys):
            plan = pack_step(scheduled, self.layout)  # prompt chunks, drafts, decodes: a row a token
            logits, seqs = graphs.run_rows(plan), plan.sample_seqs
        else:
            logits, seqs = self._run_eager(scheduled)
        advance(scheduled)
        return logits, seqs

    def _run_eager(
        self, scheduled: list[ScheduledSequence], pad_to: int = 0
    ) -> tuple[torch.Tensor, list[Sequence]]:
        num_tokens = sum(s.num_new_tokens for s in scheduled)
        # pad the step to a bucket of token counts: a handful of GEMM shapes, all met at start-up
        plan = pack_step(
            scheduled, self.layout, pad_to=max(pad_to, eager_bucket(num_tokens)), pad_slot=self.trash_slot
        )
        step, dev = plan.step, self.device
        batch = self.attention.step_inputs(step, self.model.rotary)
        ids = step.input_ids + [0] * (step.num_rows - len(step.input_ids))
        hidden = self.model(host_ints(ids).to(dev, non_blocking=True), self.kv_caches, batch)
        logits = torch.empty(0, self.model.config.vocab_size, device=dev)
        if plan.sample_rows:
            rows = torch.tensor(plan.sample_rows, dtype=torch.long).to(dev, non_blocking=True)
            logits = self.model.compute_logits(hidden.index_select(0, rows))
        if plan.prompt_rows:  # requests asking for prompt logprobs: scored here, synchronously
            score_prompts(hidden, self.model.compute_logits, plan.prompt_rows)
        return logits, plan.sample_seqs

    # -- greedy bursts -------------------------------------------------------------------------
    def launch_greedy(self, seqs: list[Sequence], steps: int, continue_at: list[int] | None = None) -> GreedyBurst:
        assert self.graphs is not None, "greedy bursts need the decode graphs"
        return self.graphs.launch_greedy(seqs, steps, continue_at)

    def read_greedy(self, burst: GreedyBurst) -> list[list[int]]:
        assert self.graphs is not None and isinstance(burst, GraphBurst)
        return self.graphs.read_greedy(burst)

    # -- drafted bursts -----------------------------------------------------------------------
    def launch_drafted(self, seqs: list[Sequence], steps: int, k: int) -> DraftedBurst:
        assert self.drafted is not None, "drafted bursts need the decode graphs and an n-gram speculative_config"
        return self.drafted.launch(seqs, steps, k)

    def read_drafted(self, burst: DraftedBurst) -> list[list[list[int]]]:
        assert self.drafted is not None and isinstance(burst, DraftBurst)
        return self.drafted.read(burst)

    def release(self) -> None:
        """Drops the graphs, the KV cache and the model so that the device memory can be freed."""
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None
            self.drafted = None
            self.max_draft_rows = self.max_verify_rows = 0
            self.step_seconds = {}
        self.kv_caches = []
        self.model = None  # type: ignore[assignment]
