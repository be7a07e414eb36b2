"""The synchronous engine: requests in, one scheduler -> model -> sampler step at a time, deltas out."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ferrum.engine.block_manager import BlockManager
from ferrum.engine.config import EngineConfig
from ferrum.engine.model_runner import ModelRunner
from ferrum.engine.output_processor import OutputProcessor
from ferrum.engine.outputs import RequestOutput
from ferrum.engine.sampler import SampleResult, sample
from ferrum.engine.sampling_params import SamplingParams
from ferrum.engine.scheduler import Scheduler
from ferrum.engine.sequence import Sequence, SequenceStatus
from ferrum.models.config import load_model_config
from ferrum.models.loader import load_model
from ferrum.tokenizer import Tokenizer

if TYPE_CHECKING:
    from ferrum.engine.gpu_model_runner import GPUModelRunner, GreedyBurst

log = logging.getLogger(__name__)


class PromptTooLongError(ValueError):
    def __init__(self, prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} in the completion)."
        )
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int
    requests_finished: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens whose KV was reused


def resolve_dtype(name: str, checkpoint_dtype: torch.dtype, device: str) -> torch.dtype:
    if name != "auto":
        return getattr(torch, name)
    if device.startswith("cpu"):
        from ferrum.backends.cpu_kernels import has_native_bf16

        # bf16 where the CPU has bf16 matmul units (AMX / AVX512-BF16), else float32
        return torch.bfloat16 if has_native_bf16() else torch.float32
    return checkpoint_dtype if checkpoint_dtype != torch.float32 else torch.bfloat16


def kv_cache_budget(config: EngineConfig) -> int:
    """Bytes for the KV cache: the configured size, else on CPU a fifth of
    available memory capped at 2 GiB."""
    if config.kv_cache_memory_gb is not None:
        return int(config.kv_cache_memory_gb * 2**30)
    available = _available_memory_bytes()
    return min(2 * 2**30, available // 5)


def _available_memory_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 4 * 2**30


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None) -> None:
        config = config.with_device_defaults()
        self.config = config
        folder = Path(config.model)
        started = time.perf_counter()
        model_config = load_model_config(folder)  # first: names an unsupported architecture early
        self.tokenizer = tokenizer or Tokenizer.from_folder(folder)
        dtype = resolve_dtype(config.dtype, model_config.dtype, config.device)
        limit = model_config.max_position_embeddings
        if model_config.sliding_window:
            limit = min(limit, model_config.sliding_window)  # no sliding-window attention: stay exact
        if config.max_model_len is not None and config.max_model_len > limit:
            raise ValueError(
                f"max_model_len={config.max_model_len} is longer than the model supports ({limit} tokens)"
            )
        self.max_model_len = config.max_model_len or limit

        on_gpu = config.device.startswith("cuda")
        bytes_per_token = ModelRunner.kv_bytes_per_token(model_config, dtype)
        if not on_gpu:  # sized before loading, so that a cache too small fails fast
            num_blocks = kv_cache_budget(config) // (bytes_per_token * config.block_size)
            self._check_fits(num_blocks, config)
        self.model, self.model_config = load_model(folder, dtype, config.device)
        self.runner: ModelRunner | GPUModelRunner
        if on_gpu:  # imported here: the GPU path needs triton, which CPU installs may lack
            from ferrum.engine.gpu_memory import plan_kv_cache
            from ferrum.engine.gpu_model_runner import GPUModelRunner

            num_blocks = plan_kv_cache(self.model, config, self.max_model_len).num_blocks
            self._check_fits(num_blocks, config)
            self.runner = GPUModelRunner(
                self.model, num_blocks, config.block_size, config.device, config.max_num_seqs,
                self.max_model_len, use_cuda_graphs=not config.enforce_eager,
                max_burst=config.num_scheduler_steps,
            )
            self.runner.warm_up_eager(config.max_num_batched_tokens)
        else:
            self.runner = ModelRunner(self.model, num_blocks, config.block_size, config.device)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, enable_prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        self.sequences: dict[str, Sequence] = {}
        # greedy decodes queued on the device whose tokens the host has not read yet
        self._burst: tuple[list[Sequence], GreedyBurst] | None = None
        self._preemptions = 0
        self._finished = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        log.info(
            "engine ready in %.1fs: %s %s on %s, %d KV blocks x %d tokens, max_model_len %d",
            time.perf_counter() - started, model_config.architecture, dtype, config.device,
            num_blocks, config.block_size, self.max_model_len,
        )

    def _check_fits(self, num_blocks: int, config: EngineConfig) -> None:
        if num_blocks * config.block_size < self.max_model_len:
            memory = "gpu_memory_utilization" if config.device.startswith("cuda") else "kv_cache_memory_gb"
            raise ValueError(
                f"the KV cache ({num_blocks} blocks of {config.block_size} tokens) cannot hold one "
                f"sequence of max_model_len={self.max_model_len} tokens; raise {memory} or lower max_model_len"
            )

    def release(self) -> None:
        """Frees what the engine holds on its device (KV cache, CUDA graphs, weights); the engine
        cannot step afterwards."""
        self.runner.release()
        self.model = None  # type: ignore[assignment]

    # -- requests -------------------------------------------------------
    def check_length(self, num_prompt_tokens: int, max_tokens: int) -> None:
        if num_prompt_tokens + max_tokens > self.max_model_len or num_prompt_tokens < 1:
            raise PromptTooLongError(num_prompt_tokens, max_tokens, self.max_model_len)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if request_id in self.sequences:
            raise ValueError(f"request id {request_id!r} is already running")
        if not prompt_token_ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {vocab}): {bad[:5]}")
        self.check_length(len(prompt_token_ids), params.max_tokens)
        seq = Sequence(request_id, list(prompt_token_ids), params, time.monotonic())
        if params.seed is not None:
            seq.generator = torch.Generator().manual_seed(params.seed % 2**64)
        self.sequences[request_id] = seq
        self.scheduler.add(seq)
        self._prompt_tokens += len(prompt_token_ids)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        seq = self.sequences.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "abort"
        return OutputProcessor.delta(seq)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # -- the step -------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self._burst is not None:  # greedy decodes already queued on the device
            seqs = self._finish_burst()
        else:
            plan = self.scheduler.schedule()
            self._preemptions += plan.num_preempted
            if plan.empty:
                return []
            steps = self._greedy_burst_length(plan)
            if steps:
                seqs = [s.seq for s in plan.scheduled]
                self._burst = (seqs, self.runner.launch_greedy(seqs, steps))
                seqs = self._finish_burst()
            else:
                logits, seqs = self.runner.execute(list(plan.scheduled))
                if seqs:
                    self.outputs.append(seqs, sample(logits, seqs))
                    self._generation_tokens += len(seqs)
        deltas = []
        for seq in seqs:
            if self.sequences.get(seq.request_id) is not seq:
                continue  # aborted while its burst ran: abort_request sent its last delta
            delta = OutputProcessor.delta(seq)
            if delta is not None:
                deltas.append(delta)
            if seq.is_finished:
                self.scheduler.remove(seq)
                self.sequences.pop(seq.request_id, None)
                self._finished += 1
        return deltas

    def _greedy_burst_length(self, plan) -> int:
        """Decode iterations to run on the device in one go for this plan (0: the ordinary step).
        Only for CUDA-graph decodes of greedy sequences without logprobs or penalties; one
        iteration while a waiting request could be admitted (it is, next step); at most
        num_scheduler_steps, and no further than any sequence may still grow."""
        if getattr(self.runner, "launch_greedy", None) is None or not self.runner.graphs:
            return 0
        if len(plan.scheduled) > self.runner.max_num_seqs:
            return 0
        for s in plan.scheduled:
            p = s.seq.params
            if not (s.is_decode and p.greedy and p.logprobs is None and p.repetition_penalty == 1.0
                    and not p.presence_penalty and not p.frequency_penalty):
                return 0
        if self._admission_pending():
            return 1
        seqs = [s.seq for s in plan.scheduled]
        computed = [seq.num_computed_tokens for seq in seqs]
        steps = self._room(seqs, [len(seq.output_token_ids) for seq in seqs], computed)
        return max(self._grow_for(seqs, computed, steps), 1)

    def _room(self, seqs: list[Sequence], outputs: list[int], computed: list[int]) -> int:
        """Greedy iterations every sequence may still take, from `outputs` tokens out and
        `computed` in the cache (capped by num_scheduler_steps)."""
        steps = min(self.config.num_scheduler_steps, self.runner.max_burst)
        for seq, out, done in zip(seqs, outputs, computed):
            steps = min(steps, seq.params.max_tokens - out, self.max_model_len - done)
        return steps

    def _grow_for(self, seqs: list[Sequence], computed: list[int], steps: int) -> int:
        """Grows every block table to hold `steps` more tokens; 0 when the free blocks do not
        suffice (nothing grown)."""
        blocks = self.block_manager
        if steps < 1 or sum(blocks.blocks_needed(q, c + steps) for q, c in zip(seqs, computed)) > blocks.num_free:
            return 0
        for q, c in zip(seqs, computed):
            blocks.grow(q, c + steps)
        return steps

    def _finish_burst(self) -> list[Sequence]:
        """Takes the queued burst's tokens; when no sequence can have stopped in it (by token,
        length, or abort) and no request waits for a free slot, queues the next burst of the same
        sequences on the device first, so that the GPU decodes while the host detokenizes.
        Small batches queue it even before the host has the tokens (_queue_ahead). Returns the
        burst's sequences."""
        seqs, burst = self._burst
        self._burst = None
        following = self._queue_ahead(seqs, burst.steps)
        chosen = self.runner.read_greedy(burst)
        if following is None and not self._admission_pending() and all(
                self._keeps_going(seq, [row[i] for row in chosen]) for i, seq in enumerate(seqs)):
            following = self._continue(seqs, len(chosen))
        if following is not None:
            self._burst = (seqs, following)
        for row in chosen:
            live = [(seq, token) for seq, token in zip(seqs, row) if not seq.is_finished]
            if not live:
                break
            for seq, _ in live:
                seq.num_computed_tokens += 1
            self.outputs.append([seq for seq, _ in live], SampleResult([t for _, t in live], [None] * len(live)))
            self._generation_tokens += len(live)
        return seqs

    def _continue(self, seqs: list[Sequence], steps: int) -> GreedyBurst | None:
        """Queues the next burst of `seqs` on the device, carrying on from the end of the one
        queued before it (`steps` decodes the host has not counted yet); None when the sequences'
        limits or the free blocks leave no room."""
        computed = [seq.num_computed_tokens + steps for seq in seqs]
        more = self._room(seqs, [len(seq.output_token_ids) + steps for seq in seqs], computed)
        if not self._grow_for(seqs, computed, more):
            return None
        return self.runner.launch_greedy(seqs, more, continue_at=computed)

    # Batches up to this size queue the next burst before the host has waited for the last: their
    # decode steps are short (about 1 ms at batch 1 on an H100), so the host's turn-around between
    # bursts (waking, reading, launching: ~0.13 ms) would leave the GPU idle for a visible share.
    QUEUE_AHEAD_MAX_SEQS = 4

    def _queue_ahead(self, seqs: list[Sequence], steps: int) -> GreedyBurst | None:
        """For a small batch, queues the next burst behind the one about to be read, as if none of
        its sequences stops in it (stop tokens are not known yet; lengths are). A sequence that
        does stop has the rest of its rows dropped when they are read, as after any stop, and
        the following burst is not queued ahead. Not while a request waits for a free slot (it
        would wait one burst longer), nor for sequences with stop strings."""
        if len(seqs) > self.QUEUE_AHEAD_MAX_SEQS or self._admission_pending():
            return None
        if any(seq.is_finished or seq.params.stop for seq in seqs):
            return None
        return self._continue(seqs, steps)

    def _admission_pending(self) -> bool:
        """A request waits and a running slot is free for it (with every slot taken, it waits for
        a sequence to finish, which ends the burst anyway)."""
        return bool(self.scheduler.waiting) and len(self.scheduler.running) < self.scheduler.max_num_seqs

    def _keeps_going(self, seq: Sequence, tokens: list[int]) -> bool:
        """Whether `seq` is sure to run on after appending `tokens`, judged without detokenizing:
        not aborted, no stop token among them, not at its length limits, no stop strings."""
        p = seq.params
        if seq.is_finished or p.stop:
            return False
        stops = set(p.stop_token_ids) if p.ignore_eos else set(p.stop_token_ids) | self.outputs.eos_token_ids
        if stops.intersection(tokens):
            return False
        return (len(seq.output_token_ids) + len(tokens) < p.max_tokens
                and seq.num_tokens + len(tokens) < self.max_model_len)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_blocks_used=self.block_manager.num_used,
            kv_blocks_total=self.block_manager.num_blocks,
            num_preemptions=self._preemptions,
            requests_finished=self._finished,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._generation_tokens,
            prefix_cache_queries=self.block_manager.prefix_cache_queries,
            prefix_cache_hits=self.block_manager.prefix_cache_hits,
        )

    # -- offline use ------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Runs prompts to completion; returns the output token ids of each."""
        ids = [f"offline-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        results: dict[str, list[int]] = {i: [] for i in ids}
        for rid, prompt in zip(ids, prompts):
            self.add_request(rid, prompt, params)
        while self.has_work:
            for out in self.step():
                results[out.request_id].extend(out.new_token_ids)
        return [results[i] for i in ids]
