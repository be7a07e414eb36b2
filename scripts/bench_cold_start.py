#!/usr/bin/env python
"""Cold-start benchmark: from spawning `ferrum serve` on a remote model to its first HTTP 200 on GET /health.

Not a test. In one run, on loopback services it starts itself, this script:

1. makes (or reuses, under --work-dir) a random-weight checkpoint with
   `scripts/make_random_checkpoint.py --shape qwen3-0.6b` (about 1.2 GB of bf16, synthetic tokenizer);
2. starts a moto S3 server (`moto_server`, a subprocess), creates a bucket and puts every file of the
   folder with ChecksumAlgorithm=SHA256 (so S3 reports a full-object sha256);
3. starts a static aiohttp file server for the same folder (a subprocess; Range supported, no faults);
4. for each source (s3, url), each repeat and each Ferrum variant, times:
     cold      `ferrum serve --model s3://BUCKET/PREFIX (or http://.../) --backend cpu ...` with a fresh,
               empty --cache-dir, from spawn to the first 200 on /health; then stops it (SIGINT, then
               SIGTERM / SIGKILL after a grace);
     restart   the same command again on the now-warm cache;
   and, once per source and repeat, the plain client on a fresh, empty folder:
     s3        boto3 download_file of every file (TransferConfig: multipart_chunksize = Ferrum's
               chunk_size_mb, max_concurrency = Ferrum's max_concurrent_downloads), then
               safetensors.torch.load_file of the weights file(s);
     url       one aiohttp GET per file streamed to disk, then load_file;
   reported as "download" alone, "download+load" and, since load_file only maps the file, also with
   one read of every byte of every tensor after it ("+touch"; what first use of the weights costs).
5. prints the CPU (model name; avx2 / avx512f / avx512_bf16 / amx_bf16), the checkpoint size and a table
   (medians with min and max; cold/dl = cold ready / plain download; cold-restart = what the empty cache
   cost over the warm one, and its ratio to the plain download), and writes every raw timing as JSON
   (--output-json). Ferrum's own "model ... is in ... (Ns)" log figure is shown too when it logs one.

Ferrum gets a YAML --config whose `weights:` section sets `chunk_size_mb` and `max_concurrent_downloads`
equal to boto3's multipart_chunksize and max_concurrency (moto reads the whole object for every ranged
GET, so the two clients are only comparable at equal chunk sizes; moto's throughput says nothing about
real S3). The page cache is left as it is (never dropped): the checkpoint, the services' copies of it and
Python's libraries are in RAM, so these are CPU / loopback times, not disk times. `sync` runs (untimed)
before every measurement so that one measurement's dirty pages are not written back during the next.

Run from a checkout of Ferrum (the checkpoint is made once and reused; about 1.5 min per repeat on 2 cores):

    cd /work/wt-cold && PYTHONPATH=$PWD .venv/bin/python scripts/bench_cold_start.py --repeat 1
    PYTHONPATH=$PWD .venv/bin/python scripts/bench_cold_start.py                       # 3 repeats
    PYTHONPATH=$PWD .venv/bin/python scripts/bench_cold_start.py --sources s3 --chunk-size-mb 32

Older and newer Ferrum side by side (each PATH is a Ferrum checkout root, used as the server's working
directory and PYTHONPATH; the same interpreter, --ferrum, runs them all):

    PYTHONPATH=$PWD .venv/bin/python scripts/bench_cold_start.py \\
        --variant before=/work/wt-old --variant after=/work/main --output-json cold.json

Without --variant there is one variant, `current`: --ferrum-cwd and --ferrum-pythonpath (both default to
the checkout holding this script). --ferrum sets the command (default: this interpreter `-m ferrum.cli`).
Before timing, each variant runs `FERRUM serve --help` once (untimed; it also warms the page cache for its
libraries) and, for a `PYTHON -m ferrum...` command, the script checks that `ferrum` is imported from the
variant's checkout (an editable install elsewhere would otherwise be timed instead).
Server logs, the moto and static-server logs and the JSON stay in --work-dir/runs/<time>/; caches and
downloads go to a scratch folder there, removed at the end unless --keep.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import gc
import http.client
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MiB = 1024**2
GiB = 1024**3
SHAPE = "qwen3-0.6b"
BUCKET = "ferrum-bench"
REGION = "us-east-1"
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
POLL_S = 0.05  # /health poll interval: the resolution of the ready times
LOG_TAIL_LINES = 40
# Ferrum's own "model X is in FOLDER (12.3s)" log line: the fetch part of a start, when it logs one
# (informative only; the benchmark's figure is the time to the first 200 on /health).
FETCH_LOG = re.compile(r"model \S+ is in .* \((\d+(?:\.\d+)?)s\)")

STATIC_SERVER = """
import sys
from aiohttp import web
folder, prefix, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
app = web.Application()
app.router.add_static("/" + prefix + "/", folder)  # FileResponse: Range requests, sendfile
web.run_app(app, host="127.0.0.1", port=port, print=None, access_log=None)
"""


class BenchError(RuntimeError):
    """The benchmark cannot go on; the message says why (and holds a server's log tail when one failed)."""


# -- processes -------------------------------------------------------------------------------------------


class Processes:
    """Every process this script starts, each in a session (process group) of its own, so that a stop
    reaches its children too; `stop_all` (registered with atexit) ends whatever is still running."""

    def __init__(self) -> None:
        self._running: list[subprocess.Popen[bytes]] = []

    def start(self, cmd: Sequence[str], log: Path, env: dict[str, str] | None = None,
              cwd: Path | None = None) -> subprocess.Popen[bytes]:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(list(cmd), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=env, cwd=cwd, start_new_session=True)
        self._running.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[bytes], first: signal.Signals = signal.SIGTERM,
             grace_s: float = 30.0) -> int:
        """Sends `first` to the process group, then SIGTERM (if `first` was not) and SIGKILL, each after
        a grace; returns the exit status."""
        steps = [first] + [s for s in (signal.SIGTERM, signal.SIGKILL) if s != first]
        for n, sig in enumerate(steps):
            if proc.poll() is not None:
                break
            _signal_group(proc.pid, sig)
            try:
                proc.wait(timeout=grace_s if n == 0 else 10.0)
            except subprocess.TimeoutExpired:
                continue
        _signal_group(proc.pid, signal.SIGKILL)  # stragglers in the group (an engine process, workers)
        if proc in self._running:
            self._running.remove(proc)
        return proc.wait()

    def stop_all(self) -> None:
        for proc in reversed(list(self._running)):
            self.stop(proc, grace_s=10.0)


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # so that atexit stops the servers and removes the scratch folder


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def log_tail(log: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(no log: {exc})"
    return "\n".join("    | " + line for line in text[-lines:])


def wait_until(check: Callable[[], bool], proc: subprocess.Popen[bytes], what: str, log: Path,
               timeout_s: float) -> float:
    """Polls `check` until it is true; returns the perf_counter() time it first was. BenchError (with the
    log's tail) when `proc` exits or `timeout_s` passes first."""
    deadline = time.perf_counter() + timeout_s
    while True:
        if check():
            return time.perf_counter()
        if proc.poll() is not None:
            raise BenchError(f"{what}: the process exited with status {proc.returncode} before it was ready; "
                             f"log {log}:\n{log_tail(log)}")
        if time.perf_counter() > deadline:
            raise BenchError(f"{what}: not ready after {timeout_s:.0f} s; log {log}:\n{log_tail(log)}")
        time.sleep(POLL_S)


def http_status(port: int, path: str, headers: dict[str, str] | None = None) -> int | None:
    """The status of GET http://127.0.0.1:port/path, or None when nothing answers."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def sync_disks() -> None:
    os.sync()


# -- the machine -----------------------------------------------------------------------------------------


def cpu_info() -> dict[str, Any]:
    model: str | None = None
    flags: set[str] = set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model is None:
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    model = model or platform.processor() or "unknown"
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    return {"model": model, "cores": os.cpu_count(), "memory_bytes": mem,
            "flags": {flag: flag in flags for flag in CPU_FLAGS}}


def git_revision(path: Path) -> str | None:
    try:
        rev = subprocess.run(["git", "-C", str(path), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True, timeout=30).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(path), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + ("+dirty" if dirty else "")


# -- the checkpoint --------------------------------------------------------------------------------------


def ensure_checkpoint(work_dir: Path, log_dir: Path) -> Path:
    """The random-weight checkpoint under `work_dir`, made by make_random_checkpoint.py unless a complete
    one is there (a marker file is written after it succeeds)."""
    folder = work_dir / f"checkpoint-{SHAPE}"
    marker = folder / ".bench-complete"
    if marker.is_file():
        print(f"checkpoint: reusing {folder}")
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    maker = ROOT / "scripts" / "make_random_checkpoint.py"
    print(f"checkpoint: making {folder} with {maker.name} --shape {SHAPE} (a few minutes on a small CPU) ...",
          flush=True)
    log = log_dir / "make_random_checkpoint.log"
    with open(log, "wb") as out:
        result = subprocess.run([sys.executable, str(maker), "--shape", SHAPE, "--out", str(folder),
                                 "--device", "cpu"], stdout=out, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise BenchError(f"make_random_checkpoint.py failed ({result.returncode}); log {log}:\n"
                         f"{log_tail(log)}")
    print("  " + log.read_text().strip().splitlines()[-1])
    marker.write_text("made by scripts/bench_cold_start.py\n")
    return folder


def checkpoint_files(folder: Path) -> list[Path]:
    """The files of the model folder (not the marker), small ones first."""
    files = [p for p in folder.iterdir() if p.is_file() and not p.name.startswith(".")]
    return sorted(files, key=lambda p: (p.stat().st_size, p.name))


def weights_files(folder: Path) -> list[Path]:
    return sorted(folder.glob("*.safetensors"))


# -- the services ----------------------------------------------------------------------------------------


def aws_env(endpoint: str, scratch: Path) -> dict[str, str]:
    """An AWS environment that reaches moto only: fixed keys and region, no profile, no metadata service."""
    return {
        "AWS_ENDPOINT_URL": endpoint, "AWS_ENDPOINT_URL_S3": endpoint,
        "AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_REGION": REGION, "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONFIG_FILE": str(scratch / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(scratch / "no-aws-credentials"),
    }


def start_moto(procs: Processes, log: Path, scratch: Path, timeout_s: float) -> str:
    """A moto S3 server on 127.0.0.1 in a subprocess (its own GIL); its spooled objects go to `scratch`."""
    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]
    tmp = scratch / "moto-tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, TMPDIR=str(tmp))
    proc = procs.start([*cmd, "-H", "127.0.0.1", "-p", str(port)], log, env=env)
    wait_until(lambda: http_status(port, "/moto-api/") is not None, proc, "moto_server", log, timeout_s)
    return f"http://127.0.0.1:{port}"


def s3_client(endpoint: str) -> Any:
    import boto3

    return boto3.session.Session().client("s3", region_name=REGION, endpoint_url=endpoint,
                                          aws_access_key_id="bench", aws_secret_access_key="bench")


def upload_folder(endpoint: str, folder: Path, prefix: str) -> str | None:
    """Puts every file of `folder` under s3://BUCKET/prefix/ (single PUTs, ChecksumAlgorithm=SHA256);
    returns the checksum S3 reports for the largest file (None: none)."""
    client = s3_client(endpoint)
    client.create_bucket(Bucket=BUCKET)
    files = checkpoint_files(folder)
    for path in files:
        with open(path, "rb") as body:
            client.put_object(Bucket=BUCKET, Key=f"{prefix}/{path.name}", Body=body,
                              ChecksumAlgorithm="SHA256")
    head = client.head_object(Bucket=BUCKET, Key=f"{prefix}/{files[-1].name}", ChecksumMode="ENABLED")
    if head["ContentLength"] != files[-1].stat().st_size:
        raise BenchError(f"moto holds {head['ContentLength']} bytes of {files[-1].name}, "
                         f"not {files[-1].stat().st_size}")
    return head.get("ChecksumSHA256")


def start_static_server(procs: Processes, folder: Path, prefix: str, log: Path, timeout_s: float) -> str:
    """An aiohttp static file server for `folder` at http://127.0.0.1:PORT/prefix/ (a subprocess); checks
    that it answers a ranged GET with 206."""
    port = free_port()
    proc = procs.start([sys.executable, "-c", STATIC_SERVER, str(folder), prefix, str(port)], log)
    probe = f"/{prefix}/config.json"
    wait_until(lambda: http_status(port, probe) == 200, proc, "static file server", log, timeout_s)
    ranged = http_status(port, probe, {"Range": "bytes=0-9"})
    if ranged != 206:
        raise BenchError(f"the static file server answered a ranged GET with {ranged}, not 206")
    return f"http://127.0.0.1:{port}/{prefix}/"


# -- Ferrum ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """A Ferrum checkout to time: the server runs with `cwd` as its working directory and PYTHONPATH."""

    name: str
    cwd: Path
    pythonpath: Path
    revision: str | None = None


@dataclass(frozen=True)
class Start:
    """One timed `ferrum serve` start."""

    source: str
    variant: str
    repeat: int
    kind: str  # "cold" (empty cache) or "restart" (the cache the cold start filled)
    ready_s: float  # spawn -> first 200 on /health
    fetch_s_logged: float | None  # Ferrum's own "model ... is in ... (Ns)" figure, when it logs one
    stop_s: float
    exit_status: int
    log: str


def parse_variants(args: argparse.Namespace) -> list[Variant]:
    if not args.variant:
        cwd = Path(args.ferrum_cwd or ROOT).resolve()
        pythonpath = Path(args.ferrum_pythonpath or cwd).resolve()
        return [Variant("current", cwd, pythonpath, git_revision(cwd))]
    variants: list[Variant] = []
    for spec in args.variant:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise BenchError(f"--variant {spec!r}: expected NAME=PATH")
        root = Path(path).expanduser().resolve()
        if not (root / "ferrum").is_dir():
            raise BenchError(f"--variant {spec!r}: {root} is not a Ferrum checkout (no ferrum/ folder)")
        if any(v.name == name for v in variants):
            raise BenchError(f"--variant: the name {name!r} is used twice")
        variants.append(Variant(name, root, root, git_revision(root)))
    return variants


def ferrum_env(variant: Variant, extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE")}
    env.update(extra)
    env["PYTHONPATH"] = str(variant.pythonpath)
    env["NO_PROXY"] = env["no_proxy"] = "127.0.0.1,localhost"
    env["HF_HUB_OFFLINE"] = "1"  # the model folder is local once fetched; nothing else to look up
    env["PYTHONUNBUFFERED"] = "1"
    return env


def check_variant(ferrum: list[str], variant: Variant, env: dict[str, str], log: Path) -> str | None:
    """Runs `FERRUM serve --help` (untimed: it also reads the server's libraries into the page cache, so
    the first timed start does not pay for that) and, when FERRUM is `PYTHON -m ferrum...`, returns the
    folder the `ferrum` package is imported from; BenchError when it is not the variant's checkout."""
    with open(log, "ab") as out:
        result = subprocess.run([*ferrum, "serve", "--help"], cwd=variant.cwd, env=env, stdout=out,
                                stderr=subprocess.STDOUT, timeout=600)
    if result.returncode != 0:
        raise BenchError(f"variant {variant.name}: `{shlex.join(ferrum)} serve --help` failed "
                         f"({result.returncode}); log {log}:\n{log_tail(log)}")
    if len(ferrum) < 3 or ferrum[1] != "-m" or not ferrum[2].startswith("ferrum"):
        return None
    probe = "import os, ferrum; print(os.path.dirname(os.path.abspath(ferrum.__file__)))"
    found = subprocess.run([ferrum[0], "-c", probe], cwd=variant.cwd, env=env, capture_output=True, text=True,
                           timeout=300)
    package = found.stdout.strip()
    if found.returncode != 0 or Path(package).resolve() != (variant.pythonpath / "ferrum").resolve():
        where = package or found.stderr.strip()
        raise BenchError(f"variant {variant.name}: `{ferrum[0]}` imports ferrum from {where!r}, "
                         f"not from {variant.pythonpath / 'ferrum'}")
    return package


def write_ferrum_config(path: Path, chunk_size_mb: int, concurrency: int) -> None:
    path.write_text(
        "# written by scripts/bench_cold_start.py: the chunking of the plain boto3 client\n"
        "weights:\n"
        f"  chunk_size_mb: {chunk_size_mb}\n"
        f"  max_concurrent_downloads: {concurrency}\n"
    )


def serve_command(ferrum: list[str], model: str, config: Path, cache_dir: Path, port: int) -> list[str]:
    return [*ferrum, "serve", "--config", str(config), "--model", model, "--backend", "cpu",
            "--host", "127.0.0.1", "--port", str(port), "--cache-dir", str(cache_dir),
            "--max-model-len", "512", "--kv-cache-memory-gb", "0.25"]


def logged_fetch_s(log: Path) -> float | None:
    try:
        matches = FETCH_LOG.findall(log.read_text(errors="replace"))
    except OSError:
        return None
    return float(matches[-1]) if matches else None


@dataclass
class Bench:
    """What every measurement needs: the flags, the processes, the folders and the Ferrum commands."""

    args: argparse.Namespace
    procs: Processes
    logs: Path
    scratch: Path
    ferrum: list[str] = field(default_factory=list)
    variants: list[Variant] = field(default_factory=list)
    envs: dict[str, dict[str, str]] = field(default_factory=dict)  # variant name -> its environment
    config: Path = Path()  # Ferrum's --config (the weights: section)


def time_start(bench: Bench, variant: Variant, model: str, cache_dir: Path, source: str, repeat: int,
               kind: str) -> Start:
    """Spawns `ferrum serve`, times it to the first 200 on /health, stops it (SIGINT first)."""
    args, env = bench.args, bench.envs[variant.name]
    log = bench.logs / f"ferrum-{source}-{variant.name}-{repeat}-{kind}.log"
    port = free_port()
    cmd = serve_command(bench.ferrum, model, bench.config, cache_dir, port)
    log.write_text(f"# {shlex.join(cmd)}\n# cwd={variant.cwd} PYTHONPATH={env['PYTHONPATH']}\n")
    sync_disks()
    started = time.perf_counter()
    proc = bench.procs.start(cmd, log, env=env, cwd=variant.cwd)
    try:
        ready = wait_until(lambda: http_status(port, "/health") == 200, proc,
                           f"ferrum serve ({source}, {variant.name}, {kind})", log, args.ready_timeout)
    except BaseException:
        bench.procs.stop(proc, signal.SIGINT, args.stop_grace)
        raise
    stopping = time.perf_counter()
    status = bench.procs.stop(proc, signal.SIGINT, args.stop_grace)
    stop_s = time.perf_counter() - stopping
    if status not in (0, -signal.SIGINT, 128 + signal.SIGINT):
        print(f"  warning: {variant.name} exited with status {status} after SIGINT (log {log})")
    return Start(source, variant.name, repeat, kind, ready - started, logged_fetch_s(log), stop_s, status,
                 str(log))


# -- the plain clients -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Plain:
    """One plain-client run: download of every file, then load_file of the weights."""

    source: str
    repeat: int
    client: str
    download_s: float
    load_s: float  # load_file: maps the file; nothing is read until a tensor is used
    touch_s: float  # then reading every byte of every tensor once (what serving from them costs first)

    @property
    def download_load_s(self) -> float:
        return self.download_s + self.load_s

    @property
    def download_load_touch_s(self) -> float:
        return self.download_s + self.load_s + self.touch_s


def load_weights(folder: Path) -> tuple[float, float]:
    """safetensors.torch.load_file of every weights file (CPU), then one read of every byte of every tensor
    (copied, in one thread, into a buffer made beforehand; several threads faulting one mapping measure
    mostly the kernel's page-fault contention); the seconds each took."""
    import torch
    from safetensors.torch import load_file

    started = time.perf_counter()
    tensors = [load_file(str(path), device="cpu") for path in weights_files(folder)]
    loaded = time.perf_counter()
    flat = [t.reshape(-1).view(torch.uint8) for shard in tensors for t in shard.values()]
    if not flat:
        raise BenchError(f"no tensors in {folder}")
    scratch = torch.zeros(max(t.numel() for t in flat), dtype=torch.uint8)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        touching = time.perf_counter()
        for t in flat:
            scratch[: t.numel()].copy_(t)
        touched = time.perf_counter()
    finally:
        torch.set_num_threads(threads)
    del tensors, flat, scratch
    gc.collect()
    return loaded - started, touched - touching


def check_sizes(dest: Path, files: list[Path]) -> None:
    for path in files:
        got = (dest / path.name).stat().st_size
        if got != path.stat().st_size:
            raise BenchError(f"plain client: {path.name} has {got} bytes, not {path.stat().st_size}")


def plain_s3(endpoint: str, prefix: str, files: list[Path], dest: Path, chunk_bytes: int,
             concurrency: int) -> tuple[float, float, float]:
    """boto3 download_file of every file (the client made beforehand), then load_file (and touch)."""
    from boto3.s3.transfer import TransferConfig

    client = s3_client(endpoint)
    transfer = TransferConfig(multipart_threshold=chunk_bytes, multipart_chunksize=chunk_bytes,
                              max_concurrency=concurrency, use_threads=True)
    dest.mkdir(parents=True)
    sync_disks()
    started = time.perf_counter()
    for path in files:
        client.download_file(BUCKET, f"{prefix}/{path.name}", str(dest / path.name), Config=transfer)
    download_s = time.perf_counter() - started
    check_sizes(dest, files)
    return (download_s, *load_weights(dest))


async def _aiohttp_get_all(url: str, files: list[Path], dest: Path) -> None:
    import aiohttp

    async with aiohttp.ClientSession(auto_decompress=False) as session:
        for path in files:
            async with session.get(url + path.name) as response:
                response.raise_for_status()
                # blocking writes on the loop: the plain client, as people write it
                with open(dest / path.name, "wb") as out:  # noqa: ASYNC230
                    async for block in response.content.iter_chunked(MiB):
                        out.write(block)


def plain_url(url: str, files: list[Path], dest: Path) -> tuple[float, float, float]:
    """One aiohttp GET per file, streamed to disk, then load_file (and touch)."""
    dest.mkdir(parents=True)
    sync_disks()
    started = time.perf_counter()
    asyncio.run(_aiohttp_get_all(url, files, dest))
    download_s = time.perf_counter() - started
    check_sizes(dest, files)
    return (download_s, *load_weights(dest))


# -- the run ---------------------------------------------------------------------------------------------


@dataclass
class Results:
    starts: list[Start] = field(default_factory=list)
    plain: list[Plain] = field(default_factory=list)


PlainRun = Callable[[Path], tuple[float, float, float]]  # a fresh folder -> download, load, touch seconds


def bench_source(bench: Bench, source: str, model: str, plain: PlainRun, plain_name: str,
                 results: Results) -> None:
    """Every repeat: each variant's cold start and restart, then the plain client; caches removed after."""
    for repeat in range(1, bench.args.repeat + 1):
        for variant in bench.variants:
            cache = bench.scratch / f"cache-{source}-{variant.name}-{repeat}"
            for kind in ("cold", "restart"):
                start = time_start(bench, variant, model, cache, source, repeat, kind)
                results.starts.append(start)
                fetch = f" (fetch {start.fetch_s_logged:.1f} s by its log)" if start.fetch_s_logged else ""
                print(f"  {source} {variant.name} #{repeat} {kind:7s}: ready in {start.ready_s:7.2f} s"
                      f"{fetch}", flush=True)
            shutil.rmtree(cache, ignore_errors=True)
        dest = bench.scratch / f"plain-{source}-{repeat}"
        download_s, load_s, touch_s = plain(dest)
        results.plain.append(Plain(source, repeat, plain_name, download_s, load_s, touch_s))
        print(f"  {source} {plain_name} #{repeat}: download {download_s:7.2f} s, + load_file {load_s:.2f} s, "
              f"+ touch {touch_s:.2f} s", flush=True)
        shutil.rmtree(dest, ignore_errors=True)


def spread(values: list[float]) -> str:
    """median [min-max] (the value alone for one run)."""
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f}"
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]"


