"""Results as JSON documents and as text tables for the terminal."""

from __future__ import annotations

import json
import math
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ferrum.bench.metrics import Acceptance, Distribution, LevelResult, RequestRecord
from ferrum.bench.serve import LevelRun, ServeResult
from ferrum.bench.workload import WorkloadSpec

if TYPE_CHECKING:  # offline pulls in the engine and torch; `bench serve` needs neither
    from ferrum.bench.offline import OfflineResult

_WIDTH = 56


def _rate_json(rate: float) -> float | str:
    return "inf" if math.isinf(rate) else rate


def workload_json(spec: WorkloadSpec) -> dict[str, Any]:
    return {
        "num_prompts": spec.num_prompts,
        "input_len": [spec.input_len.low, spec.input_len.high],
        "output_len": [spec.output_len.low, spec.output_len.high],
        "seed": spec.seed,
        "ignore_eos": spec.ignore_eos,
        "prefix_len": spec.prefix_len,
        "dataset": spec.dataset,
        "num_distinct_prompts": len(spec.prompts) if spec.prompts else None,
    }


def offline_json(result: OfflineResult) -> dict[str, Any]:
    return {
        "kind": "offline",
        "model": result.model,
        "backend": result.backend,
        "device": result.device,
        "device_name": result.device_name,
        "dtype": result.dtype,
        "engine": result.engine,
        "workload": workload_json(result.workload),
        "elapsed_s": result.elapsed_s,
        "num_requests": result.num_requests,
        "total_input_tokens": result.total_input_tokens,
        "total_output_tokens": result.total_output_tokens,
        "requested_output_tokens": result.requested_output_tokens,
        "output_tokens_as_requested": result.output_tokens_as_requested,
        "requests_per_s": result.requests_per_s,
        "output_tokens_per_s": result.output_tokens_per_s,
        "total_tokens_per_s": result.total_tokens_per_s,
        "weight_bytes": result.weight_bytes,
        "peak_load_host_bytes": result.peak_load_host_bytes,
        "peak_load_device_bytes": result.peak_load_device_bytes,
        "roofline": asdict(result.roofline) if result.roofline is not None else None,
        "kv_cache_tokens": result.kv_cache_tokens,
        "kv_cache_dtype": result.kv_cache_dtype,
        "speculation": _speculation_json(result.speculation),
    }


def _speculation_json(s: Acceptance | None) -> dict[str, Any] | None:
    if s is None:
        return None
    return {**asdict(s), "acceptance_rate": s.acceptance_rate, "mean_accepted_length": s.mean_accepted_length}


def _distribution_json(d: Distribution) -> dict[str, float | None]:
    return {"mean": d.mean_ms, "median": d.median_ms, "p99": d.p99_ms}


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def request_json(r: RequestRecord) -> dict[str, Any]:
    return {
        "prompt_len": r.prompt_len,
        "output_len": r.output_len,
        "output_tokens": r.output_tokens,
        "ttft_ms": _ms(r.ttft_s) if r.ok else None,
        "tpot_ms": _ms(r.tpot_s),
        "latency_ms": _ms(r.latency_s),
        "itl_ms": [gap * 1000.0 for gap in r.itl_s],
        "token_source": r.token_source if r.ok else None,
        "finish_reason": r.finish_reason,
        "text": r.text,
        "error": r.error,
    }


def level_json(run: LevelRun, with_requests: bool) -> dict[str, Any]:
    r = run.result
    out: dict[str, Any] = {
        "concurrency": r.concurrency,
        "request_rate": _rate_json(r.request_rate),
        "num_requests": r.num_requests,
        "completed": r.completed,
        "failed": r.failed,
        "first_error": r.first_error,
        "duration_s": r.duration_s,
        "total_input_tokens": r.total_input_tokens,
        "total_output_tokens": r.total_output_tokens,
        "requested_output_tokens": r.requested_output_tokens,
        "request_throughput": r.request_throughput,
        "output_throughput": r.output_throughput,
        "total_token_throughput": r.total_token_throughput,
        "ttft_ms": _distribution_json(r.ttft),
        "tpot_ms": _distribution_json(r.tpot),
        "itl_ms": _distribution_json(r.itl),
        "e2el_ms": _distribution_json(r.e2el),
        "output_token_sources": r.token_sources,
        "finish_reasons": r.finish_reasons,
    }
    if run.speculation is not None:
        out["speculation"] = _speculation_json(run.speculation)
    if with_requests:
        out["requests"] = [request_json(record) for record in run.records]
    return out


