#!/usr/bin/env python
"""The CPU race (issue 25): llama.cpp's `llama-server` on the demo model's Q4_1 GGUF against Ferrum on the
same file and on the converted bf16 folder, and `transformers serve --continuous-batching` on the folder;
two workloads, perplexity, memory and long-context decoding, in one run.

    python scripts/cpu_race.py --out bench-results/cpu-race --llama-cache ~/.cache/ferrum/llama.cpp-build
    python scripts/cpu_race.py --out /tmp/smoke --requests 2 --short-requests 2 2 --long-context 50 400

Not a test. llama.cpp comes from --llama-server (and --llama-perplexity, default: beside it) or is built
once under --llama-cache (scripts/llama_cpp_build.py: cmake on the llama.cpp vendored in the
llama-cpp-python sdist, about 10 minutes on 2 cores the first time). Prints the CPU (lscpu: model and SIMD
flags) first, waits until the machine is quiet (the 1-minute load average under --max-load, polled every
--poll-s seconds for up to --max-wait-s), then, for each of --passes passes (default 1, about 10 minutes on
2 cores), starts each server in turn, alone, on 127.0.0.1:
  llama-server  LLAMA_SERVER -m GGUF -t CPUS -np 8 -c 8192                (--llama-threads/-parallel/-ctx)
  ferrum-gguf   python -m ferrum.cli serve --backend cpu --model GGUF      (its defaults; + --ferrum-args)
  ferrum-bf16   python -m ferrum.cli serve --backend cpu --model FOLDER
  ferrum-NAME   as ferrum-bf16, then the ARGS of each --ferrum-variant NAME=ARGS (last flags win)
  transformers  transformers serve FOLDER --continuous-batching --device cpu --dtype bfloat16
                --cb-num-blocks (2 GiB of KV) --cb-max-batch-tokens 1024   (scripts/bench_serve.py's; offline:
                HF_HUB_OFFLINE=1; --skip-transformers leaves it out)
and measures, on each: its time to ready (spawn to the first 200 on /health, Ferrum's /ready), one untimed
warm-up request, then both workloads at each --concurrency (default 1 and 8), perplexity, the long-context
requests, and its peak RSS (VmHWM summed over its process group) after the workloads and at the end.

Workloads (requests and metrics are `ferrum bench serve`'s: ferrum.bench.client.send and
ferrum.bench.metrics.summarize; streaming chat, temperature 0, a new connection per request since
llama-server drops some reused ones; output tok/s = output tokens / wall time of the level, TTFT = time to
the first content delta, TPOT = (e2e - TTFT) / (output tokens - 1)):
  long   --requests (16) prompts per level of 40-120 words drawn (with replacement) from the common English
         words below, then "Write a long story about the words above."; max_tokens 64 and `ignore_eos: true`
         (transformers serve refuses that field: it gets a generation_config whose eos_token_id is -1,
         which its continuous batching reads as no EOS), so every answer runs to 64 tokens (the table flags
         any that did not). Each level has its own prompts (from --seed), so no level finds another's
         whole prompt in a prompt cache.
  short  `make bench`'s workload (scripts/bench_serve.py, imported): its 16 short fixed prompts, request i
         asking prompt i mod 16, max_tokens 64, EOS honoured; 8 requests at c=1, 4 per slot above
         (--short-requests to change).
Long context: streamed requests alone (c=1, `ignore_eos`, max_tokens 64), one per --long-context size (default
~50 and ~6,000 prompt tokens) in turn, --long-context-rounds times over (default 3; TTFT from the first round,
later rounds finding the prompt cached; TPOT the rounds' median, so that the machine's drift over the minutes
falls on both sizes alike). The prompts: random common words sized with the folder's tokenizer and chat
template; the usage each server reports is what the table shows. Ferrum serves max_model_len = the model's
max_position_embeddings (8192) by default; llama-server's -c 8192 split over -np 8 slots leaves 1,024 tokens
a slot, so its long-context requests go to a second llama-server, -np 1 -c --llama-long-ctx (8192),
started after the first stops (its ready time and RSS are reported apart).
Perplexity (pass 1 only; scripts/race_perplexity.py): the same text (--ppl-text, default
tests/data/perplexity.txt, 690 tokens) cut into chunks of --ppl-ctx (256) tokens, each chunk evaluated alone,
the second half of each chunk scored, exactly as `llama-perplexity -c 256` does: llama-server's row is
`llama-perplexity` on the GGUF, Ferrum's its prompt logprobs through the API (its /tokenize, then
/v1/completions with echo), transformers' the folder's model in-process (bfloat16, the served dtype; float32
in the JSON). Each method's token ids are compared with llama-server's /tokenize of the text.
Writes OUT/race.json (everything, answers included) and OUT/race.md (the tables), logs under OUT/logs.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_serve import (  # noqa: E402
    PROMPTS as BENCH_PROMPTS,
)
from bench_serve import (  # noqa: E402
    CpuMeter,
    ServerError,
    ServerProcess,
    _kill_all_live,
    _on_signal,
    cpu_info,
    fmt,
    requests_for,
    simd_flags,
    transformers_cb_check,
    transformers_command,
    transformers_num_blocks,
    versions,
    wait_for_quiet,
)
from llama_cpp_build import BuildError, LlamaCppBuild, ensure_built  # noqa: E402
from race_perplexity import (  # noqa: E402
    ChunkedPerplexity,
    PerplexityError,
    api_perplexity,
    hf_perplexity_subprocess,
    ids_digest,
    llama_perplexity,
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

# random streams of the seed: the long workload's levels are (seed, 2, level), the long-context prompts
# (seed, 3, size), so that no two share a prompt
_CHAT_LEVELS = 2
_LONG_CONTEXT = 3


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


@dataclass(frozen=True)
class Workload:
    name: str  # long | short
    title: str
    ignore_eos: bool
    levels: tuple[tuple[int, tuple[str, ...]], ...]  # (concurrency, the prompts of its requests in order)


def workloads(args: argparse.Namespace) -> list[Workload]:
    long_levels = tuple(
        (c, race_prompts(args.seed, i, args.requests, args.words)) for i, c in enumerate(args.concurrency)
    )
    sizes = args.short_requests or [requests_for(c) for c in args.concurrency]
    short_levels = tuple(
        (c, tuple(BENCH_PROMPTS[i % len(BENCH_PROMPTS)] for i in range(n)))
        for c, n in zip(args.concurrency, sizes, strict=True)
    )
    return [
        Workload("long", f"{args.words} random words + \"{INSTRUCTION}\", {args.max_tokens} tokens (ignore_eos)",
                 True, long_levels),
        Workload("short", f"`make bench`: {len(BENCH_PROMPTS)} short fixed prompts, max_tokens {args.max_tokens}, "
                 "EOS honoured", False, short_levels),
    ]


@dataclass(frozen=True)
class LongPrompt:
    target: int  # prompt tokens asked for
    tokens: int  # what the folder's tokenizer and chat template make of it
    text: str


def long_context_prompts(folder: Path, sizes: Sequence[int], seed: int) -> list[LongPrompt]:
    """For each size, the most random common words (then INSTRUCTION) whose chat prompt, under the folder's
    tokenizer and template, is at most that many tokens."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)

    def count(text: str) -> int:
        encoded: Any = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                     tokenize=True, return_dict=True)
        return len(encoded["input_ids"])

    out = []
    for size in sizes:
        rng = np.random.default_rng([seed, _LONG_CONTEXT, size])
        words = [str(w) for w in rng.choice(np.asarray(WORDS), size=size, replace=True)]

        def text(n: int, words: list[str] = words) -> str:
            return " ".join(words[:n]) + "\n" + INSTRUCTION

        low, high = 0, size  # count(text(low)) <= size holds once low = 0 fits; search the largest n that fits
        while low < high:
            mid = (low + high + 1) // 2
            if count(text(mid)) <= size:
                low = mid
            else:
                high = mid - 1
        out.append(LongPrompt(size, count(text(low)), text(low)))
    return out


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