def median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summary_rows(results: Results, sources: list[str], variants: list[Variant]) -> list[dict[str, Any]]:
    """One row per source and variant: the raw lists, and the ratios of their medians."""
    rows = []
    for source in sources:
        plain = [p for p in results.plain if p.source == source]
        download = [p.download_s for p in plain]
        for variant in variants:
            mine = [s for s in results.starts if s.source == source and s.variant == variant.name]
            cold = [s.ready_s for s in mine if s.kind == "cold"]
            restart = [s.ready_s for s in mine if s.kind == "restart"]
            extra = [c - r for c, r in zip(cold, restart, strict=True)]  # per repeat: what the empty cache cost
            rows.append({
                "source": source, "variant": variant.name, "plain_client": plain[0].client if plain else None,
                "cold_ready_s": cold, "restart_ready_s": restart, "cold_minus_restart_s": extra,
                "cold_fetch_s_logged": [s.fetch_s_logged for s in mine
                                        if s.kind == "cold" and s.fetch_s_logged is not None],
                "plain_download_s": download,
                "plain_download_load_s": [p.download_load_s for p in plain],
                "plain_download_load_touch_s": [p.download_load_touch_s for p in plain],
                "cold_over_download": ratio(median(cold), median(download)),
                "cold_over_download_load": ratio(median(cold), median([p.download_load_s for p in plain])),
                "cold_minus_restart_over_download": ratio(median(extra), median(download)),
            })
    return rows


