#!/usr/bin/env python
"""The CPU race: llama.cpp's `llama-server` on a GGUF file against Ferrum on the same file and on the
converted bf16 folder, one workload, one run (issue 25's race; issue 24's first data point).

    python scripts/cpu_race.py --gguf models/SmolLM2-135M-Instruct.Q4_1.gguf \
        --llama-server /tmp/llama-build/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-server \
        --out bench-results/cpu-race

Not a test. Prints the CPU (lscpu: model and SIMD flags) first, waits until the machine is quiet (the
1-minute load average under --max-load, polled every --poll-s seconds for up to --max-wait-s), then, for
each of --passes passes, starts each server in turn, alone, on 127.0.0.1:
  llama-server  LLAMA_SERVER -m GGUF -t 2 -np 8 -c 8192                (--llama-threads/-parallel/-ctx)
  ferrum-gguf   python -m ferrum.cli serve --model GGUF --backend cpu   (its defaults otherwise)
  ferrum-bf16   python -m ferrum.cli serve --model FOLDER --backend cpu
sends one untimed warm-up request, measures concurrency 1 then 8, and stops it. Writes OUT/race.json
(everything, answers included) and OUT/race.md (the table), server logs under OUT/logs.

Workload (issue 25): 16 streaming chat requests per concurrency level, each prompt 40-120 words drawn
(with replacement) from the common English words below, then "Write a long story about the words
above."; temperature 0, max_tokens 64, `ignore_eos: true` (a top-level body field, which llama-server
and Ferrum both take), so every answer runs to 64 tokens (checked: the table flags any that did not).
The prompts come from --seed: the same for every server and pass; each concurrency level has its own
16, so that the second level finds no whole prompt of the first in a server's prompt cache (each server
is restarted every pass). Requests and metrics are `ferrum bench serve`'s (ferrum.bench.client.send and
ferrum.bench.metrics.summarize), each request on a new connection (llama-server drops some reused ones):
output tok/s = output tokens / wall time of the level; TTFT = time to the first content delta;
TPOT = (e2e - TTFT) / (output tokens - 1). Server processes, CPU accounting and the quiet wait between
servers are scripts/bench_serve.py's.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_serve import (  # noqa: E402
    CpuMeter,
    ServerError,
    ServerProcess,
    _kill_all_live,
    _on_signal,
    cpu_info,
    fmt,
    simd_flags,
    versions,
    wait_for_quiet,
)

from ferrum.bench.client import Target, send  # noqa: E402
from ferrum.bench.errors import BenchError  # noqa: E402
from ferrum.bench.metrics import RequestRecord, summarize  # noqa: E402
from ferrum.bench.report import level_json  # noqa: E402
from ferrum.bench.serve import LevelRun  # noqa: E402
from ferrum.bench.workload import WARMUP_TEXT, BenchRequest, LengthRange  # noqa: E402

INSTRUCTION = "Write a long story about the words above."

WORDS = tuple(dict.fromkeys(
    """
    time year people way day man thing woman life child world school state family student group country
    problem hand part place case week company system program question work government number night point
    home water room mother area money story fact month lot right study book eye job word business issue
    side kind head house service friend father power hour game line end member law car city community name
    president team minute idea kid body information back parent face others level office door health person
    art war history party result change morning reason research girl guy moment air teacher force education
    foot boy age policy music market sense nation plan college interest death experience effect class
    control care field development role effort rate heart drug show leader light voice wife police mind
    price report decision son view relationship town road arm difference value building action model season
    society tax director position player record paper space ground form event official matter center couple
    site project activity star table need court oil situation cost industry figure street image phone data
    picture practice piece land product doctor wall patient worker news test movie north love support
    technology step baby computer type attention film tree source organization hair window evidence
    population truth garden river bird forest mountain ocean island bridge village castle dragon king queen
    horse dog cat fish apple bread cheese coffee tea sugar salt rain snow wind sun moon cloud storm fire stone
    gold silver ship train plane letter song dance dream secret journey gift key map clock candle lamp mirror
    shadow winter summer spring autumn flower grass farm market kitchen bottle box bag shoe hat coat
    """.split()
))

_CHAT_LEVELS = 2  # random streams of the seed: one per concurrency level, so levels share no prompt


def race_prompts(seed: int, level: int, count: int, words: LengthRange) -> tuple[str, ...]:
    """`count` prompts of `words.low`..`words.high` random common words each, then INSTRUCTION; the same
    (seed, level) always gives the same prompts."""
    rng = np.random.default_rng([seed, _CHAT_LEVELS, level])
    vocabulary = np.asarray(WORDS)
    prompts = []
    for _ in range(count):
        n = int(rng.integers(words.low, words.high, endpoint=True))
        prompts.append(" ".join(rng.choice(vocabulary, size=n, replace=True)) + "\n" + INSTRUCTION)
    return tuple(prompts)


# -- the machine -------------------------------------------------------------------------------------


def lscpu() -> dict[str, Any]:
    """lscpu's fields (model name, flags, ...), else /proc/cpuinfo's model and flags."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        info = cpu_info()
        return {"Model name": info["model"], "Flags": " ".join(info["flags"])}
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if value:
            fields[key.strip()] = value.strip()
    return fields


