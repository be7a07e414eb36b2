"""The synchronous engine: requests in, one scheduler -> model runner -> sampler step at a time,
deltas out.

Built from what the pipeline hands it: an `EngineConfig`, the selected backend's `Device` and the
model's resolved files (`ModelFiles`). It reads config.json and the tokenizer from the files'
folder, picks the attention backend and layer ops once from the `Device`, builds the model there
and fills it through the WeightLoader (streaming remote weights), sizes the KV cache with the
memory planner, and builds the runner, block manager and scheduler around one `KVCacheLayout`.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ferrum.backends.device import Device
from ferrum.dtypes import dtype_name
from ferrum.engine.block_manager import BlockManager
from ferrum.engine.config import EngineConfig
from ferrum.engine.heap import thaw_heap
from ferrum.engine.limits import PromptTooLongError, RequestLimits
from ferrum.engine.model_rank import ModelRank
from ferrum.engine.observer import StepKind, StepObserver, StepRecord
from ferrum.engine.output_processor import OutputProcessor
from ferrum.engine.outputs import RequestOutput
from ferrum.engine.runner import GreedyBurst
from ferrum.engine.sampler import SampleResult, sample
from ferrum.engine.sampling_params import SamplingParams
from ferrum.engine.scheduler import BurstLimits, ScheduledSequence, Scheduler, SchedulerOutput
from ferrum.engine.sequence import Sequence, SequenceStatus
from ferrum.engine.speculative.proposer import Proposer
from ferrum.engine.speculative.speculator import Speculator
from ferrum.engine.speculative.verify import Draft, Verifier
from ferrum.engine.startup import StartupObserver, StartupProgress
from ferrum.engine.structured import Guides, PendingMasks
from ferrum.models.config import ModelConfig, load_model_config
from ferrum.models.loader import run_sync
from ferrum.tokenizer import Tokenizer
from ferrum.weights.loader import WeightLoader
from ferrum.weights.locations.model_files import ModelFiles
from ferrum.weights.locations.uri import publish_model_folder
from ferrum.weights.spec.loader_config import WeightLoaderConfig

__all__ = ["EngineStats", "LLMEngine", "PromptTooLongError"]

log = logging.getLogger(__name__)

# Batches up to this size queue the next burst before the host has waited for the last: their
# decode steps are short (about 1 ms at batch 1 on an H100), so the host's turn-around between
# bursts (waking, reading, launching: ~0.13 ms) would leave the GPU idle for a visible share.
QUEUE_AHEAD_MAX_SEQS = 4
# Batches of at least this many sequences run each greedy burst to its full length, past a sequence's
# max_tokens (Scheduler: BurstLimits.full_from). On an H100 the host's turn-around between bursts is
# about 30 us a sequence; a finished row rides along for half a burst on average. At 32 sequences
# and more the ride costs less device time than the device's wait (scripts/throughput_breakdown.py:
# 1.98 of 20.8 s and 1.66 of 6.7 s idle at 256 sequences for the 8B and 1B shapes, bursts cut short).
FULL_BURSTS_FROM = 32
# A drafted burst (ferrum.engine.draft_bursts) of a batch this small runs at most this many iterations: the
# device cannot end it at a stop token, and with one to four sequences an iteration run after the answer
# ended is nearly all waste (each costs about two plain ones), against a host turn-around of a fraction of one.
DRAFTED_BURST_SMALL = 4


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
    max_num_seqs: int = 0  # the running batch's limit
    kv_cache_dtype: str = ""  # what the KV cache holds (bfloat16, int8, ...)
    # speculative decoding (vLLM's counters): drafts verified, their tokens, the tokens kept, kept by position
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_position: tuple[int, ...] = ()


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        device: Device,
        files: ModelFiles,
        weights: WeightLoaderConfig | None = None,
        tokenizer: Tokenizer | None = None,
        on_progress: StartupObserver | None = None,
    ) -> None:
        """`on_progress` hears the start-up's phases (loading, with bytes, then warming), from this
        thread and the loader's worker threads."""
        started = time.perf_counter()
        self._on_progress = on_progress
        config = config.for_device(device)
        self.config = config
        self.device = device
        if device.kind == "cpu" and config.threads is not None and config.tensor_parallel_size == 1:
            torch.set_num_threads(config.threads)
        if device.kind == "cpu":
            log.info("CPU compute threads: %d (of %d usable cores)", torch.get_num_threads(), device.threads)
        model_config = load_model_config(files.folder)  # first: names an unsupported architecture early
        self.model_config = model_config
        self.tokenizer = tokenizer or Tokenizer.from_folder(files.folder)
        self.dtype = config.serving_dtype(model_config.dtype, device)
        self.max_model_len = _max_model_len(config, model_config)
        self.limits = RequestLimits(self.max_model_len, model_config.vocab_size)
        weights = weights or WeightLoaderConfig()
        self.rank = self._build_rank(files, weights)
        self.model, self.layout, self.attention = self.rank.model, self.rank.layout, self.rank.attention
        self.memory_plan, self.weight_load, self.runner = self.rank.memory_plan, self.rank.weight_load, self.rank.runner
        if not files.complete:
            folder = run_sync(publish_model_folder(files, weights))
            log.info("model %s is in the cache at %s", files.display, folder)
        self.block_manager = BlockManager(self.rank.num_blocks, config.block_size,
                                          enable_prefix_caching=config.enable_prefix_caching,
                                          window=model_config.uniform_window)
        self.outputs = OutputProcessor(self.tokenizer, self.max_model_len)
        self.guides = Guides(self.tokenizer, model_config.vocab_size)
        bursts = BurstLimits(min(config.num_scheduler_steps, self.runner.max_burst), self.max_model_len,
                             self.outputs.eos_token_ids, FULL_BURSTS_FROM)
        self.scheduler = Scheduler(self.block_manager, config.seqs_per_step, config.tokens_per_step, bursts)
        spec = config.speculative_config
        self.speculator = (Speculator(spec, self.max_model_len, verify_rows=self.runner.max_verify_rows,
                                      step_seconds=self.runner.step_seconds)
                           if spec is not None else None)
        self.verifier = Verifier(self.outputs, self.guides)
        self.sequences: dict[str, Sequence] = {}
        # greedy decodes queued on the device whose tokens the host has not read yet
        self._burst: tuple[list[Sequence], GreedyBurst] | None = None
        self._observers: list[StepObserver] = []
        self._decoding = False  # the last step's sequences all decoded (plain, drafts or a burst): its time is
        # one of the speculation policy's step costs
        self._preemptions = 0
        self._finished = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        log.info(
            "engine ready in %.1fs: %s %s on %s (%s attention), %d KV blocks x %d tokens (%s), max_model_len %d",
            time.perf_counter() - started, model_config.architecture, dtype_name(self.dtype), device.name,
            self.attention.name, self.rank.num_blocks, config.block_size, dtype_name(self.layout.dtype),
            self.max_model_len,
        )

    # -- building ---------------------------------------------------------------------------
    def _build_rank(self, files: ModelFiles, weights: WeightLoaderConfig) -> ModelRank:
        """The model (its weights streamed in), KV cache and runner on this device. With
        tensor_parallel_size N > 1 this is rank 0 of N: the other ranks start in worker processes
        first, build their shards alongside through the same set-up path, and replay every step
        (ferrum.engine.parallel)."""
        size = self.config.tensor_parallel_size
        if size == 1:
            rank = ModelRank(self.config, self.device, self.model_config, files, weights, self.dtype,
                             self.max_model_len, report=self._report)
            self.rank_reports = [rank.weight_load]
            return rank
        from ferrum.engine.parallel.rank import lead_ranks
        from ferrum.engine.parallel.spec import RankSpec, local_dist_url
        from ferrum.models.layers.parallel import ShardPlan

        ShardPlan.check(self.model_config, size)
        if not files.complete:  # every rank reads its shards from the cache: fetch once, here
            files = run_sync(_fetched(files, weights))
        spec = RankSpec(size, self.device.name, self.config, self.model_config, self.dtype,
                        self.max_model_len, files, weights, local_dist_url(),
                        logging.getLogger().getEffectiveLevel())
        rank, self.rank_reports = lead_ranks(spec, self.device, self._report)
        for i, report in enumerate(self.rank_reports):
            log.info("tensor parallel rank %d/%d: %.3f GB of weights on its device, %.3f GB read from the checkpoint "
                     "in %.2fs (%.2f GB/s)", i, size, report.nbytes / 1e9, report.bytes_read / 1e9, report.seconds,
                     report.nbytes / 1e9 / max(report.seconds, 1e-9))
        return rank

    def _report(self, progress: StartupProgress) -> None:
        if self._on_progress is not None:
            try:
                self._on_progress(progress)
            except Exception:  # a listener's failure must not fail the start
                log.exception("start-up progress listener failed")

    def release(self) -> None:
        """Frees what the engine holds on its device (KV cache, CUDA graphs, weights) and hands the
        memory back to the driver (and stops the other tensor-parallel ranks); the engine cannot
        step afterwards."""
        self.rank.release()
        self.guides.close()
        self.model = None  # type: ignore[assignment]
        thaw_heap()  # a serving process froze its start-up objects, the model's among them
        gc.collect()
        self.device.runtime.empty_cache()

    def use_proposer(self, proposer: Proposer) -> None:
        """Speculation drafts with `proposer` from now on (the engine must have a speculative_config): a
        public hook for proposers that are not a config's (benchmarks replaying recorded outputs)."""
        if self.speculator is None:
            raise ValueError("this engine does not speculate: give it a speculative_config")
        self.speculator.proposer = proposer

    def add_observer(self, observer: StepObserver) -> Callable[[], None]:
        """Have `observer` called with a StepRecord after every step; returns its removal."""
        self._observers.append(observer)
        return lambda: self._observers.remove(observer) if observer in self._observers else None

    # -- requests -------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, priority: int = 0
    ) -> None:
        """Queues a request; among waiting requests a lower `priority` is admitted first."""
        if request_id in self.sequences:
            raise ValueError(f"request id {request_id!r} is already running")
        self.limits.check(prompt_token_ids, params.max_tokens, [t for t, _ in params.logit_bias])
        seq = Sequence(request_id, list(prompt_token_ids), params, time.monotonic(), priority=priority)
        if params.structured is not None:
            seq.guide = self.guides.guide(params.structured)  # StructuredOutputError (a ValueError): refused
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
        started = time.perf_counter()
        self.device.runtime.make_current()  # the stepping thread may not be the one that built the engine
        generated = self._generation_tokens
        record: dict[str, object] = {}
        if self._burst is not None:  # greedy decodes already queued on the device
            seqs = self._finish_burst(record)
        elif (drafted := self._drafted_burst(record)) is not None:  # speculation on the device
            seqs = drafted
        else:
            plan = self.scheduler.schedule()
            self._preemptions += plan.num_preempted
            if plan.empty:
                return []
            if plan.burst:
                seqs = [s.seq for s in plan.scheduled]
                self._burst = (seqs, self.runner.launch_greedy(seqs, plan.burst))
                seqs = self._finish_burst(record)
            else:
                seqs = self._run(plan, record)
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
                if self.speculator is not None:
                    self.speculator.forget(seq.request_id)
        if self.speculator is not None and self._decoding:  # the policy's measured step cost
            iterations = int(record.get("iterations", 1))  # type: ignore[call-overload]
            self.speculator.observe_step(int(record["num_tokens"]),  # type: ignore[call-overload]
                                         (time.perf_counter() - started) / max(iterations, 1))
        if self._observers:
            self._notify(StepRecord(num_seqs=len(seqs), num_generated=self._generation_tokens - generated,
                                    started=started, finished=time.perf_counter(), **record))  # type: ignore[arg-type]
        return deltas

    def _run(self, plan: SchedulerOutput, record: dict[str, object]) -> list[Sequence]:
        """One ordinary step: the forward pass, the prefix cache's bookkeeping while the device runs
        it, then sampling."""
        scheduled = list(plan.scheduled)
        decodes = sum(1 for s in scheduled if s.is_decode)
        kind: StepKind = "decode" if decodes == len(scheduled) else ("prefill" if not decodes else "mixed")
        if all(s.is_decode or s.draft for s in scheduled) and decodes < len(scheduled):
            kind = "verify"  # every sequence decodes, some with a draft
        self._decoding = all(s.is_decode or s.draft for s in scheduled)
        record.update(kind=kind, num_tokens=sum(s.num_new_tokens for s in scheduled),
                      cached_tokens=sum(s.seq.num_computed_tokens for s in scheduled),
                      attended_keys=sum(s.num_new_tokens * s.seq.num_computed_tokens
                                        + s.num_new_tokens * (s.num_new_tokens + 1) // 2 for s in scheduled))
        # the grammars' masks are computed on the host while the device runs the step
        masks = self.guides.start_masks([s.seq for s in scheduled if s.completes_pending and not s.draft])
        logits, seqs = self.runner.execute(scheduled)
        drafts = [s for s in scheduled if s.draft]
        for s in drafts:  # of its draft's tokens, the kept ones are counted computed after verification
            s.seq.num_computed_tokens -= len(s.draft)
        self.scheduler.register_computed(s.seq for s in scheduled)
        self.outputs.decode_prompt_scores(s.seq for s in scheduled if s.seq.prompt_scores)
        if seqs and not drafts:
            self.outputs.append(seqs, sample(logits, seqs, masks.for_rows(seqs) if masks is not None else None))
            self._generation_tokens += len(seqs)
        elif seqs:
            self._sample_and_verify(logits, seqs, drafts, masks)
        if self._observers:
            record.update(logits=logits, request_ids=tuple(seq.request_id for seq in seqs))
        return [s.seq for s in scheduled]

    def _sample_and_verify(self, logits: torch.Tensor, seqs: list[Sequence], drafts: list[ScheduledSequence],
                           masks: PendingMasks | None) -> None:
        """A step with drafts: the plain rows sampled as ever, each draft's rows (consecutive in `seqs`)
        verified (ferrum.engine.speculative.verify); the sequences' computed tokens then end after their
        kept draft tokens, and the blocks past their tokens go back."""
        assert self.speculator is not None
        drafted = {id(s.seq): s.draft for s in drafts}
        plain_rows: list[int] = []
        verify: list[Draft] = []
        row = 0
        while row < len(seqs):
            seq = seqs[row]
            draft = drafted.get(id(seq))
            if draft is None:
                plain_rows.append(row)
                row += 1
                continue
            verify.append(Draft(seq, list(draft), logits[row : row + len(draft) + 1]))
            row += len(draft) + 1
        if plain_rows:
            plain = [seqs[r] for r in plain_rows]
            picked = logits[torch.tensor(plain_rows, device=logits.device)]
            self.outputs.append(plain, sample(picked, plain, masks.for_rows(plain) if masks is not None else None))
            self._generation_tokens += len(plain)
        self.verifier.verify(verify)
        for d in verify:
            self.speculator.verified(d)
            self._generation_tokens += d.appended
            if not d.seq.is_finished:
                d.seq.num_computed_tokens = d.seq.num_tokens - 1  # the kept drafts' KV is in the cache
                self.block_manager.truncate(d.seq)

    def _drafted_burst(self, record: dict[str, object]) -> list[Sequence] | None:
        """With speculation: where the runner drafts on the device and the running batch decodes greedily,
        a drafted burst when the policy says k drafts a sequence pay (ferrum.engine.draft_bursts), its tokens
        appended here; else the host's drafts for the next step are set (Speculator.prepare) and None is
        returned (an ordinary step or a plain burst follows)."""
        spec = self.speculator
        if spec is None:
            return None
        running = self.scheduler.running
        rows = self.runner.max_draft_rows  # k a sequence, or fewer where the batch's rows would not fit the graphs
        k = spec.drafts_each(len(running), len(running), rows)
        if not (spec.drafts_on_device and rows and k >= 1 and self.scheduler.drafts_on_device(k, rows)):
            spec.prepare(running)
            return None
        for seq in running:
            seq.draft_token_ids = []
        k = spec.device_drafts(running, k)
        longest = DRAFTED_BURST_SMALL if len(running) <= QUEUE_AHEAD_MAX_SEQS else self.runner.max_burst
        steps = self.scheduler.plan_drafted(k, spec.expected_tokens(running, k), longest) if k else 0
        if not steps:
            return None
        seqs = list(running)
        gained = self.runner.read_drafted(self.runner.launch_drafted(seqs, steps, k))
        self._decoding = True
        cached = sum(seq.num_computed_tokens for seq in seqs)
        width = k + 1
        record.update(kind="verify", num_tokens=len(seqs) * width, iterations=steps, cached_tokens=cached,
                      attended_keys=cached * width + len(seqs) * width * (width + 1) // 2)
        for iteration in gained:
            for seq, tokens in zip(seqs, iteration, strict=True):
                if seq.is_finished:
                    continue
                spec.counted(seq, k, len(tokens) - 1)
                for token in tokens:
                    self.outputs.append([seq], SampleResult([token], [None]))
                    self._generation_tokens += 1
                    if seq.is_finished:
                        break
        for seq in seqs:
            if not seq.is_finished:
                seq.num_computed_tokens = seq.num_tokens - 1  # the kept drafts' KV is in the cache
                self.block_manager.truncate(seq)
        return seqs

    def _finish_burst(self, record: dict[str, object]) -> list[Sequence]:
        """Takes the queued burst's tokens; when no sequence can have stopped in it (by token,
        length, or abort) and no request waits for a free slot, queues the next burst of the same
        sequences on the device first, so that the GPU decodes while the host detokenizes. Small
        batches queue it even before the host has the tokens (_queue_ahead). Returns the burst's
        sequences; `record` gets what the step ran, for the observers."""
        assert self._burst is not None
        self._decoding = True
        seqs, burst = self._burst
        self._burst = None
        drafting = self._drafting(seqs)  # asked once a burst: the policy counts a chained burst as a refusal
        following = None if drafting else self._queue_ahead(seqs, burst.steps)
        chosen = self.runner.read_greedy(burst)
        cached = sum(seq.num_computed_tokens for seq in seqs)
        record.update(kind="burst", num_tokens=len(seqs), iterations=max(1, len(chosen)), cached_tokens=cached,
                      attended_keys=cached + len(seqs))
        if following is None and not drafting and self.scheduler.burst_continues(seqs, chosen):
            following = self._continue(seqs, len(chosen))
        if following is not None:
            self._burst = (seqs, following)
        ahead = self._relaunch(seqs, chosen) if following is None and not drafting else {}
        for row in chosen:
            live = [(seq, token) for seq, token in zip(seqs, row, strict=True)
                    if not seq.is_finished and id(seq) not in ahead]
            if not live:
                break
            for seq, _ in live:
                seq.num_computed_tokens += 1
            self.outputs.append([seq for seq, _ in live], SampleResult([t for _, t in live], [None] * len(live)))
            self._generation_tokens += len(live)
        for seq, tokens in ahead.values():  # their ids went in before the next burst was launched
            self.outputs.catch_up(seq, tokens)
            self._generation_tokens += len(tokens)
        return seqs

    def _relaunch(self, seqs: list[Sequence], chosen: list[list[int]]) -> dict[int, tuple[Sequence, list[int]]]:
        """A large batch whose burst chain ends only because some sequences stopped: the sequences sure to
        run on (Scheduler.keeps_going, from the ids) get this burst's ids and the next burst is launched
        for them before the host detokenizes anyone's tokens (at 256 sequences and 16 iterations that
        text took the device's 7-12 ms turn-around at each such end). Not while a request waits (the
        scheduler admits it), with stop strings (they need the text) or where speculation drafts next (the
        caller asks). Returns the sequences moved on, by id, with their ids, whose text is still to come
        (OutputProcessor.catch_up)."""
        if (len(seqs) < FULL_BURSTS_FROM or self.scheduler.waiting
                or any(seq.params.stop for seq in seqs)):
            return {}
        columns = [[row[i] for row in chosen] for i in range(len(seqs))]  # each sequence's ids
        survivors = [(seq, ids) for seq, ids in zip(seqs, columns, strict=True) if self.scheduler.keeps_going(seq, ids)]
        if not survivors or len(survivors) == len(seqs):  # every one runs on: what stopped the chain was room
            return {}
        steps = self.scheduler.extend_burst([seq for seq, _ in survivors], len(chosen))
        if not steps:
            return {}
        for seq, tokens in survivors:
            seq.output_token_ids.extend(tokens)
            seq.num_computed_tokens += len(tokens)
        moved = [seq for seq, _ in survivors]
        self._burst = (moved, self.runner.launch_greedy(moved, steps))
        return {id(seq): (seq, tokens) for seq, tokens in survivors}

    def _drafting(self, seqs: list[Sequence]) -> bool:
        """Whether speculation may draft for these sequences at the next step: then a burst ends at its last
        iteration (the proposer drafts before the next step); where the policy's rule refuses drafts for
        them (Speculator.drafts_next), bursts chain as without speculation (every 32 or more refusals one
        step drafts again)."""
        return self.speculator is not None and self.speculator.drafts_next(seqs)

    def _continue(self, seqs: list[Sequence], ahead: int) -> GreedyBurst | None:
        """Queues the next burst of `seqs` on the device, carrying on from the end of the one
        queued before it (`ahead` decodes the host has not counted yet); None when the sequences'
        limits or the free blocks leave no room."""
        steps = self.scheduler.extend_burst(seqs, ahead)
        if not steps:
            return None
        return self.runner.launch_greedy(seqs, steps, continue_at=[seq.num_computed_tokens + ahead for seq in seqs])

    def _queue_ahead(self, seqs: list[Sequence], steps: int) -> GreedyBurst | None:
        """For a small batch, queues the next burst behind the one about to be read, as if none of
        its sequences stops in it (stop tokens are not known yet; lengths are). A sequence that
        does stop has the rest of its rows dropped when they are read, as after any stop, and
        the following burst is not queued ahead. Not while a request waits for a free slot (it
        would wait one burst longer), nor for sequences with stop strings, nor where speculation would
        draft next (the caller asks)."""
        if len(seqs) > QUEUE_AHEAD_MAX_SEQS or self.scheduler.admission_pending():
            return None
        if any(seq.is_finished or seq.params.stop for seq in seqs):
            return None
        return self._continue(seqs, steps)

    def _notify(self, record: StepRecord) -> None:
        for observer in list(self._observers):
            observer(record)

    def stats(self) -> EngineStats:
        spec = self.speculator.stats if self.speculator is not None else None
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
            max_num_seqs=self.scheduler.max_num_seqs,
            kv_cache_dtype=dtype_name(self.layout.dtype),
            spec_num_drafts=spec.num_drafts if spec else 0,
            spec_num_draft_tokens=spec.num_draft_tokens if spec else 0,
            spec_num_accepted_tokens=spec.num_accepted_tokens if spec else 0,
            spec_accepted_per_position=tuple(spec.accepted_per_position) if spec else (),
        )

    # -- offline use ------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
        """Runs prompts to completion; returns the output token ids of each."""
        ids = [f"offline-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
        results: dict[str, list[int]] = {i: [] for i in ids}
        for rid, prompt in zip(ids, prompts, strict=True):
            self.add_request(rid, prompt, params)
        while self.has_work:
            for out in self.step():
                results[out.request_id].extend(out.new_token_ids)
        return [results[i] for i in ids]


async def _fetched(files: ModelFiles, weights: WeightLoaderConfig) -> ModelFiles:
    """A remote model's files, downloaded into the cache first (tensor-parallel ranks each read
    their shards from there)."""
    from ferrum.weights.locations.uri import resolve_model

    async with WeightLoader(weights) as loader:
        await loader.preload(files.weights)
    folder = await publish_model_folder(files, weights)
    return await resolve_model(str(folder), weights)


def _max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    limit = model_config.max_position_embeddings
    if config.max_model_len is not None and config.max_model_len > limit:
        raise ValueError(f"max_model_len={config.max_model_len} is longer than the model supports ({limit} tokens)")
    return config.max_model_len or limit
