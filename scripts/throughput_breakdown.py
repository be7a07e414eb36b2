"""Where the offline benchmark's time goes on a GPU: a table that adds up to the measured time.

    python scripts/throughput_breakdown.py --model /path/to/checkpoint [--num-prompts 256] [--out DIR]

The workload is `ferrum bench offline`'s (256 requests of 100-1024 random token ids in and out, EOS
ignored, seed 0), run twice in one engine after its warm-up:

  plain      unprofiled: the measured time, each step's wall time by kind (the engine's step observer),
             and the per-step roofline (ferrum.bench.roofline) by kind
  profiled   the same lengths with other prompt ids (no prefix-cache hits on the first run's), GPU
             activity recorded with torch.profiler (CUDA activity only; the profiler is restarted every
             --chunk-steps steps, the device synchronized, so that its buffers stay small: the restarts
             are their own row)

The profiled run's time is cut into the engine's steps (by kind: prefill, mixed, decode, burst) and the
host's time between steps; in each, the GPU's busy time by kind of kernel (attention, the fused decode
chain's GEMVs, GEMMs, norms and rope, sampling, all-reduce, copies, other) and the time the GPU had no
kernel running (the device waiting for the host). Kernels that overlap count once, for the one that
started first. Every row adds up to its wall time, and the rows to the run's.

Uses Ferrum's public surface only: create_engine, the engine's requests and steps, its step observer,
and ferrum.bench's workload and roofline.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ferrum.backends.cpu import read_cpu_model  # noqa: E402
from ferrum.bench.offline import engine_roofline  # noqa: E402
from ferrum.bench.workload import LengthRange, WorkloadSpec, make_workload, prompt_token_pool, warmup_request  # noqa: E402
from ferrum.engine.builder import create_engine  # noqa: E402
from ferrum.engine.observer import StepRecord  # noqa: E402
from ferrum.engine.sampling_params import SamplingParams  # noqa: E402

# kernel name fragments (lower case) -> category; the first match wins
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("all-reduce", ("one_shot_sum", "nccl", "allreduce", "all_reduce")),
    ("attention", ("_decode_kernel", "_decode_reduce", "_prefill_kernel", "attention", "fmha", "flash")),
    ("GEMV (fused decode chain)", ("_gemv_kernel", "_pair_gemv", "_qkv_rope")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm80_", "_w4a16", "_w8a16", "matmul",
              "_grouped_kernel")),
    ("sampling", ("argmax", "_advance", "topk", "sort", "softmax", "multinomial", "exponential", "max_")),
    ("norm, rope, KV write, activation", ("_rms_norm", "_rope_store", "_silu_and_mul", "rms", "rope")),
    ("copies", ("memcpy", "memset")),
)
OTHER = "other kernels"
IDLE = "GPU idle"
BACKEND = "cuda"  # --backend cpu: a smoke test of this script on a machine without a GPU
COLUMNS = [name for name, _ in CATEGORIES] + [OTHER, IDLE]


def category(name: str) -> str:
    low = name.lower()
    for label, fragments in CATEGORIES:
        if any(f in low for f in fragments):
            return label
    return OTHER


@dataclass
class Window:
    """A stretch of wall time and what the GPU did in it."""

    wall_ns: int = 0
    busy_ns: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    count: int = 0  # steps (or gaps) in it

    def row(self) -> dict[str, float]:
        busy = sum(self.busy_ns.values())
        out = {c: self.busy_ns.get(c, 0) / 1e9 for c in COLUMNS[:-1]}
        out[IDLE] = (self.wall_ns - busy) / 1e9
        return out


class Timeline:
    """Cuts the run into labelled segments (steps by kind, gaps between them, profiler restarts) and
    adds each GPU activity's time to the segments it overlaps."""

    def __init__(self) -> None:
        self.segments: list[tuple[int, int, str]] = []  # (start, end, label), epoch ns, in order
        self.pieces: list[tuple[int, int, str]] = []  # non-overlapping GPU activity, (start, end, category)
        self.kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])  # name -> [count, seconds]
        self._covered = 0

    def add_events(self, events: list[tuple[int, int, str]]) -> None:
        for start, end, name in sorted(events):
            entry = self.kernels[name]
            entry[0] += 1
            entry[1] += (end - start) / 1e9
            start = max(start, self._covered)
            if end > start:
                self.pieces.append((start, end, category(name)))
                self._covered = end

    def windows(self, t0: int, t1: int) -> tuple[dict[str, Window], int]:
        """Per label, its wall time and busy time; the GPU time outside [t0, t1] (a check of the clocks)."""
        segments: list[tuple[int, int, str]] = []
        cursor = t0
        for start, end, label in sorted(self.segments):
            start, end = max(start, cursor), min(end, t1)
            if start > cursor:
                segments.append((cursor, start, "between steps (host)"))
            if end > start:
                segments.append((start, end, label))
                cursor = end
        if cursor < t1:
            segments.append((cursor, t1, "between steps (host)"))
        out: dict[str, Window] = defaultdict(Window)
        for start, end, label in segments:
            out[label].wall_ns += end - start
            out[label].count += 1
        outside = 0
        j = 0
        for start, end, cat in self.pieces:
            outside += max(0, min(end, t0) - start) + max(0, end - max(start, t1))
            while j < len(segments) and segments[j][1] <= start:
                j += 1
            k = j
            while k < len(segments) and segments[k][0] < end:
                s, e, label = segments[k]
                overlap = min(e, end) - max(s, start)
                if overlap > 0:
                    out[label].busy_ns[cat] += overlap
                k += 1
        return out, outside