def wait_for_low_load(max_load: float, poll_s: float, max_wait_s: float) -> dict[str, Any]:
    """Waits until the 1-minute load average is under `max_load`, polling every `poll_s` for up to
    `max_wait_s`; what it saw."""
    t0 = time.monotonic()
    while True:
        load = os.getloadavg()[0]
        waited = time.monotonic() - t0
        if load < max_load:
            print(f"load average {load:.2f} < {max_load} after {waited:.0f}s: starting", flush=True)
            return {"load_1m": round(load, 2), "waited_s": round(waited), "quiet": True}
        if waited >= max_wait_s:
            print(f"load average still {load:.2f} after {waited:.0f}s: starting anyway", flush=True)
            return {"load_1m": round(load, 2), "waited_s": round(waited), "quiet": False}
        print(f"load average {load:.2f} >= {max_load}: waiting ({waited:.0f}s so far)", flush=True)
        time.sleep(poll_s)


def llama_version(exe: str) -> str | None:
    try:
        done = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.startswith(("version", "built"))]
    return "; ".join(lines) or None


# -- servers -----------------------------------------------------------------------------------------


def server_commands(args: argparse.Namespace, gguf: Path, folder: Path) -> dict[str, tuple[list[str], str]]:
    """Each server's command line and health path, by name, in race order."""
    host = ["--host", "127.0.0.1"]
    ferrum = [sys.executable, "-m", "ferrum.cli", "serve", "--backend", "cpu", *host, *shlex.split(args.ferrum_args)]
    llama = [
        args.llama_server, "-m", str(gguf), "-t", str(args.llama_threads), "-np", str(args.llama_parallel),
        "-c", str(args.llama_ctx), *host, *shlex.split(args.llama_args),
    ]
    return {
        "llama-server": (llama, "/health"),
        "ferrum-gguf": ([*ferrum, "--model", str(gguf)], "/ready"),  # /health answers before the model loads
        "ferrum-bf16": ([*ferrum, "--model", str(folder)], "/ready"),
    }


async def _served_model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/v1/models") as response:
        if response.status != 200:
            raise BenchError(f"GET {url}/v1/models answered HTTP {response.status}")
        return str((await response.json())["data"][0]["id"])


async def _level(url: str, prompts: tuple[str, ...], concurrency: int, args: argparse.Namespace,
                 warmup: bool) -> LevelRun:
    # A new connection per request: llama-server drops some kept-alive connections after a streamed
    # answer ("Can not write request body" on reuse), so no server gets reused connections.
    connector = aiohttp.TCPConnector(limit=concurrency, force_close=True)
    timeout = aiohttp.ClientTimeout(total=args.request_timeout, sock_connect=30)
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        target = Target(url, await _served_model(session, url), ignore_eos=True, endpoint="chat")
        if warmup:
            record = await send(session, target, BenchRequest((), 16, text=WARMUP_TEXT))
            if not record.ok:
                raise BenchError(f"the warm-up request failed: {record.error}")
        slots = asyncio.Semaphore(concurrency)

        async def one(text: str) -> RequestRecord:
            async with slots:
                return await send(session, target, BenchRequest((), args.max_tokens, text=text))

        started = time.perf_counter()
        records = await asyncio.gather(*(one(text) for text in prompts))
        duration = time.perf_counter() - started
    return LevelRun(summarize(records, duration, concurrency), tuple(records))


