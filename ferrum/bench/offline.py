"""`ferrum bench offline`: the workload through an LLMEngine in this process, no HTTP."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ferrum.bench.errors import BenchError
from ferrum.bench.metrics import Acceptance
from ferrum.bench.progress import RequestProgress
from ferrum.bench.roofline import ModelCost, Roofline, RooflineReport, measure_peaks
from ferrum.bench.workload import BenchRequest, WorkloadSpec, make_workload, prompt_token_pool, warmup_request
from ferrum.dtypes import dtype_name
from ferrum.engine.builder import create_engine
from ferrum.engine.config import EngineConfig
from ferrum.engine.llm_engine import EngineStats, LLMEngine
from ferrum.engine.sampling_params import SamplingParams
from ferrum.models.layers.moe import MoE


@dataclass(frozen=True)
class OfflineOptions:
    model: str  # a model location, as for `ferrum serve --model`
    workload: WorkloadSpec
    backend: str = "auto"
    engine: dict[str, Any] = field(default_factory=dict)  # EngineConfig fields other than model/device


def speculation_between(before: EngineStats, after: EngineStats) -> Acceptance | None:
    """The drafts and acceptance of the steps between two of the engine's stats (None: it does not speculate)."""
    if not after.spec_accepted_per_position:
        return None
    first = before.spec_accepted_per_position or (0,) * len(after.spec_accepted_per_position)
    return Acceptance(after.spec_num_drafts - before.spec_num_drafts,
                      after.spec_num_draft_tokens - before.spec_num_draft_tokens,
                      after.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
                      tuple(b - a for a, b in zip(first, after.spec_accepted_per_position, strict=True)))


@dataclass(frozen=True)
class OfflineResult:
    model: str
    backend: str
    device: str
    device_name: str
    dtype: str
    engine: dict[str, Any]
    workload: WorkloadSpec
    elapsed_s: float
    num_requests: int
    total_input_tokens: int
    total_output_tokens: int
    requested_output_tokens: int
    weight_bytes: int = 0  # the model's weights as stored on its device(s), every rank summed
    peak_load_host_bytes: int = 0  # the resident set at its highest while the weights loaded
    peak_load_device_bytes: int = 0  # the device allocator's peak while the weights loaded (CPU: 0)
    roofline: RooflineReport | None = None  # the run's per-step roofline (ferrum.bench.roofline)
    kv_cache_tokens: int = 0  # tokens the KV cache holds (its blocks x block size)
    kv_cache_dtype: str = ""
    speculation: Acceptance | None = None  # the run's drafts and acceptance, where it speculated

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.total_output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.total_input_tokens + self.total_output_tokens) / self.elapsed_s

    @property
    def output_tokens_as_requested(self) -> bool:
        """With ignore_eos every request must generate exactly its max_tokens."""
        return self.total_output_tokens == self.requested_output_tokens


def _params(request: BenchRequest, ignore_eos: bool) -> SamplingParams:
    return SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=ignore_eos)


def _run(engine: LLMEngine, requests: list[BenchRequest], ignore_eos: bool, tag: str,
         progress: RequestProgress | None) -> list[int]:
    """Runs `requests` to completion; the number of tokens each generated."""
    ids = [f"bench-{tag}-{i}" for i in range(len(requests))]
    counts = dict.fromkeys(ids, 0)
    for request_id, request in zip(ids, requests, strict=True):
        engine.add_request(request_id, list(request.prompt_token_ids), _params(request, ignore_eos))
    while engine.has_work:
        for out in engine.step():
            counts[out.request_id] = out.num_output_tokens
            if out.finished and progress is not None:
                progress.advance()
    return [counts[i] for i in ids]


def _check_fits(spec: WorkloadSpec, max_model_len: int) -> None:
    if spec.longest_request > max_model_len:
        raise BenchError(
            f"the longest request may need {spec.longest_request} tokens ({spec.describe_longest()}); "
            f"max_model_len is {max_model_len}: lower --prefix-len / --input-len / --output-len or raise "
            f"--max-model-len"
        )


def run_offline(options: OfflineOptions) -> OfflineResult:
    spec = options.workload
    if spec.prompts:
        raise BenchError(
            "bench offline draws random token-id prompts: a prompt list is for bench serve --endpoint chat"
        )
    if options.engine.get("max_model_len") is not None:  # before loading anything
        _check_fits(spec, int(options.engine["max_model_len"]))
    engine = create_engine(options.model, backend=options.backend, **options.engine)
    try:
        _check_fits(spec, engine.max_model_len)
        pool = prompt_token_pool(engine.tokenizer, engine.model_config.vocab_size)
        requests = make_workload(spec, pool)
        _run(engine, [warmup_request(spec, pool)], spec.ignore_eos, "warmup", None)
        roofline = engine_roofline(engine)
        stop_observing = engine.add_observer(roofline.add)
        before = engine.stats()
        with RequestProgress(len(requests), "bench offline") as progress:
            started = time.perf_counter()
            counts = _run(engine, requests, spec.ignore_eos, "run", progress)
            engine.device.runtime.synchronize()
            elapsed = time.perf_counter() - started
        stop_observing()
        device, dtype, settings = engine.device, engine.dtype, _settings(engine.config)
        stats = engine.stats()
        reports = engine.rank_reports
    finally:  # tensor-parallel ranks stopped and torch.distributed left before the interpreter exits
        engine.release()
    return OfflineResult(
        model=str(options.model),
        backend=device.name,
        device=device.name,
        device_name=device.description,
        dtype=dtype_name(dtype),
        engine=settings,
        workload=spec,
        elapsed_s=elapsed,
        num_requests=len(requests),
        total_input_tokens=sum(r.prompt_len for r in requests),
        total_output_tokens=sum(counts),
        requested_output_tokens=sum(r.output_len for r in requests),
        weight_bytes=sum(r.nbytes for r in reports),
        peak_load_host_bytes=max((r.peak_host_bytes for r in reports), default=0),
        peak_load_device_bytes=max((r.peak_device_bytes for r in reports), default=0),
        roofline=RooflineReport.of(roofline, elapsed),
        kv_cache_tokens=stats.kv_blocks_total * engine.config.block_size,
        kv_cache_dtype=stats.kv_cache_dtype,
        speculation=speculation_between(before, stats),
    )


def engine_roofline(engine: LLMEngine) -> Roofline:
    """The run's roofline, the device's peaks measured now (after the warm-up, before the run)."""
    ranks = engine.config.tensor_parallel_size
    peaks = measure_peaks(engine.device.torch_device, engine.dtype)
    if engine.device.kind == "cuda":
        torch.cuda.empty_cache()  # the measurement's buffers go back to the device
    peaks = type(peaks)(peaks.matmul_flops * ranks, peaks.bandwidth * ranks)
    experts = sum(m.stack_bytes for m in engine.model.modules() if isinstance(m, MoE)) * ranks  # equal shares
    cost = ModelCost.of(engine.model_config, sum(r.nbytes for r in engine.rank_reports), engine.dtype.itemsize,
                        engine.layout.bytes_per_token * ranks, experts if engine.model_config.moe else None)
    return Roofline(cost, peaks)


def _settings(config: EngineConfig) -> dict[str, Any]:
    """The engine's settings as plain values, for the report."""
    return asdict(config)
