#!/usr/bin/env python
"""Serving benchmark: Ferrum vs `transformers serve --continuous-batching` on the same model folder.

Not a test. Starts one server at a time (Ferrum first, then transformers serve), measures its time to
ready, sends one warm-up request, then measures each concurrency level (a phase) with
`ferrum.bench.serve.run_serve`, stops the server, and moves on. Prints a table and writes JSON. This
script only launches and watches the servers; requests and metrics are `ferrum bench serve`'s.

    python scripts/bench_serve.py --model models/SmolLM2-135M-Instruct            # both servers
    python scripts/bench_serve.py --concurrency 1 8 --requests-per-level 4 16     # shorter
    python scripts/bench_serve.py --skip-transformers --ferrum-args="--max-num-seqs 16"   # note the =

Workload (`ferrum bench serve --endpoint chat` with a prompt list): the 16 short chat prompts below,
temperature 0, `max_tokens` (default 64), streaming, `stream_options.include_usage`, no ignore_eos:
answers end where the model stops, so output tokens are counted, not assumed: from the `usage` a server
reports in its stream (both servers here do; transformers serve sends it on the final chunk even though it
ignores `stream_options`), else from the number of content chunks; the JSON and the table say which was
used. Concurrency N means at most N requests in flight, the next sent as soon as one finishes; request i
of a phase gets prompt i mod 16. Default requests per phase: 8 at c=1, else 4 per slot (32 at c=8).

Metrics per phase (ferrum.bench.metrics): output tok/s = all output tokens / wall time of the phase;
TTFT = time to the first non-empty content delta; TPOT = (e2e - TTFT) / (output tokens - 1), for requests
with > 1 token. Time to ready: from process spawn to the first 200 on the health endpoint (GET /health on
both servers; both load the model before they start listening). The warm-up is the phase's first prompt,
sent alone and untimed by the phases.

Both servers get the same dtype (--dtype, default bfloat16: the checkpoint's own, which transformers'
`auto` keeps and Ferrum's CPU `auto` picks where the CPU has bf16 matmul units) and the same KV cache
budget (--kv-cache-gb, default 2 GiB, Ferrum's own cap).
Ferrum: python -m ferrum.cli serve --model ABS_MODEL_PATH --backend cpu --dtype DTYPE \
            --kv-cache-memory-gb 2.0 --served-model-name NAME --host 127.0.0.1 --port P
transformers (with HF_HUB_OFFLINE=1):
        transformers serve ABS_MODEL_PATH --continuous-batching --device cpu --dtype DTYPE \
            --cb-num-blocks 182 --cb-max-batch-tokens 1024 --host 127.0.0.1 --port P+1
  - the positional model preloads and pins the model before the server listens, so /health means loaded,
    and requests must name that exact string as `model` (its /v1/models lists the HF cache instead);
  - `--dtype`: the same on both, so the comparison is like for like;
  - `--cb-num-blocks`: blocks of 256 tokens of KV for the whole model, sized to --kv-cache-gb; left
    alone, CB on CPU takes 60% of RAM for its cache (~11 GB RSS for this 135M model, and 15 s to set up
    on the first request, once measured); `--cb-max-batch-tokens 1024` is Ferrum's max_num_batched_tokens
    (the CB default, 8192, also sizes its attention-mask buffers). --transformers-cb-defaults drops both;
  - continuous batching is checked, not assumed: its log has "[Request received] ..., CB: True" per request.
The paged CB cache is set up lazily on the first request, so the warm-up time is reported too.

The machine may be shared: before starting each server the script waits (--quiet-wait) for other processes
to go quiet, and for each phase it reports the CPU share other processes took ("others"); a phase where that
is high measured the neighbours, not the server.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import datetime as dt
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, BinaryIO

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # this checkout's ferrum, not an installed one
    sys.path.insert(0, str(ROOT))

from ferrum.bench.errors import BenchError  # noqa: E402
from ferrum.bench.metrics import RequestRecord  # noqa: E402
from ferrum.bench.report import level_json  # noqa: E402
from ferrum.bench.serve import LevelRun, ServeOptions, run_serve  # noqa: E402
from ferrum.bench.workload import LengthRange, WorkloadSpec  # noqa: E402

PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "Name three primary colors.",
    "What is 12 times 12?",
    "Give me a synonym for 'happy'.",
    "Who wrote 'Romeo and Juliet'?",
    "What is the boiling point of water in Celsius?",
    "Translate 'good morning' into Spanish.",
    "List three planets in our solar system.",
    "What does a CPU do?",
    "Suggest a name for a pet goldfish.",
    "Why is the sky blue?",
    "Write one sentence about autumn.",
    "What is the largest ocean on Earth?",
    "How many legs does a spider have?",
)

# CPU flags worth printing for a CPU inference benchmark (the JSON keeps all of them).
_SIMD_PREFIXES = ("sse4", "avx", "amx", "fma", "f16c")


# -- servers ------------------------------------------------------------------------------------------


class ServerError(RuntimeError):
    pass


_LIVE: list[ServerProcess] = []


def _kill_all_live() -> None:
    for proc in list(_LIVE):  # noqa: PERF101 - stop() removes from _LIVE
        proc.stop()


atexit.register(_kill_all_live)


def _on_signal(signum, _frame):
    _kill_all_live()
    raise SystemExit(128 + signum)


class ServerProcess:
    """A server in its own process group, so that stop() takes its children down with it."""

    def __init__(
        self, name: str, cmd: list[str], env: dict[str, str], log_path: Path, base_url: str, health_path: str,
        cwd: Path = ROOT,
    ):
        self.name, self.cmd, self.env, self.log_path = name, cmd, env, log_path
        self.base_url, self.health_path, self.cwd = base_url, health_path, cwd
        self.proc: subprocess.Popen | None = None
        self._log: BinaryIO | None = None

    def start(self) -> float:
        """Spawn and wait for the first 200 on the health endpoint; returns seconds from spawn to ready."""
        import httpx

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - open for the server's lifetime
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            cwd=self.cwd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        _LIVE.append(self)
        url = self.base_url + self.health_path
        with httpx.Client(timeout=2.0) as client:
            while True:
                if self.proc.poll() is not None:
                    raise ServerError(
                        f"{self.name} exited with {self.proc.returncode} before it was ready; "
                        f"log {self.log_path}:\n{self.log_tail()}"
                    )
                try:
                    if client.get(url).status_code == 200:
                        return time.perf_counter() - t0
                except httpx.HTTPError:
                    pass
                if time.perf_counter() - t0 > self.ready_timeout:
                    raise ServerError(
                        f"{self.name} not ready after {self.ready_timeout:.0f}s; "
                        f"log {self.log_path}:\n{self.log_tail()}"
                    )
                time.sleep(0.05)

    ready_timeout = 300.0

    def log_tail(self, n: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def group_peak_rss_mb(self) -> float | None:
        """Sum of peak RSS (VmHWM) over the live processes of the server's process group."""
        if self.proc is None or self.proc.poll() is not None:
            return None
        total_kb = 0
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                pgrp = int(stat.rsplit(")", 1)[1].split()[2])
                if pgrp != self.proc.pid:
                    continue
                for line in (entry / "status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        total_kb += int(line.split()[1])
            except (OSError, ValueError, IndexError):
                continue
        return round(total_kb / 1024, 1) if total_kb else None

    @property
    def pgid(self) -> int:
        """The process group of the started server (its leader's pid)."""
        if self.proc is None:
            raise ServerError(f"{self.name} was not started")
        return self.proc.pid

    def stop(self) -> None:
        proc = self.proc
        if proc is not None and proc.poll() is None:
            # SIGTERM: graceful for both uvicorn servers; a second signal makes uvicorn force its exit.
            for sig, wait in ((signal.SIGTERM, 10), (signal.SIGTERM, 5), (signal.SIGKILL, 5)):
                try:
                    os.killpg(proc.pid, sig)
                except ProcessLookupError:
                    break
                try:
                    proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
        if proc is not None:
            # The leader may be gone while children linger: sweep the group once more.
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self._log is not None:
            self._log.close()
            self._log = None
        if self in _LIVE:
            _LIVE.remove(self)


# -- CPU accounting: the machine is shared, so say how much CPU others took during each phase ---------

_TICK = os.sysconf("SC_CLK_TCK")


def _busy_cpu_s() -> float:
    """Busy CPU seconds of the whole machine (all CPUs), steal included."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / _TICK


def _group_cpu_s(pgid: int | None) -> float:
    """utime + stime of the live processes of a process group, plus this process when pgid is None."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            rest = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if (pgid is None and int(entry.name) == os.getpid()) or (pgid is not None and int(rest[2]) == pgid):
            total += int(rest[11]) + int(rest[12])
    return total / _TICK


class CpuMeter:
    def __init__(self, server_pgid: int | None):
        self.pgid = server_pgid
        self.t0 = time.perf_counter()
        self.busy0, self.srv0, self.me0 = _busy_cpu_s(), self._srv(), _group_cpu_s(None)

    def _srv(self) -> float:
        return _group_cpu_s(self.pgid) if self.pgid is not None else 0.0

    def read(self, spawned_pgid: int | None = None) -> dict:
        """spawned_pgid: a server started after this meter, all of whose CPU time counts as the server's."""
        wall = time.perf_counter() - self.t0
        busy = _busy_cpu_s() - self.busy0
        srv = _group_cpu_s(spawned_pgid) if spawned_pgid is not None else self._srv() - self.srv0
        me = _group_cpu_s(None) - self.me0
        cap = wall * (os.cpu_count() or 1) / 100.0
        return {
            "server_cpu_pct": round(srv / cap, 1) if cap else None,
            "client_cpu_pct": round(me / cap, 1) if cap else None,
            "other_cpu_pct": round(max(0.0, busy - srv - me) / cap, 1) if cap else None,
        }


def wait_for_quiet(max_wait_s: float, threshold_pct: float) -> float:
    """Wait (up to max_wait_s) until the other processes on the machine use under threshold_pct of its CPUs,
    sampled over 1 s; returns the last sample."""
    deadline = time.perf_counter() + max_wait_s
    announced = False
    while True:
        meter = CpuMeter(None)
        time.sleep(1.0)
        other = meter.read()["other_cpu_pct"] or 0.0
        if other < threshold_pct or time.perf_counter() >= deadline:
            if other >= threshold_pct:
                print(f"   machine still busy ({other:.0f}% CPU used by others); going on", flush=True)
            return other
        if not announced:
            print(f"   waiting for a quieter machine ({other:.0f}% CPU used by others)...", flush=True)
            announced = True


# -- the machine -------------------------------------------------------------------------------------


def cpu_info() -> dict[str, Any]:
    """The CPU's model name and flags, from the first processor of /proc/cpuinfo."""
    info: dict[str, Any] = {"model": platform.processor() or platform.machine(), "flags": []}
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return info
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == "model name":
            info["model"] = value.strip()
        elif key.strip() == "flags":
            info["flags"] = value.split()
            break
    return info


def simd_flags(flags: list[str]) -> list[str]:
    """The vector-unit flags among `flags` (SSE4, AVX*, AMX*, FMA, F16C, and any *bf16* / *vnni*)."""
    return [f for f in flags if f.startswith(_SIMD_PREFIXES) or "bf16" in f or "vnni" in f]


# -- phases -------------------------------------------------------------------------------------------


def requests_for(concurrency: int) -> int:
    """The default number of requests of a phase: 8 at c=1, else 4 per slot (32 at c=8)."""
    return concurrency * max(4, 8 // concurrency)


def phase_sizes(args: argparse.Namespace) -> list[int]:
    """The number of requests of each phase, in --concurrency order."""
    return (
        list(args.requests_per_level)
        if args.requests_per_level
        else [requests_for(c) for c in args.concurrency]
    )


def workload(args: argparse.Namespace, requests: int) -> WorkloadSpec:
    """The chat workload of one phase: request i asks prompt i mod 16, with max_tokens --max-tokens."""
    return WorkloadSpec(
        num_prompts=requests,
        output_len=LengthRange(args.max_tokens, args.max_tokens),
        ignore_eos=False,
        prompts=PROMPTS,
    )


def run_phase(
    base_url: str, model: str, concurrency: int, requests: int, args: argparse.Namespace
) -> LevelRun:
    """One concurrency level through ferrum.bench.serve.run_serve, without its warm-up request."""
    options = ServeOptions(
        base_url,
        workload(args, requests),
        (concurrency,),
        model=model,
        timeout_s=args.request_timeout,
        endpoint="chat",
        warmup=False,
    )
    return asyncio.run(run_serve(options)).levels[0]


def warm_up(base_url: str, model: str, args: argparse.Namespace) -> tuple[float, RequestRecord]:
    """Seconds taken by the first request (the first prompt, alone), and its record."""
    t0 = time.perf_counter()
    record = run_phase(base_url, model, 1, 1, args).records[0]
    if not record.ok:
        raise ServerError(f"warm-up request failed: {record.error}")
    return time.perf_counter() - t0, record


def measured_phase(
    server: ServerProcess, model: str, concurrency: int, requests: int, args: argparse.Namespace
) -> tuple[dict, LevelRun]:
    """One phase (re-run while other processes took too much CPU): its JSON record and its run."""
    discarded: list[dict] = []
    for attempt in range(args.contention_retries + 1):
        if attempt:
            print(f"   re-running c={concurrency} (attempt {attempt + 1})", flush=True)
            if args.quiet_wait > 0:
                wait_for_quiet(args.quiet_wait, args.quiet_threshold)
        load_before = os.getloadavg()[0]
        meter = CpuMeter(server.pgid)
        run = run_phase(server.base_url, model, concurrency, requests, args)
        cpu = meter.read()
        # CPU shares during the phase (100% = all CPUs) and the 1-minute load average: a phase where other
        # processes took a real share of the CPUs measured the machine, not the server.
        record = {
            **level_json(run, with_requests=False),
            "cpu": cpu,
            "loadavg_1m": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
        }
        _print_phase(run, cpu)
        record["contended"] = (cpu["other_cpu_pct"] or 0) > args.quiet_threshold
        if not record["contended"]:
            break
        print(
            f"   WARNING: other processes took {cpu['other_cpu_pct']}% of the CPUs during this phase: its "
            "numbers are not reliable",
            flush=True,
        )
        if attempt < args.contention_retries:
            discarded.append(record)
    record["discarded_contended_attempts"] = discarded
    return record, run


def _print_phase(run: LevelRun, cpu: dict) -> None:
    r = run.result
    print(
        f"   c={r.concurrency}: {r.completed}/{r.num_requests} ok, {r.total_output_tokens} tok in "
        f"{r.duration_s:.2f}s = {r.output_throughput:.1f} tok/s, TTFT p50 {fmt(r.ttft.median_ms)} ms, "
        f"TPOT p50 {fmt(r.tpot.median_ms)} ms; CPU server {cpu['server_cpu_pct']}% others "
        f"{cpu['other_cpu_pct']}%",
        flush=True,
    )
    if r.failed:
        print(f"   errors: {r.failed}, first: {r.first_error}", flush=True)


def bench_server(
    name: str,
    server: ServerProcess,
    model: str,
    args: argparse.Namespace,
    check_log: Callable[[ServerProcess], dict] | None = None,
) -> dict:
    """Starts `server`, warms it up, measures every phase, stops it; the server's JSON record."""
    out: dict = {"name": name, "cmd": shlex.join(server.cmd), "log": str(server.log_path), "model": model}
    print(f"\n== {name}: {out['cmd']}", flush=True)
    out["loadavg_1m_before_start"] = round(os.getloadavg()[0], 2)
    if args.quiet_wait > 0:
        out["other_cpu_pct_before_start"] = wait_for_quiet(args.quiet_wait, args.quiet_threshold)
    try:
        meter = CpuMeter(None)
        ready = server.start()
        out["ready_s"] = round(ready, 3)
        out["cpu_during_start"] = meter.read(spawned_pgid=server.pgid)
        print(f"   ready in {ready:.2f}s", flush=True)
        warmup_s, w = warm_up(server.base_url, model, args)
        out["warmup_s"] = round(warmup_s, 3)
        print(
            f"   warm-up {warmup_s:.2f}s, {w.output_tokens} tokens ({w.token_source}): {w.text[:80]!r}",
            flush=True,
        )
        phases = []
        answers: dict[int, str] = {}
        for c, n in zip(args.concurrency, phase_sizes(args), strict=True):
            record, run = measured_phase(server, model, c, n, args)
            phases.append(record)
            for i, r in enumerate(run.records):
                if r.ok:
                    answers.setdefault(i % len(PROMPTS), r.text)
        out["phases"] = phases
        out["answers"] = {str(k): v for k, v in sorted(answers.items())}
        out["peak_rss_mb"] = server.group_peak_rss_mb()
        if check_log is not None:
            out.update(check_log(server))
    except (ServerError, BenchError) as exc:
        out["error"] = str(exc)
        print(f"   FAILED: {exc}", file=sys.stderr, flush=True)
    finally:
        t0 = time.perf_counter()
        server.stop()
        out["stop_s"] = round(time.perf_counter() - t0, 2)
        if server.proc is not None:
            out["exit_code"] = server.proc.returncode
    return out


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 4) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def transformers_num_blocks(
    model_dir: Path, kv_cache_gb: float, dtype_bytes: int, page_size: int = 256
) -> int:
    """transformers' --cb-num-blocks counts whole-model blocks of `page_size` (256) tokens: size it to the same
    float32 KV bytes as Ferrum's --kv-cache-memory-gb."""
    return max(1, int(kv_cache_gb * 1024**3 // (page_size * kv_bytes_per_token(model_dir, dtype_bytes))))


def transformers_cb_check(server: ServerProcess) -> dict:
    """transformers serve logs `[Request received] Model: ..., CB: True|False` for every request."""
    text = server.log_path.read_text(errors="replace")
    on, off = text.count(", CB: True"), text.count(", CB: False")
    if off or not on:
        print(f"   WARNING: continuous batching not in use (CB: True x{on}, CB: False x{off})", flush=True)
    return {"cb_requests_logged": {"true": on, "false": off}}


def versions() -> dict:
    info: dict = {"python": platform.python_version()}
    from importlib import metadata

    for dist in ("torch", "transformers", "ferrum", "aiohttp"):
        try:
            info[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            info[dist] = "not installed"
    try:
        import torch

        info["torch_num_threads"] = torch.get_num_threads()
    except ImportError:
        info["torch_num_threads"] = None
    git = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=False)
    info["git_commit"] = git.stdout.strip() if git.returncode == 0 else None
    return info


# -- report -------------------------------------------------------------------------------------------


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def ratios(fe: dict, tf: dict) -> dict[str, dict[str, float | None]]:
    """Ferrum / transformers per concurrency level: output tok/s, TTFT p50 and TPOT p50."""
    out = {}
    for pf in fe["phases"]:
        pt = next((p for p in tf["phases"] if p["concurrency"] == pf["concurrency"]), None)
        if pt is not None:
            out[str(pf["concurrency"])] = {
                "tok_per_s_ratio": _ratio(pf["output_throughput"], pt["output_throughput"]),
                "ttft_p50_ratio": _ratio(pf["ttft_ms"]["median"], pt["ttft_ms"]["median"]),
                "tpot_p50_ratio": _ratio(pf["tpot_ms"]["median"], pt["tpot_ms"]["median"]),
            }
    return out


def answer_agreement(fe: dict, tf: dict) -> dict:
    """How many prompts got the same greedy answer from both servers."""
    common = sorted(set(fe.get("answers", {})) & set(tf.get("answers", {})), key=int)
    same = [k for k in common if fe["answers"][k].strip() == tf["answers"][k].strip()]
    return {
        "compared": len(common),
        "identical": len(same),
        "differing_prompts": [int(k) for k in common if k not in same],
    }


def print_table(report: dict) -> None:
    header = (
        f"{'server':<13} {'conc':>4} {'reqs':>5} {'err':>3} {'out tok':>7} {'tok src':>7} {'wall s':>7} "
        f"{'tok/s':>7} {'TTFT mean':>9} {'TTFT p50':>8} {'TTFT p99':>8} {'TPOT mean':>9} {'TPOT p50':>8} {'others':>6}"
    )
    print("\n" + header)
    print("-" * len(header))
    for s in report["servers"]:
        for p in s.get("phases", []):
            source = "+".join(p["output_token_sources"]) or "none"
            print(
                f"{s['name']:<13} {p['concurrency']:>4} {p['num_requests']:>5} {p['failed']:>3} "
                f"{p['total_output_tokens']:>7} {source:>7} {p['duration_s']:>7.2f} {p['output_throughput']:>7.1f} "
                f"{fmt(p['ttft_ms']['mean']):>9} {fmt(p['ttft_ms']['median']):>8} {fmt(p['ttft_ms']['p99']):>8} "
                f"{fmt(p['tpot_ms']['mean']):>9} {fmt(p['tpot_ms']['median']):>8} "
                f"{fmt(p['cpu']['other_cpu_pct'], '.0f') + '%':>6}{' !' if p.get('contended') else ''}"
            )
    print(
        "(TTFT/TPOT in ms; tok src: where output token counts came from; others: CPU share taken by other "
        f"processes during the phase, of all {os.cpu_count()} CPUs; '!': above --quiet-threshold, unreliable)"
    )
    print()
    for s in report["servers"]:
        extra = f", first request (warm-up) {s['warmup_s']:.2f}s" if "warmup_s" in s else ""
        if s.get("cpu_during_start"):
            extra += f" (others {fmt(s['cpu_during_start']['other_cpu_pct'], '.0f')}% CPU during start)"
        if s.get("peak_rss_mb"):
            extra += f", server peak RSS {s['peak_rss_mb']:.0f} MB"
        ready = f"{s['ready_s']:.2f}s" if "ready_s" in s else "n/a"
        print(
            f"time to ready  {s['name']:<13} {ready}{extra}"
            + (f"  [ERROR: {s['error'].splitlines()[0]}]" if "error" in s else "")
        )
    for c, r in report.get("ratios", {}).items():
        print(
            f"ferrum/transformers tok/s at c={c}: {fmt(r['tok_per_s_ratio'], '.2f')}x "
            f"(TTFT p50 ratio {fmt(r['ttft_p50_ratio'], '.2f')}, TPOT p50 ratio {fmt(r['tpot_p50_ratio'], '.2f')})"
        )
    if "answer_agreement" in report:
        a = report["answer_agreement"]
        print(f"identical greedy answers, ferrum vs transformers: {a['identical']}/{a['compared']} prompts")


# -- main ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct", help="HF model folder")
    ap.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 8], help="most requests in flight, per phase"
    )
    ap.add_argument(
        "--requests-per-level",
        type=int,
        nargs="+",
        default=None,
        metavar="N",
        help="requests of each phase, one per --concurrency value (default: 8 at c=1, else 4 per slot)",
    )
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="dtype for both servers (default: bfloat16, the checkpoint's own dtype)",
    )
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument(
        "--also-ferrum",
        action="append",
        default=[],
        metavar="NAME=CHECKOUT",
        help="also measure the Ferrum of another checkout (its root; run from there), as server ferrum-NAME",
    )
    ap.add_argument("--skip-ferrum", action="store_true")
    ap.add_argument(
        "--ferrum-args",
        default="",
        help='extra args for `ferrum serve`, one string (use =): --ferrum-args="--max-num-seqs 16"',
    )
    ap.add_argument(
        "--transformers-args",
        default="",
        help="extra args for `transformers serve`, one string (use =); they come last, so they win",
    )
    ap.add_argument(
        "--kv-cache-gb",
        type=float,
        default=2.0,
        help="KV cache budget for both servers: Ferrum --kv-cache-memory-gb; transformers "
        "--cb-num-blocks sized to the same bytes (default 2, Ferrum's own cap)",
    )
    ap.add_argument(
        "--max-batch-tokens",
        type=int,
        default=1024,
        help="transformers --cb-max-batch-tokens (default 1024 = Ferrum's max_num_batched_tokens)",
    )
    ap.add_argument(
        "--transformers-cb-defaults",
        action="store_true",
        help="let transformers size its CB cache itself (on CPU: 60%% of RAM, ~11 GB RSS here)",
    )
    ap.add_argument("--port-base", type=int, default=18700, help="ferrum on this port, transformers on +1")
    ap.add_argument("--served-model-name", default=None, help="Ferrum's model id (default: folder name)")
    ap.add_argument("--ready-timeout", type=float, default=300.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument(
        "--quiet-wait",
        type=float,
        default=120.0,
        help="before starting each server, wait up to this many seconds for other processes to use "
        "under --quiet-threshold of the CPUs (0: don't wait)",
    )
    ap.add_argument(
        "--quiet-threshold",
        type=float,
        default=15.0,
        help="percent of all CPUs used by other processes above which a phase is flagged",
    )
    ap.add_argument(
        "--contention-retries",
        type=int,
        default=2,
        help="re-run a phase (after waiting for quiet) this many times when others took more than "
        "--quiet-threshold of the CPUs during it; the discarded runs stay in the JSON",
    )
    ap.add_argument("--out", default="bench-results/serve.json")
    args = ap.parse_args(argv)
    if min(args.concurrency) < 1:
        ap.error("--concurrency values must be at least 1")
    if args.requests_per_level is not None and (
        len(args.requests_per_level) != len(args.concurrency) or min(args.requests_per_level) < 1
    ):
        ap.error("--requests-per-level needs one count >= 1 per --concurrency value")
    return args


def ferrum_command(args: argparse.Namespace, model_dir: Path, served_name: str, port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "ferrum.cli",
        "serve",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--backend",
        "cpu",
        "--dtype",
        args.dtype,
        "--served-model-name",
        served_name,
        "--kv-cache-memory-gb",
        str(args.kv_cache_gb),
        "--log-level",
        "warning",
        *shlex.split(args.ferrum_args),
    ]


def transformers_command(
    args: argparse.Namespace, model_dir: Path, cb_num_blocks: int, port: int
) -> list[str]:
    exe = Path(sys.executable).with_name("transformers")
    cmd = [
        str(exe) if exe.exists() else "transformers",
        "serve",
        str(model_dir),
        "--continuous-batching",
        "--device",
        "cpu",
        "--dtype",
        args.dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    if not args.transformers_cb_defaults:
        cmd += ["--cb-num-blocks", str(cb_num_blocks), "--cb-max-batch-tokens", str(args.max_batch_tokens)]
    return cmd + shlex.split(args.transformers_args)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    ServerProcess.ready_timeout = args.ready_timeout

    model_dir = Path(args.model)
    if not model_dir.is_absolute():
        model_dir = (Path.cwd() / model_dir).resolve()
    if not (model_dir / "config.json").is_file():
        print(
            f"bench_serve: {model_dir} has no config.json (`make model` prepares the demo model)",
            file=sys.stderr,
        )
        return 2
    cpu = cpu_info()
    print(f"CPU: {cpu['model']} ({os.cpu_count()} CPUs)")
    print(f"CPU flags (SIMD): {' '.join(simd_flags(cpu['flags'])) or 'none found'}", flush=True)
    served_name = args.served_model_name or model_dir.name
    cb_num_blocks = transformers_num_blocks(model_dir, args.kv_cache_gb, 2 if args.dtype == "bfloat16" else 4)
    out_path = Path(args.out)
    log_dir = out_path.parent / "logs"
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")

    env = dict(os.environ)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONUNBUFFERED="1")

    report: dict = {
        "meta": {
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "command": shlex.join([sys.executable, *sys.argv]),
            "cwd": str(Path.cwd()),
            "cpu_count": os.cpu_count(),
            "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "cpu_model": cpu["model"],
            "cpu_flags": cpu["flags"],
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            **versions(),
        },
        "workload": {
            "model": str(model_dir),
            "dtype": args.dtype,
            "endpoint": "/v1/chat/completions",
            "prompts": list(PROMPTS),
            "temperature": 0,
            "max_tokens": args.max_tokens,
            "ignore_eos": False,
            "stream": True,
            "stream_options": {"include_usage": True},
            "concurrency": args.concurrency,
            "requests_per_level": phase_sizes(args),
            "warmup_requests": 1,
            "kv_cache_gb": None if args.transformers_cb_defaults else args.kv_cache_gb,
            "transformers_cb_num_blocks": None if args.transformers_cb_defaults else cb_num_blocks,
            "transformers_cb_max_batch_tokens": None
            if args.transformers_cb_defaults
            else args.max_batch_tokens,
        },
        "servers": [],
    }

    try:
        if not args.skip_ferrum:
            port = args.port_base
            server = ServerProcess(
                "ferrum",
                ferrum_command(args, model_dir, served_name, port),
                env,
                log_dir / f"ferrum-{stamp}.log",
                f"http://127.0.0.1:{port}",
                "/ready",  # /health answers before the model is loaded
            )
            report["servers"].append(bench_server("ferrum", server, served_name, args))
        for other in args.also_ferrum:
            name, _, checkout = other.partition("=")
            root = Path(checkout).resolve()
            port = args.port_base + 2
            server = ServerProcess(
                f"ferrum-{name}",
                ferrum_command(args, model_dir, served_name, port),
                {**env, "PYTHONPATH": str(root)},
                log_dir / f"ferrum-{name}-{stamp}.log",
                f"http://127.0.0.1:{port}",
                "/ready",  # /health answers before the model is loaded
                cwd=root,
            )
            report["servers"].append(bench_server(f"ferrum-{name}", server, served_name, args))
        if not args.skip_transformers:
            port = args.port_base + 1
            server = ServerProcess(
                "transformers",
                transformers_command(args, model_dir, cb_num_blocks, port),
                env,
                log_dir / f"transformers-{stamp}.log",
                f"http://127.0.0.1:{port}",
                "/health",
            )
            # transformers serve pins the preloaded model: requests must name it exactly as given.
            report["servers"].append(
                bench_server("transformers", server, str(model_dir), args, check_log=transformers_cb_check)
            )
    finally:
        _kill_all_live()

    by_name = {s["name"]: s for s in report["servers"]}
    fe, tf = by_name.get("ferrum"), by_name.get("transformers")
    if fe and tf and fe.get("phases") and tf.get("phases"):
        report["ratios"] = ratios(fe, tf)
        report["answer_agreement"] = answer_agreement(fe, tf)

    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"\nJSON: {out_path}")
    return 1 if any("error" in s for s in report["servers"]) else 0


if __name__ == "__main__":
    sys.exit(main())