def run_level(url: str, prompts: tuple[str, ...], concurrency: int, args: argparse.Namespace,
              warmup: bool) -> LevelRun:
    """One concurrency level, request i asking prompt i (all sent at once, at most `concurrency` in
    flight), after one untimed warm-up request when `warmup`; `ferrum bench serve`'s client and metrics."""
    return asyncio.run(_level(url, prompts, concurrency, args, warmup))


def race_server(name: str, server: ServerProcess, levels: list[tuple[int, tuple[str, ...]]],
                args: argparse.Namespace) -> dict[str, Any]:
    """Starts `server`, measures every level (the first after a warm-up request), stops it."""
    out: dict[str, Any] = {"name": name, "cmd": shlex.join(server.cmd), "log": str(server.log_path)}
    print(f"\n== {name}: {out['cmd']}", flush=True)
    out["other_cpu_pct_before_start"] = wait_for_quiet(args.quiet_wait, args.quiet_threshold)
    try:
        out["ready_s"] = round(server.start(), 3)
        print(f"   ready in {out['ready_s']:.2f}s", flush=True)
        phases = []
        for index, (concurrency, prompts) in enumerate(levels):
            load_before = os.getloadavg()[0]
            meter = CpuMeter(server.pgid)
            run = run_level(server.base_url, prompts, concurrency, args, warmup=index == 0)
            cpu = meter.read()
            short = [i for i, r in enumerate(run.records) if r.ok and r.output_tokens != args.max_tokens]
            phases.append({
                **level_json(run, with_requests=False),
                "cpu": cpu,
                "loadavg_1m_before": round(load_before, 2),
                "answers_not_max_tokens": short,
                "answers": [r.text for r in run.records],
            })
            r = run.result
            print(
                f"   c={concurrency}: {r.completed}/{r.num_requests} ok, {r.total_output_tokens} tok in "
                f"{r.duration_s:.2f}s = {r.output_throughput:.1f} tok/s, TPOT p50 {fmt(r.tpot.median_ms)} ms, "
                f"TTFT p50 {fmt(r.ttft.median_ms)} ms; CPU others {cpu['other_cpu_pct']}%"
                + (f"; {len(short)} answers short of {args.max_tokens} tokens" if short else "")
                + (f"; errors {r.failed}: {r.first_error}" if r.failed else ""),
                flush=True,
            )
        out["phases"] = phases
        out["peak_rss_mb"] = server.group_peak_rss_mb()
    except (ServerError, BenchError) as exc:
        out["error"] = str(exc)
        print(f"   FAILED: {exc}", file=sys.stderr, flush=True)
    finally:
        server.stop()
    return out


# -- report ------------------------------------------------------------------------------------------

LABELS = {
    "llama-server": "llama-server, GGUF",
    "ferrum-gguf": "Ferrum, GGUF",
    "ferrum-bf16": "Ferrum, bf16 folder",
}
BASELINE = "llama-server"


def _phase(runs: list[dict[str, Any]], concurrency: int) -> list[dict[str, Any] | None]:
    """The phase at `concurrency` of each pass's run of one server (None where it failed)."""
    return [next((p for p in run.get("phases", []) if p["concurrency"] == concurrency), None) for run in runs]