def gpu_events(prof: profile) -> list[tuple[int, int, str]]:
    """The device's activities (with --backend cpu, a smoke test: the host's operators)."""
    assert prof.profiler is not None and prof.profiler.kineto_results is not None
    results = prof.profiler.kineto_results
    device = torch.autograd.DeviceType.CUDA if BACKEND == "cuda" else torch.autograd.DeviceType.CPU
    out = []
    for e in results.events():
        if e.device_type() == device and e.duration_ns() > 0:
            out.append((e.start_ns(), e.end_ns(), e.name()))
    return out


def add_requests(engine, spec: WorkloadSpec, pool, round_index: int, tag: str) -> int:
    requests = make_workload(spec, pool, round_index)
    for i, r in enumerate(requests):
        engine.add_request(f"{tag}-{i}", list(r.prompt_token_ids),
                           SamplingParams(max_tokens=r.output_len, temperature=0.0, ignore_eos=True))
    return sum(r.output_len for r in requests)


def run(engine, spec: WorkloadSpec, pool, round_index: int, profiled: bool, chunk_steps: int) -> dict:
    offset = time.time_ns() - time.perf_counter_ns()
    steps: list[StepRecord] = []
    roofline = engine_roofline(engine)
    timeline = Timeline()
    state: dict = {"prof": None, "since": 0}

    def start_profiler() -> None:
        activity = ProfilerActivity.CUDA if BACKEND == "cuda" else ProfilerActivity.CPU
        state["prof"] = profile(activities=[activity])
        state["prof"].start()

    def restart(record: StepRecord) -> None:
        steps.append(record)
        roofline.add(record)
        if not profiled:
            return
        state["since"] += 1
        if state["since"] >= chunk_steps:
            a = time.time_ns()
            state["prof"].stop()  # synchronizes the device first
            timeline.add_events(gpu_events(state["prof"]))
            start_profiler()
            timeline.segments.append((a, time.time_ns(), "profiler restarts"))
            state["since"] = 0

    stop_observing = engine.add_observer(restart)
    tokens = add_requests(engine, spec, pool, round_index, f"round{round_index}")
    if profiled:
        start_profiler()
    t0 = time.time_ns()
    while engine.has_work:
        engine.step()
    engine.device.runtime.synchronize()
    t1 = time.time_ns()
    stop_observing()
    if profiled:
        state["prof"].stop()
        timeline.add_events(gpu_events(state["prof"]))
    for s in steps:
        timeline.segments.append((int(s.started * 1e9) + offset, int(s.finished * 1e9) + offset, s.kind))
    windows, outside = timeline.windows(t0, t1)
    elapsed = (t1 - t0) / 1e9
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])
    for s in steps:
        k = by_kind[s.kind]
        k[0] += 1
        k[1] += s.finished - s.started
        k[2] += s.iterations
    top = sorted(timeline.kernels.items(), key=lambda kv: -kv[1][1])[:25]
    return {
        "elapsed_s": elapsed, "output_tokens": tokens, "output_tok_per_s": tokens / elapsed,
        "roofline_s": roofline.seconds, "roofline_fraction": roofline.seconds / elapsed,
        "roofline_by_kind_s": dict(roofline.by_kind),
        "steps_by_kind": {k: {"steps": v[0], "wall_s": v[1], "passes": v[2]} for k, v in by_kind.items()},
        "windows": {label: {"count": w.count, "wall_s": w.wall_ns / 1e9, **w.row()} for label, w in windows.items()},
        "gpu_time_outside_run_s": outside / 1e9,
        "burst_rows": sum(s.num_seqs * s.iterations for s in steps if s.kind == "burst"),
        "burst_tokens": sum(s.num_generated for s in steps if s.kind == "burst"),
        "top_kernels": [{"name": n, "count": int(c), "seconds": s, "category": category(n)} for n, (c, s) in top],
    }