def serve_json(result: ServeResult, with_requests: bool = False) -> dict[str, Any]:
    return {
        "kind": "serve",
        "url": result.url,
        "model": result.model,
        "max_model_len": result.max_model_len,
        "tokenizer": result.tokenizer,
        "endpoint": result.endpoint,
        "request_rate": _rate_json(result.request_rate),
        "workload": workload_json(result.workload),
        "warmup": None if result.warmup is None else request_json(result.warmup),
        "levels": [level_json(run, with_requests) for run in result.levels],
    }


def write_json(document: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(document, indent=2) + "\n")


# -- text ---------------------------------------------------------------------------------------------


def _title(text: str) -> str:
    return f"{' ' + text + ' ':=^{_WIDTH}}"


def _line(label: str, value: object) -> str:
    shown = f"{value:.2f}" if isinstance(value, float) else str(value)
    return f"{label + ':':<40}{shown:>{_WIDTH - 40}}"


def _fmt(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.2f}"


def offline_table(result: OfflineResult) -> str:
    lines = [
        _title("Offline benchmark"),
        _line("Model", Path(result.model).name or result.model),
        _line("Device", result.device),
        _line("Device name", result.device_name),
        _line("Dtype", result.dtype),
        _line("Quantization", _quantization_label(result.engine.get("quantization"))),
        _line("Weights (GB, as stored)", result.weight_bytes / 1e9),
        _line("Peak host memory while loading (GB)", result.peak_load_host_bytes / 1e9),
        _line("KV cache (tokens)", f"{result.kv_cache_tokens} ({result.kv_cache_dtype})"),
        _line("Requests", result.num_requests),
        _line("Shared prefix (tokens)", result.workload.prefix_len),
        _line("Elapsed (s)", result.elapsed_s),
        _line("Total input tokens", result.total_input_tokens),
        _line("Total generated tokens", result.total_output_tokens),
        _line("Requested output tokens", result.requested_output_tokens),
        _line("Request throughput (req/s)", result.requests_per_s),
        _line("Output token throughput (tok/s)", result.output_tokens_per_s),
        _line("Total token throughput (tok/s)", result.total_tokens_per_s),
        *_roofline_lines(result),
        *_speculation_lines(result.speculation),
        "=" * _WIDTH,
    ]
    return "\n".join(lines)


def _roofline_lines(result: OfflineResult) -> list[str]:
    r = result.roofline
    if r is None:
        return []
    kinds = ", ".join(f"{kind} {s:.2f}" for kind, s in r.seconds_by_kind.items())
    return [
        _title("Per-step roofline"),
        _line("Measured peak matmul (TFLOP/s)", r.peak_tflops),
        _line("Measured copy bandwidth (GB/s)", r.bandwidth_gbs),
        _line("Roofline (s)", r.seconds),
        _line("Of the measured time", f"{r.fraction:.1%}"),
        _line("Forward passes", r.passes),
        _line("Compute-bound / memory-bound", f"{r.compute_bound_passes} / {r.passes - r.compute_bound_passes}"),
        _line("Roofline by step kind (s)", kinds or "-"),
    ]


def _speculation_lines(s: Acceptance | None) -> list[str]:
    if s is None:
        return []
    drafts = max(s.num_drafts, 1)
    by_position = ", ".join(f"{n / drafts:.2f}" for n in s.accepted_per_position)
    return [
        _title("Speculative decoding"),
        _line("Drafts verified", f"{s.num_drafts:.0f}"),
        _line("Draft tokens / accepted", f"{s.num_draft_tokens:.0f} / {s.num_accepted_tokens:.0f}"),
        _line("Acceptance rate", f"{s.acceptance_rate:.1%}"),
        _line("Mean accepted length", s.mean_accepted_length),
        _line("Accepted by position (per draft)", by_position or "-"),
    ]