def llama_binaries(args: argparse.Namespace) -> tuple[str, str | None, dict[str, Any]]:
    """llama-server and llama-perplexity: as given, else built once under --llama-cache."""
    if args.llama_server:
        server = args.llama_server
        beside = Path(server).with_name("llama-perplexity")
        ppl = args.llama_perplexity or (str(beside) if os.access(beside, os.X_OK) else None)
        return server, ppl, {"source": "given"}
    build = LlamaCppBuild(Path(args.llama_cache).expanduser().resolve(), args.llama_cpp_python)
    paths = ensure_built(build)
    info = {"source": "built", "cache": str(build.cache), "llama_cpp_python_sdist": build.version}
    return str(paths["llama-server"]), args.llama_perplexity or str(paths["llama-perplexity"]), info


# -- servers -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ServerSpec:
    name: str
    label: str
    cmd: list[str]  # without --port
    health: str
    kind: str  # llama | ferrum | transformers
    model: str | None = None  # the model requests name (None: the first of /v1/models)
    long_context_cmd: list[str] | None = None  # a separate server for the long-context requests


def server_specs(args: argparse.Namespace, gguf: Path, folder: Path) -> list[ServerSpec]:
    """Each server of args.servers, in race order."""
    host = ["--host", "127.0.0.1"]
    ferrum = [sys.executable, "-m", "ferrum.cli", "serve", "--backend", "cpu", *host]
    ferrum_extra = shlex.split(args.ferrum_args)
    llama = [args.llama_server, "-m", str(gguf), "-t", str(args.llama_threads), *shlex.split(args.llama_args)]
    per_slot = args.llama_ctx // args.llama_parallel
    long_needed = max(args.long_context, default=0) + args.max_tokens + 128
    unified = any(a in ("-kvu", "--kv-unified") for a in shlex.split(args.llama_args))
    long_cmd = None
    if args.long_context and not unified and per_slot < long_needed:
        long_cmd = [*llama, "-np", "1", "-c", str(args.llama_long_ctx), *host]
    specs = {
        "llama-server": ServerSpec(
            "llama-server", "llama-server, Q4_1 GGUF",
            [*llama, "-np", str(args.llama_parallel), "-c", str(args.llama_ctx), *host], "/health", "llama",
            long_context_cmd=long_cmd),
        "ferrum-gguf": ServerSpec("ferrum-gguf", "Ferrum, Q4_1 GGUF", [*ferrum, "--model", str(gguf), *ferrum_extra],
                                  "/ready", "ferrum"),  # /health answers before the model loads
        "ferrum-bf16": ServerSpec("ferrum-bf16", "Ferrum, bf16 folder",
                                  [*ferrum, "--model", str(folder), *ferrum_extra], "/ready", "ferrum"),
    }
    for name, variant_args in args.ferrum_variant:
        specs[f"ferrum-{name}"] = ServerSpec(
            f"ferrum-{name}", f"Ferrum {name} ({variant_args})",
            [*ferrum, "--model", str(folder), *ferrum_extra, *shlex.split(variant_args)], "/ready", "ferrum")
    if "transformers" in args.servers:
        options = argparse.Namespace(dtype=args.transformers_dtype, transformers_cb_defaults=False,
                                     max_batch_tokens=args.transformers_max_batch_tokens,
                                     transformers_args=args.transformers_args)
        blocks = transformers_num_blocks(folder, args.kv_cache_gb, 2 if args.transformers_dtype == "bfloat16" else 4)
        cmd = transformers_command(options, folder, blocks, args.port)
        # transformers serve pins the preloaded model: requests must name it exactly as given
        label = f"transformers serve --continuous-batching, bf16 folder ({args.transformers_dtype})"
        specs["transformers"] = ServerSpec("transformers", label, cmd, "/health", "transformers", model=str(folder))
    return [specs[name] for name in args.servers]


