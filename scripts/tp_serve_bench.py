"""Tensor parallelism served: cold start with each rank's load rate, batch-1 and concurrency-64
HTTP, offline throughput, and (with --kill-rank) what a dead rank does to the server.

    NCCL_NVLS_ENABLE=0 python scripts/tp_serve_bench.py --shape llama-3.1-8b --tp 1,2 --out DIR --kill-rank
    NCCL_NVLS_ENABLE=0 python scripts/tp_serve_bench.py --shape llama-3.1-70b --tp 2 --ckpt /mnt/ckpt --tiled

For each TP size, through Ferrum's CLI only:
  cold      `ferrum serve --tensor-parallel-size N` from spawn to /ready answering 200, and each rank's
            "GB of weights ... in Ns (R GB/s)" from its log (the checkpoint sits in the page cache or
            a tmpfs: these are memory-to-GPU rates, not disk rates)
  batch 1   `ferrum bench serve --concurrency 1` (128-token prompts, 256 tokens out): TPOT p50 against
            the floor of one rank's weight bytes over one GPU's measured copy bandwidth
  c=64      `ferrum bench serve --concurrency 64`, 256 requests of 100-1024 tokens in and out
  kill      (--kill-rank, the last TP size > 1) SIGKILL to one tensor-parallel worker while the
            server is busy: the server must exit with status 1 and name the rank, within 60 s
  offline   `ferrum bench offline --tensor-parallel-size N`, the same 256 requests
Prints one table and writes DIR/tp-serve.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_suite  # noqa: E402 - after the path
from gpu_suite import Variant, bench, copy_bandwidth, record, server, weight_bytes_read_per_token  # noqa: E402

RANK_LOAD = re.compile(r"tensor parallel rank (\d+)/(\d+): ([\d.]+) GB of weights on its device, ([\d.]+) GB read "
                       r"from the checkpoint in ([\d.]+)s \(([\d.]+) GB/s\)")


def checkpoint(shape: str, root: Path, tiled: bool, workers: int) -> Path:
    folder = root / shape
    if not (folder / "config.json").exists():
        cmd = [sys.executable, str(ROOT / "scripts/make_random_checkpoint.py"), "--shape", shape, "--out", str(folder),
               "--workers", str(workers)]
        subprocess.run(cmd + (["--tiled"] if tiled else []), check=True)
    return folder


def workers_of(server_pid: int) -> list[int]:
    """The tensor-parallel worker processes under the server (the engine process's children)."""
    found = subprocess.run(["pgrep", "-f", "ferrum.engine.parallel.worker"], capture_output=True,
                           text=True).stdout.split()

    def descends(pid: int) -> bool:
        while pid > 1:
            try:
                pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                return False
            if pid == server_pid:
                return True
        return False

    return [int(p) for p in found if descends(int(p))]


def kill_a_rank(folder: Path, tp: int, port: int, log_path: Path, flags: list[str]) -> None:
    """A server under load loses a rank: it must exit 1 and name the rank within 60 s."""
    cmd = Variant("new", ROOT).cli("serve", "--model", str(folder), "--port", str(port), "--backend", gpu_suite.BACKEND,
                                   "--tensor-parallel-size", str(tp), *flags)
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    try:
        import urllib.request

        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1):
                    break
            except OSError:
                time.sleep(0.2)
        load = threading.Thread(target=bench, args=(Variant("new", ROOT), "serve", "--url", f"http://127.0.0.1:{port}",
                                                     "--tokenizer", str(folder), "--concurrency", "16",
                                                     "--num-prompts", "64", "--output-json",
                                                     str(log_path.with_suffix(".load.json"))), daemon=True)
        load.start()
        time.sleep(3)
        victims = workers_of(proc.pid)
        record("kill", f"TP{tp} worker processes under the server", len(victims), "", str(victims))
        os.kill(victims[-1], signal.SIGKILL)
        killed = time.monotonic()
        try:
            code = proc.wait(60)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - killed
        text = log_path.read_text()
        named = "tensor-parallel rank" in text and "exited with status -9" in text
        record("kill", f"TP{tp} server after SIGKILL to a rank under load", code, "exit status",
               f"after {took:.1f}s; rank named in the log: {named}; pass: {code == 1 and named}")
        load.join(30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def attempt(what: str, step) -> None:
    """Runs one measurement; a failure is recorded and the run goes on to the next."""
    try:
        step()
    except Exception as exc:  # noqa: BLE001 - one device run measures everything it can
        record("error", what, type(exc).__name__, "", str(exc)[-800:])


def served(args, folder: Path, tp: int, per_token: int, bw: float, flags: list[str], work: list[str],
           skip: set[str]) -> None:
    variant = Variant("new", ROOT)
    tag = f"{args.shape} TP{tp}"
    log_path = args.out / f"serve-tp{tp}.log"
    port = 8030 + tp
    with server(variant, folder, port, log_path, "--tensor-parallel-size", str(tp), *flags) as ready:
        record("cold", f"{tag} ferrum serve -> /ready", round(ready, 1), "s")
        for line in log_path.read_text().splitlines():
            m = RANK_LOAD.search(line)
            if m:
                rank, _, on_device, read, secs, rate = m.groups()
                record("cold", f"{tag} rank {rank} weights", float(on_device), "GB",
                       f"{read} GB read from the checkpoint in {secs}s: {rate} GB/s")
            elif "GB of weights from" in line and tp == 1:
                record("cold", f"{tag} weights", line.split("loaded ", 1)[-1][:120])
        url = f"http://127.0.0.1:{port}"
        if "batch1" not in skip:
            res = bench(variant, "serve", "--url", url, "--tokenizer", str(folder), "--concurrency", "1",
                        "--num-prompts", "3", "--input-len", str(min(128, args.max_model_len // 4)),
                        "--output-len", str(min(256, args.max_model_len // 2)), "--seed", "1",
                        "--output-json", str(args.out / f"batch1-tp{tp}.json"))
            tpot = res["levels"][0]["tpot_ms"]["median"]
            floor = per_token / tp / bw * 1e3
            record("batch1", f"{tag} batch-1 TPOT p50 over HTTP", round(tpot, 3), "ms/token",
                   f"floor {floor:.3f} ms (weights/TP over one GPU's copy bandwidth): {floor / tpot:.1%}")
        if "c64" not in skip:
            res = bench(variant, "serve", "--url", url, "--tokenizer", str(folder), "--concurrency", "64", *work,
                        "--output-json", str(args.out / f"c64-tp{tp}.json"))
            lvl = res["levels"][0]
            record("c64", f"{tag} HTTP c=64", round(lvl["output_throughput"]), "output tok/s",
                   f"TTFT p50/p99 {lvl['ttft_ms']['median']:.0f}/{lvl['ttft_ms']['p99']:.0f} ms, TPOT p50 "
                   f"{lvl['tpot_ms']['median']:.2f} ms, failed {lvl['failed']}")


def offline(args, folder: Path, tp: int, flags: list[str], work: list[str]) -> None:
    res = bench(Variant("new", ROOT), "offline", "--model", str(folder), "--backend", gpu_suite.BACKEND,
                "--tensor-parallel-size", str(tp), *flags, *work,
                "--output-json", str(args.out / f"offline-tp{tp}.json"))
    record("offline", f"{args.shape} TP{tp} ferrum bench offline", round(res["output_tokens_per_s"]), "output tok/s",
           f"{res['elapsed_s']:.1f}s, {res['total_output_tokens']} tokens (as requested: "
           f"{res['output_tokens_as_requested']})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/ferrum-ckpt"))
    ap.add_argument("--tiled", action="store_true", help="make the checkpoint with make_random_checkpoint --tiled")
    ap.add_argument("--workers", type=int, default=8, help="processes writing the checkpoint")
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--input-len", default="100:1024")
    ap.add_argument("--output-len", default="100:1024")
    ap.add_argument("--kill-rank", action="store_true")
    ap.add_argument("--skip", default="", help="phases to leave out: batch1,c64,offline")
    ap.add_argument("--model", type=Path, help="serve this folder instead of a random checkpoint (with "
                    "--backend cpu: a smoke test of the script on a machine without GPUs)")
    ap.add_argument("--backend", default="cuda")
    ap.add_argument("--extra", default="", help="more flags for serve and bench offline, space-separated")
    args = ap.parse_args()
    gpu_suite.BACKEND = args.backend
    args.out.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, args.skip.split(",")))
    gpus = torch.cuda.device_count()
    record("env", "machine", f"{gpus} x {torch.cuda.get_device_name(0)}" if gpus else platform.processor(), "",
           f"torch {torch.__version__}, python {platform.python_version()}, "
           f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}")
    started = time.perf_counter()
    folder = args.model or checkpoint(args.shape, args.ckpt, args.tiled, args.workers)
    size = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    record("env", f"{args.shape} checkpoint", round(size / 1e9, 2), "GB", f"at {folder} "
           f"(ready {time.perf_counter() - started:.0f}s after the start)")
    bw = copy_bandwidth(2**29) if gpus else float("nan")
    record("env", "copy bandwidth of one GPU (read+write)", round(bw / 1e9) if gpus else None, "GB/s")
    per_token = weight_bytes_read_per_token(folder)
    flags = ["--max-model-len", str(args.max_model_len), *args.extra.split()]
    work = ["--num-prompts", str(args.num_prompts), "--seed", "0", "--input-len", args.input_len,
            "--output-len", args.output_len]
    sizes = [int(t) for t in args.tp.split(",")]
    for tp in sizes:
        attempt(f"TP{tp} served", functools.partial(served, args, folder, tp, per_token, bw, flags, work, skip))
        if args.kill_rank and tp > 1 and tp == sizes[-1]:
            kill_log = args.out / f"kill-tp{tp}.log"
            attempt(f"TP{tp} kill a rank", functools.partial(kill_a_rank, folder, tp, 8050 + tp, kill_log, flags))
        if "offline" not in skip:
            attempt(f"TP{tp} offline", functools.partial(offline, args, folder, tp, flags, work))
    (args.out / "tp-serve.json").write_text(json.dumps(gpu_suite.RESULTS, indent=1))
    print("\n" + "\n".join(f"{r['phase']:8s} {r['name']:60s} {r['value']!s:>12} {r['unit']:12s} {r['note']}"
                           for r in gpu_suite.RESULTS), flush=True)


if __name__ == "__main__":
    main()
