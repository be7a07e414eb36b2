#!/usr/bin/env python
"""Serving benchmark: Ferrum vs `transformers serve --continuous-batching` on the same model folder.

Not a test. Starts one server at a time (Ferrum first, then transformers serve), measures its time to
ready, sends one warm-up request, then runs the same streaming chat workload over the OpenAI HTTP API at
each concurrency level, stops the server, and moves on. Prints a table and writes JSON.

    python scripts/bench_serve.py --model models/SmolLM2-135M-Instruct            # both servers
    python scripts/bench_serve.py --concurrency 1 8 --requests-per-worker 4       # shorter
    python scripts/bench_serve.py --skip-transformers --ferrum-args="--max-num-seqs 16"   # note the =

Workload: a fixed list of 16 short chat prompts, temperature 0, `max_tokens` (default 64), streaming,
`stream_options.include_usage`. No ignore_eos: answers end where the model stops, so output tokens are
counted, not assumed: from the `usage` a server reports in its stream (both servers here do; transformers
serve sends it on the final chunk even though it ignores `stream_options`), else from the number of content
chunks; the JSON and the table say which was used. Concurrency N means N client workers, each sending its
requests back to back; prompts are handed out round-robin over all requests of a phase.

Metrics per phase: output tok/s = all output tokens / wall time of the phase; TTFT = time to the first
non-empty content delta; TPOT = (e2e - TTFT) / (output tokens - 1), for requests with > 1 token. Time to
ready: from process spawn to the first 200 on the health endpoint (GET /health on both servers; both load
the model before they start listening).

Both servers get the same dtype (--dtype, default bfloat16: the checkpoint's own, which transformers'
`auto` keeps and Ferrum's CPU `auto` picks where the CPU has bf16 matmul units) and the same KV cache
budget (--kv-cache-gb, default 2 GiB, Ferrum's own cap).
Ferrum: python -m ferrum.cli serve --model ABS_MODEL_PATH --backend cpu --dtype DTYPE \
            --kv-cache-memory-gb 2.0 --served-model-name NAME --host 127.0.0.1 --port P
transformers (with HF_HUB_OFFLINE=1):
        transformers serve ABS_MODEL_PATH --continuous-batching --device cpu --dtype DTYPE \
            --cb-num-blocks 182 --cb-max-batch-tokens 1024 --host 127.0.0.1 --port P+1
  - the positional model preloads and pins the model before the server listens, so /health means loaded,
    and requests must name that exact string as `model`;
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
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent

PROMPTS = [
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
]


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
        self, name: str, cmd: list[str], env: dict[str, str], log_path: Path, base_url: str, health_path: str
    ):
        self.name, self.cmd, self.env, self.log_path = name, cmd, env, log_path
        self.base_url, self.health_path = base_url, health_path
        self.proc: subprocess.Popen | None = None
        self._log = None

    def start(self) -> float:
        """Spawn and wait for the first 200 on the health endpoint; returns seconds from spawn to ready."""
        import httpx

        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - open for the server's lifetime
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.cmd,
            env=self.env,
            cwd=ROOT,
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


# -- client -------------------------------------------------------------------------------------------


@dataclass
class RequestResult:
    prompt_idx: int
    ok: bool
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    tokens: int = 0
    token_source: str | None = None  # "usage" | "chunks"
    content_chunks: int = 0
    finish_reason: str | None = None
    text: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.tokens < 2 or self.ttft is None or self.e2e is None:
            return None
        return (self.e2e - self.ttft) / (self.tokens - 1)


async def stream_chat(
    session: aiohttp.ClientSession, url: str, model: str, prompt_idx: int, max_tokens: int
) -> RequestResult:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": PROMPTS[prompt_idx]}],
        "temperature": 0,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = RequestResult(prompt_idx=prompt_idx, ok=False)
    pieces: list[str] = []
    usage_tokens: int | None = None
    t0 = time.perf_counter()
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            buf = b""
            done = False
            async for data in resp.content.iter_any():
                buf += data
                while b"\n" in buf:
                    raw, buf = buf.split(b"\n", 1)
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        done = True
                        break
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        res.error = f"stream error: {chunk['error']}"
                        return res
                    for choice in chunk.get("choices") or []:
                        content = (choice.get("delta") or {}).get("content")
                        if content:
                            if res.ttft is None:
                                res.ttft = time.perf_counter() - t0
                            res.content_chunks += 1
                            pieces.append(content)
                        if choice.get("finish_reason"):
                            res.finish_reason = choice["finish_reason"]
                    usage = chunk.get("usage")
                    if usage and usage.get("completion_tokens") is not None:
                        usage_tokens = int(usage["completion_tokens"])
                if done:
                    break
        res.e2e = time.perf_counter() - t0
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
        return res
    res.text = "".join(pieces)
    if usage_tokens is not None:
        res.tokens, res.token_source = usage_tokens, "usage"
    else:
        res.tokens, res.token_source = res.content_chunks, "chunks"
    if res.ttft is None:  # no content at all (e.g. immediate EOS): TTFT undefined, count as done
        res.ttft = res.e2e
    res.ok = True
    return res


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000.0, 2)


@dataclass
class PhaseResult:
    concurrency: int
    requests: int
    ok: int
    errors: int
    output_tokens: int
    wall_s: float
    tok_per_s: float
    req_per_s: float
    ttft_ms: dict
    tpot_ms: dict
    e2e_ms: dict
    token_source: str
    finish_reasons: dict
    first_errors: list[str] = field(default_factory=list)


async def run_phase(
    url: str, model: str, concurrency: int, requests_per_worker: int, max_tokens: int, timeout_s: float
) -> tuple[PhaseResult, list[RequestResult]]:
    total = concurrency * requests_per_worker
    next_idx = 0
    results: list[RequestResult] = []

    timeout = aiohttp.ClientTimeout(total=timeout_s)
    connector = aiohttp.TCPConnector(limit=concurrency + 2)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def worker() -> None:
            nonlocal next_idx
            for _ in range(requests_per_worker):
                i = next_idx
                next_idx += 1
                results.append(await stream_chat(session, url, model, i % len(PROMPTS), max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0

    ok = [r for r in results if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    tpot = [r.tpot for r in ok if r.tpot is not None]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    out_tokens = sum(r.tokens for r in ok)
    sources = sorted({r.token_source for r in ok if r.token_source})
    reasons: dict[str, int] = {}
    for r in ok:
        reasons[str(r.finish_reason)] = reasons.get(str(r.finish_reason), 0) + 1

    def summary(xs: list[float]) -> dict:
        return {
            "mean": _ms(statistics.fmean(xs)) if xs else None,
            "p50": _ms(percentile(xs, 50)),
            "p90": _ms(percentile(xs, 90)),
            "p99": _ms(percentile(xs, 99)),
            "n": len(xs),
        }

    phase = PhaseResult(
        concurrency=concurrency,
        requests=total,
        ok=len(ok),
        errors=total - len(ok),
        output_tokens=out_tokens,
        wall_s=round(wall, 3),
        tok_per_s=round(out_tokens / wall, 2) if wall > 0 else 0.0,
        req_per_s=round(len(ok) / wall, 3) if wall > 0 else 0.0,
        ttft_ms=summary(ttft),
        tpot_ms=summary(tpot),
        e2e_ms=summary(e2e),
        token_source="+".join(sources) or "none",
        finish_reasons=reasons,
        first_errors=[r.error for r in results if not r.ok][:3],
    )
    return phase, results


# -- orchestration ------------------------------------------------------------------------------------


def requests_per_worker_for(concurrency: int, flag: int | None) -> int:
    # Default: 8 requests at c=1, 4 per worker above that (32 at c=8).
    if flag is not None:
        return flag
    return max(4, 8 // concurrency)


def kv_bytes_per_token(model_dir: Path, dtype_bytes: int = 4) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * dtype_bytes


def transformers_num_blocks(model_dir: Path, kv_cache_gb: float, dtype_bytes: int, page_size: int = 256) -> int:
    """transformers' --cb-num-blocks counts whole-model blocks of `page_size` (256) tokens: size it to the same
    float32 KV bytes as Ferrum's --kv-cache-memory-gb."""
    return max(1, int(kv_cache_gb * 1024**3 // (page_size * kv_bytes_per_token(model_dir, dtype_bytes))))


def bench_server(
    name: str, server: ServerProcess, chat_url: str, model_field: str, args, check_log=None
) -> dict:
    out: dict = {"name": name, "cmd": shlex.join(server.cmd), "log": str(server.log_path)}
    print(f"\n== {name}: {out['cmd']}", flush=True)
    out["loadavg_1m_before_start"] = round(os.getloadavg()[0], 2)
    if args.quiet_wait > 0:
        out["other_cpu_pct_before_start"] = wait_for_quiet(args.quiet_wait, args.quiet_threshold)
    try:
        meter = CpuMeter(None)
        ready = server.start()
        out["ready_s"] = round(ready, 3)
        out["cpu_during_start"] = meter.read(spawned_pgid=server.proc.pid)
        print(f"   ready in {ready:.2f}s", flush=True)

        async def warm() -> RequestResult:
            timeout = aiohttp.ClientTimeout(total=args.request_timeout)
            async with aiohttp.ClientSession(timeout=timeout) as session:
                return await stream_chat(session, chat_url, model_field, 0, args.max_tokens)

        t0 = time.perf_counter()
        w = asyncio.run(warm())
        out["warmup_s"] = round(time.perf_counter() - t0, 3)
        if not w.ok:
            raise ServerError(f"warm-up request failed: {w.error}")
        print(
            f"   warm-up {out['warmup_s']:.2f}s, {w.tokens} tokens ({w.token_source}): {w.text[:80]!r}",
            flush=True,
        )

        phases = []
        answers: dict[int, str] = {}
        for c in args.concurrency:
            rpw = requests_per_worker_for(c, args.requests_per_worker)
            discarded = []
            for attempt in range(args.contention_retries + 1):
                if attempt:
                    print(f"   re-running c={c} (attempt {attempt + 1})", flush=True)
                    if args.quiet_wait > 0:
                        wait_for_quiet(args.quiet_wait, args.quiet_threshold)
                load_before = os.getloadavg()[0]
                meter = CpuMeter(server.proc.pid)
                phase, results = asyncio.run(
                    run_phase(chat_url, model_field, c, rpw, args.max_tokens, args.request_timeout)
                )
                cpu = meter.read()
                # CPU shares during the phase (100% = all CPUs) and the 1-minute load average: a phase where other
                # processes took a real share of the CPUs measured the machine, not the server.
                record = {
                    **asdict(phase),
                    "cpu": cpu,
                    "loadavg_1m": {"before": round(load_before, 2), "after": round(os.getloadavg()[0], 2)},
                }
                print(
                    f"   c={c}: {phase.ok}/{phase.requests} ok, {phase.output_tokens} tok in {phase.wall_s:.2f}s "
                    f"= {phase.tok_per_s:.1f} tok/s, TTFT p50 {phase.ttft_ms['p50']} ms, "
                    f"TPOT p50 {phase.tpot_ms['p50']} ms; CPU server {cpu['server_cpu_pct']}% "
                    f"others {cpu['other_cpu_pct']}%",
                    flush=True,
                )
                if phase.errors:
                    print(f"   errors: {phase.first_errors}", flush=True)
                contended = (cpu["other_cpu_pct"] or 0) > args.quiet_threshold
                record["contended"] = contended
                if contended:
                    print(
                        f"   WARNING: other processes took {cpu['other_cpu_pct']}% of the CPUs during this "
                        "phase: its numbers are not reliable",
                        flush=True,
                    )
                    if attempt < args.contention_retries:
                        discarded.append(record)
                        continue
                break
            record["discarded_contended_attempts"] = discarded
            phases.append(record)
            for r in results:
                if r.ok and r.prompt_idx not in answers:
                    answers[r.prompt_idx] = r.text
        out["phases"] = phases
        out["answers"] = {str(k): v for k, v in sorted(answers.items())}
        out["peak_rss_mb"] = server.group_peak_rss_mb()
        if check_log is not None:
            out.update(check_log(server))
    except ServerError as exc:
        out["error"] = str(exc)
        print(f"   FAILED: {exc}", file=sys.stderr, flush=True)
    finally:
        t0 = time.perf_counter()
        server.stop()
        out["stop_s"] = round(time.perf_counter() - t0, 2)
        if server.proc is not None:
            out["exit_code"] = server.proc.returncode
    return out


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


def fmt(x, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(report: dict) -> None:
    header = (
        f"{'server':<13} {'conc':>4} {'reqs':>5} {'err':>3} {'out tok':>7} {'tok src':>7} {'wall s':>7} "
        f"{'tok/s':>7} {'TTFT mean':>9} {'TTFT p50':>8} {'TTFT p99':>8} {'TPOT mean':>9} {'TPOT p50':>8} {'others':>6}"
    )
    print("\n" + header)
    print("-" * len(header))
    for s in report["servers"]:
        for p in s.get("phases", []):
            print(
                f"{s['name']:<13} {p['concurrency']:>4} {p['requests']:>5} {p['errors']:>3} "
                f"{p['output_tokens']:>7} {p['token_source']:>7} {p['wall_s']:>7.2f} {p['tok_per_s']:>7.1f} "
                f"{fmt(p['ttft_ms']['mean']):>9} {fmt(p['ttft_ms']['p50']):>8} {fmt(p['ttft_ms']['p99']):>8} "
                f"{fmt(p['tpot_ms']['mean']):>9} {fmt(p['tpot_ms']['p50']):>8} "
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
            f"ferrum/transformers tok/s at c={c}: {r['tok_per_s_ratio']:.2f}x "
            f"(TTFT p50 ratio {fmt(r['ttft_p50_ratio'], '.2f')}, TPOT p50 ratio {fmt(r['tpot_p50_ratio'], '.2f')})"
        )
    if "answer_agreement" in report:
        a = report["answer_agreement"]
        print(f"identical greedy answers, ferrum vs transformers: {a['identical']}/{a['compared']} prompts")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct", help="HF model folder")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8], help="client workers per phase")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="dtype for both servers (default: bfloat16, the checkpoint's own dtype)",
    )
    ap.add_argument(
        "--requests-per-worker",
        type=int,
        default=None,
        help="requests each worker sends back to back (default: 8 at c=1, else 4)",
    )
    ap.add_argument("--skip-transformers", action="store_true")
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
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            **versions(),
        },
        "workload": {
            "model": str(model_dir),
            "dtype": args.dtype,
            "prompts": PROMPTS,
            "temperature": 0,
            "max_tokens": args.max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
            "concurrency": args.concurrency,
            "requests_per_worker": {
                str(c): requests_per_worker_for(c, args.requests_per_worker) for c in args.concurrency
            },
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
            cmd = [
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
            base = f"http://127.0.0.1:{port}"
            server = ServerProcess("ferrum", cmd, env, log_dir / f"ferrum-{stamp}.log", base, "/health")
            report["servers"].append(
                bench_server("ferrum", server, base + "/v1/chat/completions", served_name, args)
            )

        if not args.skip_transformers:
            port = args.port_base + 1
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
                cmd += [
                    "--cb-num-blocks",
                    str(cb_num_blocks),
                    "--cb-max-batch-tokens",
                    str(args.max_batch_tokens),
                ]
            cmd += shlex.split(args.transformers_args)
            base = f"http://127.0.0.1:{port}"
            server = ServerProcess(
                "transformers", cmd, env, log_dir / f"transformers-{stamp}.log", base, "/health"
            )
            # transformers serve pins the preloaded model: requests must name it exactly as given.
            report["servers"].append(
                bench_server(
                    "transformers",
                    server,
                    base + "/v1/chat/completions",
                    str(model_dir),
                    args,
                    check_log=transformers_cb_check,
                )
            )
    finally:
        _kill_all_live()

    by_name = {s["name"]: s for s in report["servers"]}
    fe, tf = by_name.get("ferrum"), by_name.get("transformers")
    if fe and tf and fe.get("phases") and tf.get("phases"):
        ratios = {}
        for pf in fe["phases"]:
            pt = next((p for p in tf["phases"] if p["concurrency"] == pf["concurrency"]), None)
            if pt is None:
                continue

            def ratio(a, b):
                return round(a / b, 3) if a is not None and b else None

            ratios[str(pf["concurrency"])] = {
                "tok_per_s_ratio": ratio(pf["tok_per_s"], pt["tok_per_s"]),
                "ttft_p50_ratio": ratio(pf["ttft_ms"]["p50"], pt["ttft_ms"]["p50"]),
                "tpot_p50_ratio": ratio(pf["tpot_ms"]["p50"], pt["tpot_ms"]["p50"]),
            }
        report["ratios"] = ratios
        common = sorted(set(fe.get("answers", {})) & set(tf.get("answers", {})), key=int)
        same = [k for k in common if fe["answers"][k].strip() == tf["answers"][k].strip()]
        report["answer_agreement"] = {
            "compared": len(common),
            "identical": len(same),
            "differing_prompts": [int(k) for k in common if k not in same],
        }

    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(report, indent=2) + "\n")
    print_table(report)
    print(f"\nJSON: {out_path}")
    return 1 if any("error" in s for s in report["servers"]) else 0


if __name__ == "__main__":
    sys.exit(main())