def _figures(phases: list[dict[str, Any] | None]) -> dict[str, list[float | None]]:
    def pick(p: dict[str, Any] | None, key: str) -> float | None:
        if p is None:
            return None
        return p["output_throughput"] if key == "tok_s" else p[key]["median"]

    return {key: [pick(p, key) for p in phases] for key in ("tok_s", "tpot_ms", "ttft_ms")}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def summarize_race(results: list[dict[str, Any]], concurrency: list[int]) -> list[dict[str, Any]]:
    """One row per server and concurrency: per-pass tok/s, TPOT p50, TTFT p50, and each one over
    llama-server's of the same pass."""
    by_server: dict[str, list[dict[str, Any]]] = {}
    for run in results:
        by_server.setdefault(run["name"], []).append(run)
    rows = []
    for name, runs in by_server.items():
        for c in concurrency:
            phases = _phase(runs, c)
            row: dict[str, Any] = {"server": name, "concurrency": c, **_figures(phases)}
            row["others_cpu_pct_max"] = max((p["cpu"]["other_cpu_pct"] or 0 for p in phases if p), default=None)
            row["answers_not_max_tokens"] = sum(len(p["answers_not_max_tokens"]) for p in phases if p)
            row["failed"] = sum(p["failed"] for p in phases if p) + sum(p is None for p in phases)
            if name != BASELINE and BASELINE in by_server:
                base = _figures(_phase(by_server[BASELINE], c))
                row["vs_llama_server"] = {
                    key: [_ratio(a, b) for a, b in zip(row[key], base[key], strict=True)] for key in base
                }
            rows.append(row)
    return rows


def _pair(values: list[float | None], spec: str) -> str:
    return " / ".join(fmt(v, spec) for v in values)