def _quantization_label(settings: dict[str, Any] | None) -> str:
    """e.g. "int4 g128", "int8", "none" (from the engine settings' `quantization`)."""
    if not settings:
        return "none"
    method = str(settings["method"])
    return f"{method} g{settings['group_size']}" if method == "int4" else method


def _counts(counts: dict[str, int]) -> str:
    """e.g. "usage 30, chunks 2"; "-" when empty."""
    return ", ".join(f"{name} {n}" for name, n in counts.items()) or "-"


def _dataset(spec: WorkloadSpec) -> str:
    if spec.prompts:
        return f"prompt list ({len(spec.prompts)} prompts)"
    return f"random ids, input {spec.input_len}"


def serve_header(result: ServeResult) -> str:
    """What was run: server, endpoint and workload."""
    spec = result.workload
    lines = [
        _title("Serving benchmark"),
        _line("URL", result.url),
        _line("Model", result.model),
        _line("Endpoint", "/v1/chat/completions" if result.endpoint == "chat" else "/v1/completions"),
        _line("Dataset", _dataset(spec)),
        _line("Shared prefix (tokens)", spec.prefix_len),
        _line("Output length (max_tokens)", str(spec.output_len)),
        _line("Ignore EOS", spec.ignore_eos),
        _line("Seed", spec.seed),
        "=" * _WIDTH,
    ]
    return "\n".join(lines)


def level_table(r: LevelResult) -> str:
    rate = "inf" if math.isinf(r.request_rate) else f"{r.request_rate:g}"
    lines = [
        _title(f"Concurrency {r.concurrency}, request rate {rate}"),
        _line("Successful requests", r.completed),
        _line("Failed requests", r.failed),
        _line("Benchmark duration (s)", r.duration_s),
        _line("Total input tokens", r.total_input_tokens),
        _line("Total generated tokens", r.total_output_tokens),
        _line("Output tokens counted from", _counts(r.token_sources)),
        _line("Finish reasons", _counts(r.finish_reasons)),
        _line("Request throughput (req/s)", r.request_throughput),
        _line("Output token throughput (tok/s)", r.output_throughput),
        _line("Total token throughput (tok/s)", r.total_token_throughput),
    ]
    for name, d in (("TTFT", r.ttft), ("TPOT", r.tpot), ("ITL", r.itl), ("E2E latency", r.e2el)):
        lines.append(f"{' ' + name + ' (ms) ':-^{_WIDTH}}")
        lines += [_line(f"Mean {name}", _fmt(d.mean_ms)), _line(f"Median {name}", _fmt(d.median_ms)),
                  _line(f"P99 {name}", _fmt(d.p99_ms))]
    if r.first_error is not None:
        lines.append(f"First error: {r.first_error}")
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


_SUMMARY_COLUMNS = ("conc", "ok", "fail", "req/s", "out tok/s", "tot tok/s", "TTFT p50", "TTFT p99",
                    "TPOT p50", "TPOT p99", "ITL p50", "ITL p99")


def summary_table(results: list[LevelResult]) -> str:
    """One row per level (latencies in ms)."""
    rows = [_SUMMARY_COLUMNS]
    for r in results:
        rows.append((
            str(r.concurrency), str(r.completed), str(r.failed), f"{r.request_throughput:.2f}",
            f"{r.output_throughput:.1f}", f"{r.total_token_throughput:.1f}", _fmt(r.ttft.median_ms),
            _fmt(r.ttft.p99_ms), _fmt(r.tpot.median_ms), _fmt(r.tpot.p99_ms), _fmt(r.itl.median_ms),
            _fmt(r.itl.p99_ms),
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(_SUMMARY_COLUMNS))]
    return "\n".join("  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True)) for row in rows)