def print_table(rows: list[dict[str, Any]]) -> None:
    def med(values: list[float]) -> str:
        m = median(values)
        return "-" if m is None else f"{m:.2f}"

    def times(value: float | None) -> str:
        return "-" if value is None else f"{value:.2f}x"

    header = ["source", "variant", "cold ready s", "fetch s*", "restart ready s", "cold-restart s",
              "plain dl s", "plain dl+load s", "dl+load+touch s", "cold/dl", "(cold-restart)/dl"]
    table = [header] + [[
        row["source"], row["variant"], spread(row["cold_ready_s"]), med(row["cold_fetch_s_logged"]),
        spread(row["restart_ready_s"]), med(row["cold_minus_restart_s"]), spread(row["plain_download_s"]),
        med(row["plain_download_load_s"]), med(row["plain_download_load_touch_s"]),
        times(row["cold_over_download"]), times(row["cold_minus_restart_over_download"]),
    ] for row in rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    for n, line in enumerate(table):
        print("  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip())
        if n == 0:
            print("  ".join("-" * w for w in widths))


TABLE_NOTES = """\
cold / restart ready: spawn of `ferrum serve` -> first 200 on GET /health, with an empty / the warm cache
  (median [min-max] over the repeats; single values for one repeat). fetch s*: Ferrum's own log line
  "model ... is in ... (Ns)" of the cold starts (median; informative). cold-restart: per repeat, what the
  empty cache cost over the warm one.
plain dl: the plain client's download of every file (s3: boto3 download_file; url: aiohttp, one GET per
  file); dl+load: then safetensors.torch.load_file (it maps the file; nothing is read yet);
  dl+load+touch: then one read of every byte of every tensor. Ratios: of the medians.
Page cache left as it is (never dropped). moto reads the whole object for every ranged GET: its times say
  nothing about real S3, only about the two clients side by side at equal chunk sizes."""


def describe_machine(cpu: dict[str, Any], checkpoint: Path, files: list[Path]) -> int:
    flags = " ".join(f"{flag}={'yes' if present else 'no'}" for flag, present in cpu["flags"].items())
    mem = f", {cpu['memory_bytes'] / GiB:.0f} GiB RAM" if cpu["memory_bytes"] else ""
    print(f"CPU: {cpu['model']}, {cpu['cores']} cores{mem}; {flags}")
    total = sum(p.stat().st_size for p in files)
    shards = weights_files(checkpoint)
    weights = sum(p.stat().st_size for p in shards)
    print(f"checkpoint: {checkpoint} ({SHAPE}, random bf16): {len(files)} files, {total / 1e9:.3f} GB "
          f"({total / GiB:.3f} GiB), weights {weights / 1e9:.3f} GB in {len(shards)} file(s)")
    if total < GiB:
        print("  warning: the checkpoint is smaller than 1 GiB")
    return total


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work-dir", type=Path, default=Path("~/.cache/ferrum/bench-cold-start").expanduser(),
                   help="the checkpoint (reused) and runs/<time>/ (logs, JSON, scratch); default %(default)s")
    p.add_argument("--repeat", type=int, default=3, help="timed runs of each measurement (default 3)")
    p.add_argument("--sources", nargs="+", choices=("s3", "url"), default=["s3", "url"])
    p.add_argument("--chunk-size-mb", type=int, default=16,
                   help="boto3 multipart_chunksize and Ferrum's weights.chunk_size_mb (default 16)")
    p.add_argument("--concurrency", type=int, default=8,
                   help="boto3 max_concurrency and Ferrum's weights.max_concurrent_downloads (default 8)")
    p.add_argument("--ferrum", default=None,
                   help="the Ferrum command, shell-quoted (default: this interpreter -m ferrum.cli)")
    p.add_argument("--ferrum-cwd", default=None, help="working directory of the default variant (default: "
                   "the checkout holding this script)")
    p.add_argument("--ferrum-pythonpath", default=None, help="PYTHONPATH of the default variant (default: "
                   "--ferrum-cwd)")
    p.add_argument("--variant", action="append", metavar="NAME=PATH",
                   help="a Ferrum checkout root to time (its cwd and PYTHONPATH); repeat for several")
    p.add_argument("--ready-timeout", type=float, default=600.0,
                   help="seconds a server may take to answer 200 on /health (default 600)")
    p.add_argument("--stop-grace", type=float, default=30.0,
                   help="seconds after SIGINT before SIGTERM, then SIGKILL (default 30)")
    p.add_argument("--output-json", type=Path, default=None,
                   help="raw timings as JSON (default: WORK_DIR/runs/<time>/results.json)")
    p.add_argument("--keep", action="store_true", help="keep the scratch folder (caches, downloads)")
    args = p.parse_args(argv)
    if args.repeat < 1 or args.chunk_size_mb < 1 or args.concurrency < 1:
        p.error("--repeat, --chunk-size-mb and --concurrency must be >= 1")
    return args


def start_services(bench: Bench, checkpoint: Path, files: list[Path]) -> tuple[str, str, str | None]:
    """moto (the folder put into it) and the static server: (moto endpoint, folder URL, S3's sha256)."""
    prefix = checkpoint.name
    moto = start_moto(bench.procs, bench.logs / "moto_server.log", bench.scratch, 120.0)
    print(f"moto: {moto}; putting {len(files)} files into s3://{BUCKET}/{prefix}/ ...", flush=True)
    started = time.perf_counter()
    sha256 = upload_folder(moto, checkpoint, prefix)
    print(f"  uploaded in {time.perf_counter() - started:.1f} s; S3 reports ChecksumSHA256 "
          f"{sha256 or 'NONE'} for {files[-1].name}")
    url = start_static_server(bench.procs, checkpoint, prefix, bench.logs / "static_server.log", 120.0)
    print(f"static server: {url} (Range: 206)")
    return moto, url, sha256


def prepare_ferrum(bench: Bench, moto: str) -> None:
    """The variants, their environments (checked: see check_variant) and Ferrum's --config file."""
    args = bench.args
    bench.ferrum = shlex.split(args.ferrum) if args.ferrum else [sys.executable, "-m", "ferrum.cli"]
    bench.variants = parse_variants(args)
    bench.envs = {v.name: ferrum_env(v, aws_env(moto, bench.scratch)) for v in bench.variants}
    for variant in bench.variants:
        package = check_variant(bench.ferrum, variant, bench.envs[variant.name],
                                bench.logs / f"check-{variant.name}.log")
        imports = f", imports {package}" if package else ""
        print(f"variant {variant.name}: {shlex.join(bench.ferrum)} in {variant.cwd} "
              f"(PYTHONPATH={variant.pythonpath}, git {variant.revision or '?'}{imports})")
    bench.config = bench.scratch / "ferrum-weights.yaml"
    write_ferrum_config(bench.config, args.chunk_size_mb, args.concurrency)
    print(f"chunks: {args.chunk_size_mb} MiB, {args.concurrency} in flight (Ferrum's --config weights: and "
          f"boto3's TransferConfig); page cache left as it is (not dropped); sync before each measurement; "
          f"{args.repeat} repeat(s); a fresh, empty --cache-dir for each cold start", flush=True)


def run(bench: Bench) -> dict[str, Any]:
    args = bench.args
    parse_variants(args)  # bad --variant flags fail before the checkpoint is made
    cpu = cpu_info()
    checkpoint = ensure_checkpoint(args.work_dir, bench.logs)
    files = checkpoint_files(checkpoint)
    total = describe_machine(cpu, checkpoint, files)
    load_before = os.getloadavg()[0]
    moto, url, sha256 = start_services(bench, checkpoint, files)
    prepare_ferrum(bench, moto)

    prefix, chunk = checkpoint.name, args.chunk_size_mb * MiB
    plains: dict[str, tuple[str, str, PlainRun]] = {
        "s3": (f"s3://{BUCKET}/{prefix}", "boto3 download_file",
               lambda dest: plain_s3(moto, prefix, files, dest, chunk, args.concurrency)),
        "url": (url, "aiohttp 1 GET/file", lambda dest: plain_url(url, files, dest)),
    }
    results = Results()
    for source in args.sources:
        model, plain_name, plain = plains[source]
        print(f"{source}: {model}", flush=True)
        bench_source(bench, source, model, plain, plain_name, results)

    rows = summary_rows(results, args.sources, bench.variants)
    load_after = os.getloadavg()[0]
    print()
    print_table(rows)
    print(TABLE_NOTES)
    print(f"1-minute load average: {load_before:.2f} before, {load_after:.2f} after (the benchmark's own "
          f"work counts; a neighbour's would distort the times)")
    return {
        "benchmark": "cold start: spawn of ferrum serve -> first 200 on GET /health",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpu": cpu, "python": sys.version.split()[0],
        "checkpoint": {"path": str(checkpoint), "shape": SHAPE, "bytes": total,
                       "files": {p.name: p.stat().st_size for p in files}},
        "settings": {
            "repeat": args.repeat, "sources": args.sources, "chunk_size_mb": args.chunk_size_mb,
            "concurrency": args.concurrency, "ferrum": bench.ferrum,
            "page_cache": "left as it is (not dropped)",
            "s3_checksum_sha256": sha256, "poll_interval_s": POLL_S,
            "serve_flags": serve_command([], "MODEL", Path("CONFIG"), Path("CACHE"), 0)[1:],
        },
        "variants": [{**asdict(v), "cwd": str(v.cwd), "pythonpath": str(v.pythonpath)}
                     for v in bench.variants],
        "loadavg_1min": {"before": load_before, "after": load_after},
        "starts": [asdict(s) for s in results.starts],
        "plain": [{**asdict(p), "download_load_s": p.download_load_s,
                   "download_load_touch_s": p.download_load_touch_s} for p in results.plain],
        "summary": rows,
        "logs": str(bench.logs),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run_dir = args.work_dir / "runs" / f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    bench = Bench(args, Processes(), logs=run_dir / "logs", scratch=run_dir / "scratch")
    for folder in (bench.logs, bench.scratch):
        folder.mkdir(parents=True, exist_ok=True)
    if not args.keep:
        atexit.register(shutil.rmtree, bench.scratch, ignore_errors=True)
    atexit.register(bench.procs.stop_all)  # registered last: runs first, before the scratch folder goes
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    signal.signal(signal.SIGHUP, _exit_on_sigterm)
    try:
        report = run(bench)
    except BenchError as exc:
        print(f"\nbench_cold_start: error: {exc}", file=sys.stderr)
        print(f"logs: {bench.logs}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nbench_cold_start: interrupted; stopping the servers", file=sys.stderr)
        return 130
    out = args.output_json or run_dir / "results.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"raw timings: {out}; logs: {bench.logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