def markdown_table(rows: list[dict[str, Any]], passes: int) -> str:
    each = " / ".join(f"pass {i + 1}" for i in range(passes))
    lines = [
        "| server | c | tok/s | TPOT p50 ms | TTFT p50 ms | tok/s ÷ llama | TPOT ÷ llama | TTFT ÷ llama "
        "| others' CPU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratios = row.get("vs_llama_server")
        none = "1" if row["server"] == BASELINE else "-"
        cells = [_pair(ratios[k], ".2f") if ratios else none for k in ("tok_s", "tpot_ms", "ttft_ms")]
        flag = ""
        if row["failed"]:
            flag += f" ({row['failed']} failed)"
        if row["answers_not_max_tokens"]:
            flag += f" ({row['answers_not_max_tokens']} answers short)"
        lines.append(
            f"| {LABELS.get(row['server'], row['server'])}{flag} | {row['concurrency']} | "
            f"{_pair(row['tok_s'], '.1f')} | {_pair(row['tpot_ms'], '.1f')} | {_pair(row['ttft_ms'], '.0f')} | "
            f"{' | '.join(cells)} | {fmt(row['others_cpu_pct_max'], '.0f')}% |"
        )
    lines.append(f"\nEach cell: {each}; ratios pair each pass with llama-server's of the same pass; "
                 "others' CPU: the most any phase saw other processes take, of all CPUs.")
    return "\n".join(lines)


# -- main --------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gguf", required=True, help="the GGUF file both llama-server and Ferrum serve")
    ap.add_argument("--folder", default="models/SmolLM2-135M-Instruct",
                    help="the converted model folder Ferrum also serves ('' to skip)")
    ap.add_argument("--llama-server", required=True, help="the llama-server executable")
    ap.add_argument("--out", required=True, help="folder for race.json, race.md and the server logs")
    ap.add_argument("--servers", default="llama-server,ferrum-gguf,ferrum-bf16",
                    help="which servers, in this order, comma-separated")
    ap.add_argument("--passes", type=int, default=2)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--words", type=LengthRange.parse, default=LengthRange(40, 120),
                    help="words per prompt, LOW:HIGH (default 40:120)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--llama-threads", type=int, default=2, help="llama-server -t")
    ap.add_argument("--llama-parallel", type=int, default=8, help="llama-server -np (slots)")
    ap.add_argument("--llama-ctx", type=int, default=8192, help="llama-server -c (shared by the slots)")
    ap.add_argument("--llama-args", default="", help="more llama-server args, one string (use =)")
    ap.add_argument("--ferrum-args", default="", help="more `ferrum serve` args, one string (use =)")
    ap.add_argument("--port", type=int, default=18810, help="every server listens here, one at a time")
    ap.add_argument("--max-load", type=float, default=0.7, help="start once the 1-minute load average is below")
    ap.add_argument("--poll-s", type=float, default=30.0)
    ap.add_argument("--max-wait-s", type=float, default=2400.0, help="then start anyway, said in the JSON")
    ap.add_argument("--quiet-wait", type=float, default=120.0,
                    help="before each server: wait up to this for others to use under --quiet-threshold")
    ap.add_argument("--quiet-threshold", type=float, default=15.0, help="percent of all CPUs")
    ap.add_argument("--ready-timeout", type=float, default=600.0)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    args = ap.parse_args(argv)
    args.servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    if not args.folder:
        args.servers = [s for s in args.servers if s != "ferrum-bf16"]
    unknown = set(args.servers) - set(LABELS)
    if unknown or not args.servers:
        ap.error(f"--servers: unknown {sorted(unknown)}; choose from {', '.join(LABELS)}")
    if args.passes < 1 or args.requests < 1 or min(args.concurrency) < 1:
        ap.error("--passes, --requests and --concurrency must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    ServerProcess.ready_timeout = args.ready_timeout
    gguf, folder = Path(args.gguf).resolve(), Path(args.folder or ".").resolve()
    if not gguf.is_file():
        print(f"cpu_race: no GGUF file at {gguf} (`make model` keeps the demo model's)", file=sys.stderr)
        return 2
    if "ferrum-bf16" in args.servers and not (folder / "config.json").is_file():
        print(f"cpu_race: {folder} has no config.json (`make model` prepares it)", file=sys.stderr)
        return 2
    if "llama-server" in args.servers and not os.access(args.llama_server, os.X_OK):
        print(f"cpu_race: {args.llama_server} is not an executable", file=sys.stderr)
        return 2

    cpu = lscpu()
    flags = cpu.get("Flags", "").split()
    print(f"CPU: {cpu.get('Model name', '?')}, {cpu.get('CPU(s)', os.cpu_count())} CPUs "
          f"({cpu.get('Thread(s) per core', '?')} thread(s) per core)")
    print(f"CPU flags (SIMD): {' '.join(simd_flags(flags)) or 'none found'}", flush=True)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    levels = [(c, race_prompts(args.seed, i, args.requests, args.words)) for i, c in enumerate(args.concurrency)]
    commands = server_commands(args, gguf, folder)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    report: dict[str, Any] = {
        "meta": {
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "command": shlex.join([sys.executable, *sys.argv]),
            "cpu_model": cpu.get("Model name"),
            "cpu_simd_flags": simd_flags(flags),
            "lscpu": cpu,
            "cpu_affinity": len(os.sched_getaffinity(0)),
            "llama_server": args.llama_server,
            "llama_server_version": llama_version(args.llama_server) if "llama-server" in args.servers else None,
            **versions(),
        },
        "workload": {
            "endpoint": "/v1/chat/completions",
            "gguf": str(gguf),
            "folder": str(folder) if "ferrum-bf16" in args.servers else None,
            "seed": args.seed,
            "words_per_prompt": str(args.words),
            "instruction": INSTRUCTION,
            "temperature": 0,
            "max_tokens": args.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "warmup_requests": 1,
            "levels": [{"concurrency": c, "prompts": list(p)} for c, p in levels],
        },
    }
    print(f"\nwaiting for the 1-minute load average to drop below {args.max_load} (up to {args.max_wait_s:.0f}s)",
          flush=True)
    report["load_wait"] = wait_for_low_load(args.max_load, args.poll_s, args.max_wait_s)

    results = []
    try:
        for pass_index in range(args.passes):
            print(f"\n#### pass {pass_index + 1} of {args.passes}", flush=True)
            for name in args.servers:
                cmd, health = commands[name]
                cmd = [*cmd, "--port", str(args.port)]
                log = out_dir / "logs" / f"{name}-pass{pass_index + 1}-{stamp}.log"
                server = ServerProcess(name, cmd, env, log, f"http://127.0.0.1:{args.port}", health)
                results.append({"pass": pass_index + 1, **race_server(name, server, levels, args)})
    finally:
        _kill_all_live()

    rows = summarize_race(results, args.concurrency)
    table = markdown_table(rows, args.passes)
    report["runs"] = results
    report["summary"] = rows
    (out_dir / "race.json").write_text(json.dumps(report, indent=2) + "\n")
    (out_dir / "race.md").write_text(table + "\n")
    print("\n" + table)
    print(f"\nJSON: {out_dir / 'race.json'}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
