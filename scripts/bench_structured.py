"""Served output tokens/s with 0%, 50% and 100% of the requests constrained by a JSON schema, in one run.

Every request is the same chat question with the same `max_tokens`, without `ignore_eos` (a grammar ends
generation), sent `--concurrency` at a time; output tokens are counted from each reply's usage. Rounds
alternate (0%, 50%, 100%, 0%, ...) so that drift in the machine's speed falls on all of them alike.

    python scripts/bench_structured.py --model models/SmolLM2-135M-Instruct [--backend cpu] [-- SERVE FLAGS]
    python scripts/bench_structured.py --url http://127.0.0.1:8000   # a server already running

Prints the machine (CPU model and flags, or the GPU), then one line per fraction and the ratio to 0%.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
QUESTION = "Invent a person and describe them as JSON: name, age, city and hobbies."


def machine() -> str:
    cpu = platform.processor() or "cpu"
    flags: list[str] = []
    try:
        info = Path("/proc/cpuinfo").read_text()
        cpu = next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name"))
        have = set(next(line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")))
        flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile") if f in have]
    except (OSError, StopIteration):
        pass
    return f"{cpu} ({os.cpu_count()} cores; {' '.join(flags) or 'no avx2'})"


def one(url: str, model: str, max_tokens: int, constrained: bool) -> int:
    body: dict = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": max_tokens,
                  "temperature": 0.7}
    if constrained:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    request = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as r:
        reply = json.load(r)
    choice = reply["choices"][0]
    if constrained and choice["finish_reason"] == "stop":
        json.loads(choice["message"]["content"])  # every constrained reply that ended by itself must parse
    return int(reply["usage"]["completion_tokens"])


def round_(
    url: str, model: str, fraction: float, requests: int, concurrency: int, max_tokens: int
) -> tuple[int, float]:
    constrained = round(requests * fraction)
    flags = [i < constrained for i in range(requests)]
    flags = flags[::2] + flags[1::2]  # constrained and free requests interleaved in the batch
    with ThreadPoolExecutor(concurrency) as pool:
        started = time.perf_counter()
        tokens = list(pool.map(lambda f: one(url, model, max_tokens, f), flags))
        return sum(tokens), time.perf_counter() - started


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, timeout_s: float = 1800) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/ready", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise SystemExit("the server was not ready in time")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="a running server (default: start `ferrum serve --model MODEL`)")
    p.add_argument("--model", help="model location for the server this script starts")
    p.add_argument("--backend", default="auto")
    p.add_argument("--requests", type=int, default=64, help="requests per round")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--fractions", default="0,0.5,1", help="shares of constrained requests, comma-separated")
    p.add_argument("--repeats", type=int, default=2, help="rounds of each fraction (alternating)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("serve_flags", nargs="*", help="more `ferrum serve` flags (after --)")
    args = p.parse_args()
    fractions = [float(f) for f in args.fractions.split(",")]
    proc = None
    url = args.url
    if url is None:
        if not args.model:
            p.error("give --url or --model")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        log = tempfile.NamedTemporaryFile(prefix="bench-structured-", suffix=".log", delete=False)
        proc = subprocess.Popen([sys.executable, "-m", "ferrum.cli", "serve", "--model", args.model,
                                 "--port", str(port), "--backend", args.backend,
                                 "--max-num-seqs", str(max(args.concurrency, 1)), "--no-log-requests",
                                 *args.serve_flags],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        print(f"server log: {log.name}")
    try:
        if proc is not None:
            wait_ready(url, proc)
        with urllib.request.urlopen(f"{url}/v1/models") as r:
            model = json.load(r)["data"][0]["id"]
        try:
            with urllib.request.urlopen(f"{url}/v1/backends") as r:
                backend = json.load(r)
        except OSError:
            backend = {}
        print(f"machine: {machine()}")
        print(f"backend: {json.dumps(backend)[:300]}")
        print(f"model {model}; {args.requests} requests per round, {args.concurrency} at a time, "
              f"max_tokens {args.max_tokens}, temperature 0.7")
        round_(url, model, 0.5, args.concurrency, args.concurrency, args.max_tokens)  # warm-up
        totals = {f: [0, 0.0] for f in fractions}
        for _ in range(args.repeats):
            for f in fractions:
                tokens, seconds = round_(url, model, f, args.requests, args.concurrency, args.max_tokens)
                totals[f][0] += tokens
                totals[f][1] += seconds
        base = totals[fractions[0]][0] / totals[fractions[0]][1]
        results = []
        print(f"{'constrained':>12} {'output tokens':>14} {'seconds':>9} {'tokens/s':>9} {'vs first':>9}")
        for f in fractions:
            total_tokens, total_seconds = totals[f]
            rate = total_tokens / total_seconds
            results.append({"fraction": f, "output_tokens": total_tokens, "seconds": total_seconds,
                            "tokens_per_s": rate, "ratio": rate / base})
            print(f"{f:>12.0%} {total_tokens:>14} {total_seconds:>9.1f} {rate:>9.1f} {rate / base:>8.2f}x")
        if args.json:
            args.json.write_text(json.dumps({"machine": machine(), "backend": backend, "results": results}, indent=1))
    finally:
        if proc is not None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