def print_table(result: dict, plain: dict) -> None:
    rows = result["windows"]
    order = [k for k in ("prefill", "mixed", "decode", "burst", "verify", "between steps (host)", "profiler restarts")
             if k in rows]
    short = {c: c.split(" (")[0] for c in COLUMNS}
    print("\n| part | count | wall s | roofline s | " + " | ".join(short[c] for c in COLUMNS) + " |")
    print("|---" * (len(COLUMNS) + 4) + "|")
    totals: dict[str, float] = defaultdict(float)
    for label in order:
        r = rows[label]
        roof = result["roofline_by_kind_s"].get(label)
        cells = [f"{r[c]:.2f}" for c in COLUMNS]
        for c in COLUMNS + ["wall_s"]:
            totals[c] += r[c]
        roof_cell = f"{roof:.2f}" if roof is not None else ""
        print(f"| {label} | {r['count']} | {r['wall_s']:.2f} | {roof_cell} | " + " | ".join(cells) + " |")
    print(f"| total | | {totals['wall_s']:.2f} | {result['roofline_s']:.2f} | "
          + " | ".join(f"{totals[c]:.2f}" for c in COLUMNS) + " |")
    print(f"\nprofiled run {result['elapsed_s']:.2f} s ({result['output_tok_per_s']:.0f} output tok/s, roofline "
          f"{result['roofline_fraction']:.1%}); unprofiled run {plain['elapsed_s']:.2f} s "
          f"({plain['output_tok_per_s']:.0f} tok/s, roofline {plain['roofline_fraction']:.1%}); GPU time outside "
          f"the profiled run's span {result['gpu_time_outside_run_s']:.3f} s")
    kinds = plain["steps_by_kind"].items()
    print("unprofiled steps by kind: " + ", ".join(
        f"{k} {v['steps']} steps / {v['passes']} passes, {v['wall_s']:.2f} s" for k, v in kinds))
    print(f"burst rows run {plain['burst_rows']} for {plain['burst_tokens']} tokens kept (the rest: finished "
          "sequences riding along to a burst's end)")
    print("\ntop kernels (profiled run):")
    for k in result["top_kernels"]:
        print(f"  {k['seconds']:8.3f} s  {k['count']:8d}  {k['category']:32}  {k['name'][:110]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--input-len", default="100:1024")
    parser.add_argument("--output-len", default="100:1024")
    parser.add_argument("--kv-cache-dtype", default="auto")
    parser.add_argument("--chunk-steps", type=int, default=64, help="steps between the profiler's restarts")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    parser.add_argument("--tag", default="breakdown")
    parser.add_argument("--backend", default="cuda", help="cpu: a smoke test (the host's operators as 'kernels')")
    args = parser.parse_args()
    global BACKEND
    BACKEND = args.backend
    if BACKEND == "cuda" and not torch.cuda.is_available():
        sys.exit("throughput_breakdown.py times GPU kernels: it needs CUDA (--backend cpu for a smoke test)")
    extra: dict[str, Any] = {} if BACKEND == "cuda" else {"dtype": "float32", "kv_cache_memory_gb": 0.2}
    engine = create_engine(args.model, backend=BACKEND, max_model_len=args.max_model_len,
                           kv_cache_dtype=args.kv_cache_dtype, **extra)
    try:
        spec = WorkloadSpec(num_prompts=args.num_prompts, input_len=LengthRange.parse(args.input_len),
                            output_len=LengthRange.parse(args.output_len))
        pool = prompt_token_pool(engine.tokenizer, engine.model_config.vocab_size)
        warm = warmup_request(spec, pool)
        engine.add_request("warmup", list(warm.prompt_token_ids), SamplingParams(max_tokens=warm.output_len,
                                                                                   ignore_eos=True))
        while engine.has_work:
            engine.step()
        plain = run(engine, spec, pool, 0, profiled=False, chunk_steps=args.chunk_steps)
        profiled = run(engine, spec, pool, 1, profiled=True, chunk_steps=args.chunk_steps)
    finally:
        engine.release()
    gpu = torch.cuda.get_device_name() if BACKEND == "cuda" else "none"
    info = {"model": args.model, "gpu": gpu, "torch": torch.__version__, "cpu": read_cpu_model(),
            "num_prompts": args.num_prompts, "kv_cache_dtype": args.kv_cache_dtype}
    print_table(profiled, plain)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.tag}.json").write_text(json.dumps({"info": info, "plain": plain, "profiled": profiled},
                                                          indent=1))


if __name__ == "__main__":
    main()