@dataclass(frozen=True)
class TransformersTarget(Target):
    """transformers serve answers 422 to fields it does not know, `ignore_eos` among them; a generation config
    whose eos_token_id is -1 makes its continuous batching stop only at max_tokens instead."""

    def _chat_body(self, request: BenchRequest) -> dict[str, Any]:
        body = super()._chat_body(request)
        if body.pop("ignore_eos", False):
            body["generation_config"] = json.dumps({"do_sample": False, "eos_token_id": -1})
        return body


async def _served_model(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/v1/models") as response:
        if response.status != 200:
            raise BenchError(f"GET {url}/v1/models answered HTTP {response.status}")
        return str((await response.json())["data"][0]["id"])


@dataclass
class Client:
    """How one server is asked: its URL, the model name to send, whether it is transformers serve."""

    url: str
    model: str | None
    transformers: bool
    timeout_s: float
    max_tokens: int
    served: dict[str, Any] = field(default_factory=dict)

    def target(self, model: str, ignore_eos: bool) -> Target:
        kind = TransformersTarget if self.transformers else Target
        return kind(self.url, model, ignore_eos=ignore_eos, endpoint="chat")

    async def _level(self, prompts: Sequence[str], concurrency: int, ignore_eos: bool, warmup: bool) -> LevelRun:
        # A new connection per request: llama-server drops some kept-alive connections after a streamed
        # answer ("Can not write request body" on reuse), so no server gets reused connections.
        connector = aiohttp.TCPConnector(limit=concurrency, force_close=True)
        timeout = aiohttp.ClientTimeout(total=self.timeout_s, sock_connect=30)
        async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
            model = self.model or await _served_model(session, self.url)
            target = self.target(model, ignore_eos)
            if warmup:
                record = await send(session, target, BenchRequest((), 16, text=WARMUP_TEXT))
                if not record.ok:
                    raise BenchError(f"the warm-up request failed: {record.error}")
            slots = asyncio.Semaphore(concurrency)

            async def one(text: str) -> RequestRecord:
                async with slots:
                    return await send(session, target, BenchRequest((), self.max_tokens, text=text))

            started = time.perf_counter()
            records = await asyncio.gather(*(one(text) for text in prompts))
            duration = time.perf_counter() - started
        return LevelRun(summarize(records, duration, concurrency), tuple(records))

    def level(self, prompts: Sequence[str], concurrency: int, ignore_eos: bool, warmup: bool = False) -> LevelRun:
        """Request i asks prompt i (all sent at once, at most `concurrency` in flight), after one untimed
        warm-up request when `warmup`."""
        return asyncio.run(self._level(prompts, concurrency, ignore_eos, warmup))


def _print_level(prefix: str, run: LevelRun, cpu: dict[str, Any], short: list[int], max_tokens: int) -> None:
    r = run.result
    print(
        f"   {prefix} c={r.concurrency}: {r.completed}/{r.num_requests} ok, {r.total_output_tokens} tok in "
        f"{r.duration_s:.2f}s = {r.output_throughput:.1f} tok/s, TPOT p50 {fmt(r.tpot.median_ms)} ms, "
        f"TTFT p50 {fmt(r.ttft.median_ms)} ms; CPU others {cpu['other_cpu_pct']}%"
        + (f"; {len(short)} answers short of {max_tokens} tokens" if short else "")
        + (f"; errors {r.failed}: {r.first_error}" if r.failed else ""),
        flush=True,
    )


def measure_workloads(client: Client, pgid: int, loads: list[Workload], max_tokens: int) -> list[dict[str, Any]]:
    phases = []
    for w_index, workload in enumerate(loads):
        for l_index, (concurrency, prompts) in enumerate(workload.levels):
            load_before = os.getloadavg()[0]
            meter = CpuMeter(pgid)
            run = client.level(prompts, concurrency, workload.ignore_eos, warmup=w_index == l_index == 0)
            cpu = meter.read()
            short = [i for i, r in enumerate(run.records) if r.ok and r.output_tokens != max_tokens]
            phases.append({
                "workload": workload.name,
                **level_json(run, with_requests=False),
                "cpu": cpu,
                "loadavg_1m_before": round(load_before, 2),
                "answers_not_max_tokens": short if workload.ignore_eos else [],
                "answers": [r.text for r in run.records],
            })
            _print_level(workload.name, run, cpu, short if workload.ignore_eos else [], max_tokens)
    return phases


def measure_long_context(client: Client, pgid: int, prompts: list[LongPrompt], rounds: int) -> list[dict[str, Any]]:
    """Streamed requests alone, the prompts in turn, `rounds` times over: per prompt its prompt tokens (the
    server's usage), the first round's TTFT (later rounds find the prompt in the server's prefix cache) and
    the median of the rounds' TPOTs. The sizes alternate, so that a drift of the machine's speed over the
    minutes falls on every size alike; each round's TPOTs are kept (tpot_rounds_ms)."""
    out: list[dict[str, Any]] = []
    for round_index in range(rounds):
        for i, prompt in enumerate(prompts):
            meter = CpuMeter(pgid)
            run = client.level([prompt.text], 1, ignore_eos=True)
            cpu = meter.read()
            record = run.records[0]
            tpot = run.result.tpot.median_ms
            if round_index == 0:
                out.append({
                    "target_tokens": prompt.target, "template_tokens": prompt.tokens,
                    "prompt_tokens": record.prompt_len, "output_tokens": record.output_tokens,
                    "ttft_ms": run.result.ttft.median_ms, "tpot_ms": None, "tpot_rounds_ms": [],
                    "error": record.error, "cpu": cpu,
                })
            row = out[i]
            row["tpot_rounds_ms"].append(tpot)
            row["error"] = row["error"] or record.error
            row["cpu"]["other_cpu_pct"] = max(row["cpu"]["other_cpu_pct"], cpu["other_cpu_pct"])
            print(f"   long context ~{prompt.target} (round {round_index + 1}): {record.prompt_len} prompt tokens, "
                  f"{record.output_tokens} out, TTFT {fmt(run.result.ttft.median_ms)} ms, TPOT {fmt(tpot)} ms; "
                  f"CPU others {cpu['other_cpu_pct']}%"
                  + (f"; error: {record.error}" if record.error else ""), flush=True)
    for row in out:
        done = [t for t in row["tpot_rounds_ms"] if t is not None]
        row["tpot_ms"] = statistics.median(done) if done else None
    return out


def llama_tokens(url: str, text: str) -> list[int]:
    """llama-server's tokens of `text` (with the GGUF's special tokens, as llama-perplexity tokenizes)."""
    response = httpx.post(f"{url}/tokenize", json={"content": text, "add_special": True}, timeout=60)
    response.raise_for_status()
    return list(response.json()["tokens"])


@dataclass(frozen=True)
class RaceContext:
    args: argparse.Namespace
    env: dict[str, str]
    out_dir: Path
    stamp: str
    loads: list[Workload]
    long_prompts: list[LongPrompt]
    ppl_text: Path | None


def _server(ctx: RaceContext, name: str, cmd: list[str], health: str, pass_index: int) -> ServerProcess:
    log = ctx.out_dir / "logs" / f"{name}-pass{pass_index}-{ctx.stamp}.log"
    return ServerProcess(name, [*cmd, "--port", str(ctx.args.port)] if "--port" not in cmd else cmd, ctx.env, log,
                         f"http://127.0.0.1:{ctx.args.port}", health)


def race_server(spec: ServerSpec, pass_index: int, ctx: RaceContext) -> dict[str, Any]:
    """Starts the server, measures both workloads, perplexity (pass 1) and the long-context requests, stops it."""
    args, text = ctx.args, ctx.ppl_text
    server = _server(ctx, spec.name, spec.cmd, spec.health, pass_index)
    out: dict[str, Any] = {"name": spec.name, "label": spec.label, "pass": pass_index, "cmd": shlex.join(server.cmd),
                           "log": str(server.log_path)}
    print(f"\n== {spec.name}: {out['cmd']}", flush=True)
    out["other_cpu_pct_before_start"] = wait_for_quiet(args.quiet_wait, args.quiet_threshold)
    client = Client(server.base_url, spec.model, spec.kind == "transformers", args.request_timeout, args.max_tokens)
    try:
        out["ready_s"] = round(server.start(), 3)
        out["rss_at_ready_mb"] = server.group_peak_rss_mb()
        print(f"   ready in {out['ready_s']:.2f}s (peak RSS {fmt(out['rss_at_ready_mb'], '.0f')} MB)", flush=True)
        out["phases"] = measure_workloads(client, server.pgid, ctx.loads, args.max_tokens)
        out["peak_rss_after_workloads_mb"] = server.group_peak_rss_mb()
        if spec.kind == "llama" and text is not None:
            token_ids = llama_tokens(server.base_url, text.read_text(encoding="utf-8"))
            out["text_token_count"], out["text_token_ids_sha256"] = len(token_ids), ids_digest(token_ids)
        if spec.kind == "ferrum" and text is not None and pass_index == 1:
            out["perplexity"] = _perplexity(lambda: [api_perplexity(
                server.base_url, spec.model, text.read_text(encoding="utf-8"), args.ppl_ctx)])
        if ctx.long_prompts and spec.long_context_cmd is None:
            out["long_context"] = measure_long_context(client, server.pgid, ctx.long_prompts,
                                                       ctx.args.long_context_rounds)
        out["peak_rss_mb"] = server.group_peak_rss_mb()
        print(f"   peak RSS {fmt(out['peak_rss_after_workloads_mb'], '.0f')} MB after the workloads, "
              f"{fmt(out['peak_rss_mb'], '.0f')} MB at the end", flush=True)
        if spec.kind == "transformers":
            out.update(transformers_cb_check(server))
    except (ServerError, BenchError, OSError, httpx.HTTPError) as exc:
        out["error"] = str(exc)
        print(f"   FAILED: {exc}", file=sys.stderr, flush=True)
    finally:
        server.stop()
    if "error" not in out and spec.long_context_cmd is not None and ctx.long_prompts:
        out["long_context_server"] = long_context_server(spec, pass_index, ctx)
        out["long_context"] = out["long_context_server"].pop("long_context", [])
    if pass_index == 1 and text is not None:
        if spec.kind == "llama" and args.llama_perplexity_exe:
            out["perplexity"] = _perplexity(lambda: [llama_perplexity(
                args.llama_perplexity_exe, Path(args.gguf).resolve(), text, args.ppl_ctx, args.llama_threads,
                ctx.out_dir / "logs" / f"llama-perplexity-{ctx.stamp}.log", out.get("text_token_count"))])
        if spec.kind == "transformers":
            out["perplexity"] = _perplexity(lambda: hf_perplexity_subprocess(
                Path(args.folder).resolve(), text, args.ppl_ctx, [args.transformers_dtype, "float32"]))
    return out


def long_context_server(spec: ServerSpec, pass_index: int, ctx: RaceContext) -> dict[str, Any]:
    """The long-context requests on a server of their own (llama-server with one slot of the whole context)."""
    assert spec.long_context_cmd is not None
    server = _server(ctx, f"{spec.name}-long", spec.long_context_cmd, spec.health, pass_index)
    out: dict[str, Any] = {"cmd": shlex.join(server.cmd), "log": str(server.log_path)}
    print(f"   long context on {out['cmd']}", flush=True)
    client = Client(server.base_url, spec.model, False, ctx.args.request_timeout, ctx.args.max_tokens)
    try:
        out["ready_s"] = round(server.start(), 3)
        client.level([WARMUP_TEXT], 1, ignore_eos=False)
        out["long_context"] = measure_long_context(client, server.pgid, ctx.long_prompts,
                                                       ctx.args.long_context_rounds)
        out["peak_rss_mb"] = server.group_peak_rss_mb()
    except (ServerError, BenchError, OSError) as exc:
        out["error"] = str(exc)
        print(f"   FAILED: {exc}", file=sys.stderr, flush=True)
    finally:
        server.stop()
    return out


def _perplexity(compute: Callable[[], list[ChunkedPerplexity]]) -> list[dict[str, Any]] | dict[str, str]:
    try:
        results = compute()
    except (PerplexityError, OSError, SystemExit, subprocess.TimeoutExpired) as exc:
        print(f"   perplexity FAILED: {exc}", file=sys.stderr, flush=True)
        return {"error": str(exc)}
    for r in results:
        print(f"   perplexity {r.perplexity:.4f} ({r.method}; {r.chunks} chunks of {r.ctx}, "
              f"{r.scored_tokens} tokens scored)", flush=True)
    return [asdict(r) for r in results]


# -- report ------------------------------------------------------------------------------------------

BASELINE = "llama-server"


def _by_server(results: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    by_server: dict[str, list[dict[str, Any]]] = {}
    for run in results:
        by_server.setdefault(run["name"], []).append(run)
    return by_server


def _phase(runs: list[dict[str, Any]], workload: str, concurrency: int) -> list[dict[str, Any] | None]:
    """The phase of one workload at `concurrency` of each pass's run of one server (None where it failed)."""
    return [next((p for p in run.get("phases", []) if p["workload"] == workload and p["concurrency"] == concurrency),
                 None) for run in runs]


def _figures(phases: list[dict[str, Any] | None]) -> dict[str, list[float | None]]:
    def pick(p: dict[str, Any] | None, key: str) -> float | None:
        if p is None:
            return None
        return p["output_throughput"] if key == "tok_s" else p[key]["median"]

    return {key: [pick(p, key) for p in phases] for key in ("tok_s", "tpot_ms", "ttft_ms")}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def summarize_race(results: list[dict[str, Any]], loads: list[Workload]) -> dict[str, list[dict[str, Any]]]:
    """Per workload, one row per server and concurrency: per-pass tok/s, TPOT p50, TTFT p50, and each over
    llama-server's of the same pass."""
    by_server = _by_server(results)
    out: dict[str, list[dict[str, Any]]] = {}
    for workload in loads:
        rows = []
        for name, runs in by_server.items():
            for c, _ in workload.levels:
                phases = _phase(runs, workload.name, c)
                row: dict[str, Any] = {"server": name, "label": runs[0]["label"], "concurrency": c, **_figures(phases)}
                row["others_cpu_pct_max"] = max((p["cpu"]["other_cpu_pct"] or 0 for p in phases if p), default=None)
                row["answers_not_max_tokens"] = sum(len(p["answers_not_max_tokens"]) for p in phases if p)
                row["failed"] = sum(p["failed"] for p in phases if p) + sum(p is None for p in phases)
                if name != BASELINE and BASELINE in by_server:
                    base = _figures(_phase(by_server[BASELINE], workload.name, c))
                    row["vs_llama_server"] = {
                        key: [_ratio(a, b) for a, b in zip(row[key], base[key], strict=True)] for key in base
                    }
                rows.append(row)
        out[workload.name] = rows
    return out


def _long(run: dict[str, Any], target: int, key: str) -> float | None:
    row = next((r for r in run.get("long_context", []) if r["target_tokens"] == target), None)
    if row is None or row["error"]:
        return None
    return row["cpu"]["other_cpu_pct"] if key == "others_cpu_pct" else row[key]


def server_rows(results: list[dict[str, Any]], sizes: Sequence[int]) -> list[dict[str, Any]]:
    """One row per server: perplexity (pass 1), and per pass ready time, peak RSS and the long-context figures."""
    by_server = _by_server(results)
    llama_sha = next((r.get("text_token_ids_sha256") for r in by_server.get(BASELINE, [])), None)
    rows = []
    for name, runs in by_server.items():
        ppl = next((r["perplexity"] for r in runs if "perplexity" in r), None)
        first = ppl[0] if isinstance(ppl, list) and ppl else None
        same = None
        if first is not None and first["token_ids_sha256"] is not None and llama_sha is not None:
            same = first["token_ids_sha256"] == llama_sha
        elif first is not None and name == BASELINE:
            same = True
        row: dict[str, Any] = {
            "server": name,
            "label": runs[0]["label"],
            "perplexity": first["perplexity"] if first else None,
            "perplexity_all": ppl,
            "same_tokens_as_llama_cpp": same,
            "ready_s": [r.get("ready_s") for r in runs],
            "peak_rss_after_workloads_mb": [r.get("peak_rss_after_workloads_mb") for r in runs],
            "peak_rss_mb": [r.get("peak_rss_mb") for r in runs],
            "long_context_server": [r.get("long_context_server") for r in runs if r.get("long_context_server")],
            "long_context": {},
        }
        for size in sizes:
            row["long_context"][str(size)] = {
                key: [_long(r, size, key) for r in runs]
                for key in ("prompt_tokens", "ttft_ms", "tpot_ms", "others_cpu_pct")
            }
        if len(sizes) >= 2:
            low, high = row["long_context"][str(min(sizes))], row["long_context"][str(max(sizes))]
            row["tpot_long_over_short"] = [_ratio(b, a) for a, b in zip(low["tpot_ms"], high["tpot_ms"], strict=True)]
        rows.append(row)
    return rows


def _cells(values: list[Any], spec: str) -> str:
    return " / ".join(fmt(v, spec) if v is None or isinstance(v, int | float) else str(v) for v in values)


def workload_table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| server | c | tok/s | TPOT p50 ms | TTFT p50 ms | tok/s ÷ llama | TPOT ÷ llama | TTFT ÷ llama "
        "| others' CPU |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        ratios = row.get("vs_llama_server")
        none = "1" if row["server"] == BASELINE else "-"
        cells = [_cells(ratios[k], ".2f") if ratios else none for k in ("tok_s", "tpot_ms", "ttft_ms")]
        flag = f" ({row['failed']} failed)" if row["failed"] else ""
        if row["answers_not_max_tokens"]:
            flag += f" ({row['answers_not_max_tokens']} answers short)"
        lines.append(
            f"| {row['label']}{flag} | {row['concurrency']} | {_cells(row['tok_s'], '.1f')} | "
            f"{_cells(row['tpot_ms'], '.1f')} | {_cells(row['ttft_ms'], '.0f')} | {' | '.join(cells)} | "
            f"{fmt(row['others_cpu_pct_max'], '.0f')}% |"
        )
    return "\n".join(lines)


def server_table(rows: list[dict[str, Any]], sizes: Sequence[int], ppl_note: str, busy_pct: float) -> str:
    long_heads = "".join(f" TPOT ms @~{s} (prompt tok) |" for s in sizes)
    ratio_head = f" TPOT {max(sizes)} ÷ {min(sizes)} | TTFT ms @~{max(sizes)} |" if len(sizes) >= 2 else ""
    lines = [
        f"| server | perplexity | same tokens as llama.cpp | ready s | peak RSS MB (workloads / end) |{long_heads}"
        f"{ratio_head}",
        "|---|---|---|---|---|" + "---|" * (len(sizes) + (2 if len(sizes) >= 2 else 0)),
    ]
    for row in rows:
        rss = [f"{fmt(a, '.0f')} / {fmt(b, '.0f')}"
               for a, b in zip(row["peak_rss_after_workloads_mb"], row["peak_rss_mb"], strict=True)]
        for extra in row["long_context_server"]:
            rss.append(f"long-context server {fmt(extra.get('peak_rss_mb'), '.0f')}")
        same = {None: "-", True: "yes", False: "NO"}[row["same_tokens_as_llama_cpp"]]
        long_cells = ""
        for s in sizes:
            lc = row["long_context"][str(s)]
            cells = [f"{fmt(t)} ({fmt(p, '.0f')}){' !' if (o or 0) > busy_pct else ''}"
                     for t, p, o in zip(lc["tpot_ms"], lc["prompt_tokens"], lc["others_cpu_pct"], strict=True)]
            long_cells += " " + " / ".join(cells) + " |"
        if len(sizes) >= 2:
            long_cells += f" {_cells(row['tpot_long_over_short'], '.2f')} |"
            long_cells += f" {_cells(row['long_context'][str(max(sizes))]['ttft_ms'], '.0f')} |"
        lines.append(f"| {row['label']} | {fmt(row['perplexity'], '.4f')} | {same} | {_cells(row['ready_s'], '.2f')} | "
                     f"{'; '.join(rss)} |{long_cells}")
    lines.append("")
    lines.append(ppl_note)
    return "\n".join(lines)


def markdown(report: dict[str, Any], loads: list[Workload], args: argparse.Namespace) -> str:
    meta = report["meta"]
    parts = [
        f"CPU: {meta['cpu_model']}, {meta['cpu_count']} CPUs; SIMD flags: {' '.join(meta['cpu_simd_flags'])}",
        f"{args.passes} pass(es); each cell: pass 1 / pass 2 / ...; ratios pair each pass with llama-server's of the "
        "same pass; others' CPU: the most any level saw other processes take, of all CPUs.",
    ]
    for workload in loads:
        parts.append(f"\n### Workload {workload.name}: {workload.title}\n")
        parts.append(workload_table(report["summary"][workload.name]))
    sizes = args.long_context
    parts.append("\n### Per server: perplexity, readiness, memory, long-context decoding\n")
    ppl = report["perplexity_setup"]
    note = (f"Perplexity: {ppl['text']} ({ppl.get('llama_tokens', '?')} tokens by llama.cpp), chunks of {ppl['ctx']} "
            f"tokens each evaluated alone, the last {ppl['scored_per_chunk']} of each scored (llama-perplexity "
            f"-c {ppl['ctx']}); llama-server: llama-perplexity on the GGUF; Ferrum: its prompt logprobs through "
            "the API; transformers: in-process on the folder in the served dtype (float32 in the JSON). "
            "Long context: streamed requests alone, 64 output tokens, the sizes in turn, "
            f"{args.long_context_rounds} rounds: TTFT of the first (uncached), TPOT the rounds' median; prompt tokens "
            "as the server counted them."
            if ppl.get("text") else "Perplexity: not measured.")
    if any(r.get("long_context_server") for r in report["runs"]):
        note += (" llama-server's long-context requests ran on a second llama-server with one slot of "
                 f"-c {args.llama_long_ctx} (its -np {args.llama_parallel} slots of the race hold "
                 f"{args.llama_ctx // args.llama_parallel} tokens each).")
    note += (f" '!': other processes took more than {args.quiet_threshold:.0f}% of the CPUs during that request "
             "(not reliable).")
    parts.append(server_table(report["servers"], sizes, note, args.quiet_threshold))
    return "\n".join(parts)


# -- main --------------------------------------------------------------------------------------------

KNOWN = ("llama-server", "ferrum-gguf", "ferrum-bf16", "transformers")


def _variant(text: str) -> tuple[str, str]:
    name, sep, rest = text.partition("=")
    if not sep or not name or not name.replace("-", "").replace("_", "").isalnum():
        raise argparse.ArgumentTypeError(f"expected NAME=ARGS, got {text!r}")
    return name, rest


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for race.json, race.md and the logs")
    ap.add_argument("--gguf", default="models/SmolLM2-135M-Instruct.Q4_1.gguf",
                    help="the GGUF file llama-server and Ferrum serve (`make model` keeps the demo model's)")
    ap.add_argument("--folder", default="models/SmolLM2-135M-Instruct",
                    help="the converted model folder Ferrum and transformers serve")
    ap.add_argument("--llama-server", default=None, help="the llama-server executable (else built, --llama-cache)")
    ap.add_argument("--llama-perplexity", default=None,
                    help="the llama-perplexity executable (default: beside llama-server, or built)")
    ap.add_argument("--llama-cache", default="~/.cache/ferrum/llama.cpp-build",
                    help="where llama.cpp is built once and kept (scripts/llama_cpp_build.py)")
    ap.add_argument("--llama-cpp-python", default="0.3.36", help="the llama-cpp-python sdist whose llama.cpp to build")
    ap.add_argument("--servers", default=",".join(KNOWN), help="which servers, in this order, comma-separated")
    ap.add_argument("--skip-transformers", action="store_true", help="leave transformers serve out")
    ap.add_argument("--ferrum-args", default="", help="more `ferrum serve` args for both Ferrum servers (use =)")
    ap.add_argument("--ferrum-variant", type=_variant, action="append", default=[], metavar="NAME=ARGS",
                    help="also race ferrum-NAME: Ferrum on the folder with ARGS last (repeat; use =)")
    ap.add_argument("--passes", type=int, default=1)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--requests", type=int, default=16, help="long workload: requests per concurrency level")
    ap.add_argument("--short-requests", type=int, nargs="+", default=None, metavar="N",
                    help="short workload: requests per level, one per --concurrency (default 8 at c=1, 4 per slot)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--words", type=LengthRange.parse, default=LengthRange(40, 120),
                    help="long workload: words per prompt, LOW:HIGH (default 40:120)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--long-context", type=int, nargs="*", default=[50, 6000], metavar="TOKENS",
                    help="prompt sizes of the single long-context requests (none: skip them)")
    ap.add_argument("--long-context-rounds", type=int, default=3,
                    help="times the long-context requests run, the sizes in turn (TPOT: the rounds' median)")
    ap.add_argument("--ppl-text", default="tests/data/perplexity.txt", help="the perplexity text ('' to skip)")
    ap.add_argument("--ppl-ctx", type=int, default=256,
                    help="perplexity chunk, a multiple of 256 (llama-perplexity -c); the text needs 2x its tokens")
    ap.add_argument("--llama-threads", type=int, default=len(os.sched_getaffinity(0)), help="llama-server -t")
    ap.add_argument("--llama-parallel", type=int, default=8, help="llama-server -np (slots)")
    ap.add_argument("--llama-ctx", type=int, default=8192, help="llama-server -c (shared by the slots)")
    ap.add_argument("--llama-long-ctx", type=int, default=8192,
                    help="-c of the one-slot llama-server for the long-context requests")
    ap.add_argument("--llama-args", default="", help="more llama-server args, one string (use =)")
    ap.add_argument("--transformers-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--transformers-args", default="", help="more `transformers serve` args (use =)")
    ap.add_argument("--transformers-max-batch-tokens", type=int, default=1024, help="--cb-max-batch-tokens")
    ap.add_argument("--kv-cache-gb", type=float, default=2.0, help="transformers' CB blocks sized to this much KV")
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
    if args.skip_transformers:
        args.servers = [s for s in args.servers if s != "transformers"]
    unknown = set(args.servers) - set(KNOWN)
    if unknown:
        ap.error(f"--servers: unknown {sorted(unknown)}; choose from {', '.join(KNOWN)}")
    args.servers += [f"ferrum-{name}" for name, _ in args.ferrum_variant]
    if not args.servers:
        ap.error("no server to race")
    if args.passes < 1 or args.requests < 1 or min(args.concurrency) < 1:
        ap.error("--passes, --requests and --concurrency must be at least 1")
    if args.short_requests and (len(args.short_requests) != len(args.concurrency) or min(args.short_requests) < 1):
        ap.error("--short-requests needs one count >= 1 per --concurrency value")
    if args.ppl_ctx % 256:
        ap.error("--ppl-ctx must be a multiple of 256 (llama.cpp rounds its context up to one)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGHUP, _on_signal)
    ServerProcess.ready_timeout = args.ready_timeout
    gguf, folder = Path(args.gguf).resolve(), Path(args.folder).resolve()
    uses_gguf = any(s in args.servers for s in ("llama-server", "ferrum-gguf"))
    if uses_gguf and not gguf.is_file():
        print(f"cpu_race: no GGUF file at {gguf} (`make model` keeps the demo model's)", file=sys.stderr)
        return 2
    if not (folder / "config.json").is_file():
        print(f"cpu_race: {folder} has no config.json (`make model` prepares it)", file=sys.stderr)
        return 2
    ppl_text = Path(args.ppl_text).resolve() if args.ppl_text else None
    if ppl_text is not None and not ppl_text.is_file():
        print(f"cpu_race: no perplexity text at {ppl_text}", file=sys.stderr)
        return 2

    cpu = lscpu()
    flags = cpu.get("Flags", "").split()
    print(f"CPU: {cpu.get('Model name', '?')}, {cpu.get('CPU(s)', os.cpu_count())} CPUs "
          f"({cpu.get('Thread(s) per core', '?')} thread(s) per core)")
    print(f"CPU flags (SIMD): {' '.join(simd_flags(flags)) or 'none found'}", flush=True)

    llama_info: dict[str, Any] = {}
    args.llama_perplexity_exe = None
    if "llama-server" in args.servers:
        try:
            args.llama_server, args.llama_perplexity_exe, llama_info = llama_binaries(args)
        except BuildError as exc:
            print(f"cpu_race: building llama.cpp failed: {exc}", file=sys.stderr)
            return 2
        if not os.access(args.llama_server, os.X_OK):
            print(f"cpu_race: {args.llama_server} is not an executable", file=sys.stderr)
            return 2
        print(f"llama-server: {args.llama_server}\nllama-perplexity: {args.llama_perplexity_exe or 'none'}",
              flush=True)

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    loads = workloads(args)
    long_prompts = long_context_prompts(folder, args.long_context, args.seed) if args.long_context else []
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    ctx = RaceContext(args, env, out_dir, stamp, loads, long_prompts, ppl_text)
    specs = server_specs(args, gguf, folder)
    report: dict[str, Any] = {
        "meta": {
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "command": shlex.join([sys.executable, *sys.argv]),
            "cpu_model": cpu.get("Model name"),
            "cpu_count": cpu.get("CPU(s)", os.cpu_count()),
            "cpu_simd_flags": simd_flags(flags),
            "lscpu": cpu,
            "cpu_affinity": len(os.sched_getaffinity(0)),
            "llama_server": args.llama_server,
            "llama_perplexity": args.llama_perplexity_exe,
            "llama_build": llama_info,
            "llama_server_version": llama_version(args.llama_server) if "llama-server" in args.servers else None,
            **versions(),
        },
        "servers_raced": {s.name: {"label": s.label, "cmd": shlex.join(s.cmd),
                                   "long_context_cmd": shlex.join(s.long_context_cmd) if s.long_context_cmd else None}
                          for s in specs},
        "workloads": [{"name": w.name, "title": w.title, "endpoint": "/v1/chat/completions", "temperature": 0,
                       "max_tokens": args.max_tokens, "ignore_eos": w.ignore_eos, "stream": True,
                       "levels": [{"concurrency": c, "prompts": list(p)} for c, p in w.levels]} for w in loads],
        "long_context_prompts": [asdict(p) for p in long_prompts],
        "perplexity_setup": {"text": args.ppl_text or None, "ctx": args.ppl_ctx,
                             "scored_per_chunk": args.ppl_ctx - 1 - args.ppl_ctx // 2},
        "seed": args.seed,
    }
    print(f"\nwaiting for the 1-minute load average to drop below {args.max_load} (up to {args.max_wait_s:.0f}s)",
          flush=True)
    report["load_wait"] = wait_for_low_load(args.max_load, args.poll_s, args.max_wait_s)

    results = []
    started = time.monotonic()
    try:
        for pass_index in range(1, args.passes + 1):
            print(f"\n#### pass {pass_index} of {args.passes}", flush=True)
            for spec in specs:
                results.append(race_server(spec, pass_index, ctx))
    finally:
        _kill_all_live()
    report["wall_s"] = round(time.monotonic() - started)

    llama_run = next((r for r in results if r["name"] == BASELINE and "text_token_ids_sha256" in r), None)
    if ppl_text is not None and llama_run is not None:
        report["perplexity_setup"]["llama_tokens_sha256"] = llama_run["text_token_ids_sha256"]
        ppl = llama_run.get("perplexity")
        if isinstance(ppl, list) and ppl:
            report["perplexity_setup"]["llama_chunks"] = ppl[0]["chunks"]
        report["perplexity_setup"]["llama_tokens"] = llama_run["text_token_count"]
    report["runs"] = results
    report["summary"] = summarize_race(results, loads)
    report["servers"] = server_rows(results, args.long_context)
    table = markdown(report, loads, args)
    (out_dir / "race.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out_dir / "race.md").write_text(table + "\n")
    print("\n" + table)
    print(f"\nwall time {report['wall_s']}s; JSON: {out_dir / 'race.json'}")
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
