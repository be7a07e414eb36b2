#!/usr/bin/env python
"""Weight loading benchmark: Ferrum's WeightLoader vs the reference loader of each source, in one run.

Not a test. Generates a SafeTensors file once (default 1 GiB of bf16: big 2-D tensors plus small 1-D
ones, like an LLM checkpoint) into --dir (default $FERRUM_CACHE/bench or ~/.cache/ferrum/bench), reused
by later runs with the same layout, then runs the suites asked for and prints a table (and --out JSON).

    python scripts/bench_weights.py                        # local suite, 1 GiB, best of 5
    python scripts/bench_weights.py --size-gb 0.25 --repeat 3
    python scripts/bench_weights.py --suites local --out bench-results/weights.json

Suite "local" (one file on local disk, page cache warm: the file is read once before timing):
  - ferrum          get_metadata + TensorSpecs for every tensor + load_tensors, from File(path)
  - ferrum(specs)   load_tensors alone, the specs built beforehand (a model knows its specs)
  - load_file       safetensors.torch.load_file(path)
  Both sides return CPU tensors backed by a mapping of the file (nothing read until used), so their
  "load" is the per-file and per-tensor overhead. The "+touch" rows add reading every byte of every
  tensor once (a one-thread copy into one preallocated buffer), the real cost of the first use of the
  weights; that part is the same memory-mapped page-cache read on both sides.
  GB/s = file bytes / best time (10^9 bytes per GB); ratio = load_file's best time / Ferrum's (> 1:
  Ferrum faster).

Remote suites (http, s3, hf; see "remote suites" below): each serves the file on 127.0.0.1 (an aiohttp
static server, moto, olah serving a git mirror) and times Ferrum's Url / S3 / HuggingFace source
against that source's plain client (aiohttp in one stream / boto3 download_file / hf_hub_download),
from a cold cache each run:

    python scripts/bench_weights.py --suites http s3 hf --repeat 3

The machine may be shared: the 1-minute load average before and after each suite is printed and
kept in the JSON; timings taken while it is high measured the neighbours too.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # this checkout's ferrum, not an installed one

from ferrum.weights import File, TensorSpec, WeightLoader, WeightLoaderConfig  # noqa: E402
from ferrum.weights.spec.loader_config import DEFAULT_CACHE_DIR  # noqa: E402

GB = 1e9


# -- results ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """`name`'s wall times (seconds) over the runs, for `nbytes` bytes of weights."""

    name: str
    times: tuple[float, ...]
    nbytes: int

    @property
    def best(self) -> float:
        return min(self.times)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.best / GB if self.best > 0 else float("inf")


@dataclass(frozen=True)
class Comparison:
    """Ferrum vs a reference on one workload. ratio > 1: Ferrum is faster."""

    suite: str
    workload: str
    ferrum: Timing
    reference: Timing

    @property
    def ratio(self) -> float:
        return self.reference.best / self.ferrum.best if self.ferrum.best > 0 else float("inf")


def best_of(
    repeat: int, run: Callable[[], object], *, before: Callable[[], None] | None = None
) -> tuple[float, ...]:
    """Wall times of `repeat` calls of `run` (each after `before()` and a GC, neither timed). What `run`
    returns is dropped after its timing, so each run starts from the same state."""
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        gc.collect()
        start = time.perf_counter()
        result = run()
        times.append(time.perf_counter() - start)
        del result
    return tuple(times)


def load_average() -> float:
    return os.getloadavg()[0]


# -- the file -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    size_gb: float
    tensor_mb: float
    small_per_big: int
    dtype: str

    @property
    def filename(self) -> str:
        return f"bench-{self.size_gb:g}g-{self.tensor_mb:g}m-{self.small_per_big}s-{self.dtype}.safetensors"


def ensure_file(folder: Path, layout: Layout) -> Path:
    """The benchmark file of `layout` in `folder`, written once (random values, so no page is zero)."""
    path = folder / layout.filename
    if path.is_file():
        return path
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    dtype = getattr(torch, layout.dtype)
    itemsize = dtype.itemsize
    side = int((layout.tensor_mb * 1024 * 1024 / itemsize) ** 0.5)
    big_bytes = side * side * itemsize
    count = max(1, int(layout.size_gb * 1024**3 // big_bytes))
    generator = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    print(
        f"writing {count} tensors of {side}x{side} {layout.dtype} (+{layout.small_per_big} small each) to {path}"
    )
    for i in range(count):
        tensors[f"layers.{i}.weight"] = torch.randn(side, side, generator=generator).to(dtype)
        for j in range(layout.small_per_big):
            tensors[f"layers.{i}.norm{j}.weight"] = torch.randn(side, generator=generator).to(dtype)
    tmp = path.with_suffix(".tmp")
    save_file(tensors, tmp)
    tmp.rename(path)
    return path


def warm_page_cache(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(64 * 1024 * 1024):
            pass


def touch_all(tensors: dict[str, torch.Tensor], scratch: torch.Tensor) -> None:
    """Read every byte of every tensor once: copy them, back to back, into `scratch` (uint8), in one
    thread (copies from several threads fault the same mapping concurrently and measure mostly the
    kernel's page-fault contention: 5-6x slower on a 2-core VM, for both loaders alike)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        offset = 0
        for tensor in tensors.values():
            flat = tensor.reshape(-1).view(torch.uint8)
            scratch[offset : offset + flat.numel()].copy_(flat)
            offset += flat.numel()
    finally:
        torch.set_num_threads(threads)


# -- suites ---------------------------------------------------------------------------------------------


def local_suite(args: argparse.Namespace, path: Path) -> list[Comparison]:
    from safetensors.torch import load_file

    size = path.stat().st_size
    warm_page_cache(path)
    loop = asyncio.new_event_loop()
    weights = WeightLoader(WeightLoaderConfig(cache_enabled=False, progress="off"))
    source = File(path)

    async def ferrum_all() -> dict[str, torch.Tensor]:
        meta = await weights.get_metadata(source)
        specs = [
            TensorSpec(name, shape, dtype, source=source) for name, (shape, dtype) in meta.tensors.items()
        ]
        return await weights.load_tensors(specs)

    meta = loop.run_until_complete(weights.get_metadata(source))
    specs = [TensorSpec(name, shape, dtype, source=source) for name, (shape, dtype) in meta.tensors.items()]
    ours = loop.run_until_complete(ferrum_all())
    theirs = load_file(path)
    assert list(ours) == list(meta.tensors) and set(ours) == set(theirs)
    for name in theirs:  # same values, before any timing
        assert torch.equal(ours[name], theirs[name]), name
    print(f"  {len(meta.tensors)} tensors, {size / GB:.3f} GB; checked equal to load_file's")
    del ours, theirs
    scratch = torch.empty(size, dtype=torch.uint8)
    scratch.fill_(0)  # fault the scratch pages in now, not in the timed runs

    def ferrum() -> object:
        return loop.run_until_complete(ferrum_all())

    def ferrum_specs() -> object:
        return loop.run_until_complete(weights.load_tensors(specs))

    def reference() -> object:
        return load_file(path)

    def with_touch(run: Callable[[], object]) -> Callable[[], object]:
        def go() -> object:
            tensors = run()
            assert isinstance(tensors, dict)
            touch_all(tensors, scratch)
            return tensors

        return go

    n = args.repeat
    comparisons = []
    for workload, ours_fn, label in [
        ("load", ferrum, "ferrum"),
        ("load, specs given", ferrum_specs, "ferrum(specs)"),
    ]:
        comparisons.append(
            Comparison(
                "local",
                workload,
                Timing(label, best_of(n, ours_fn), size),
                Timing("load_file", best_of(n, reference), size),
            )
        )
    comparisons.append(
        Comparison(
            "local",
            "load+touch",
            Timing("ferrum", best_of(n, with_touch(ferrum)), size),
            Timing("load_file", best_of(n, with_touch(reference)), size),
        )
    )
    loop.run_until_complete(weights.aclose())
    loop.close()
    return comparisons


# -- remote suites (http, s3, hf) -----------------------------------------------------------------------
#
# Each serves the benchmark file on 127.0.0.1 from a separate process (so the server does not share the
# client's GIL) and compares, on a cold cache each run (the caches are emptied before every timed run):
#   download   Ferrum's Downloader.fetch / hub_fetch (verified file in the cache) vs the plain client
#              writing the file (aiohttp in one stream / boto3 download_file / hf_hub_download)
#   load       Ferrum's WeightLoader.load_tensors on the remote source (download + tensors) vs the plain
#              client's download followed by safetensors.torch.load_file
# What Ferrum verifies: HTTP without a pinned sha256: the size (as the plain client); S3: the MD5 of a
# single-part ETag, the size for multipart uploads (boto3's upload_file uses multipart here, so: size);
# HF: the LFS sha256 (hf_hub_download checks only the size), so Ferrum does more work on that one.


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait_for_port(port: int, proc: object, timeout: float = 60.0) -> None:
    import socket
    import subprocess

    assert isinstance(proc, subprocess.Popen)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port} after {timeout:.0f} s")


def _stop(proc: object) -> None:
    import signal
    import subprocess

    assert isinstance(proc, subprocess.Popen)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _start(cmd: list[str], port: int) -> object:
    import subprocess

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        _wait_for_port(port, proc)
    except BaseException:
        _stop(proc)
        raise
    return proc


_STATIC_SERVER = """
import sys
from aiohttp import web
app = web.Application()
app.router.add_static("/", sys.argv[1])  # Range requests, sendfile
web.run_app(app, host="127.0.0.1", port=int(sys.argv[2]), print=None, access_log=None)
"""


def _empty(*folders: Path) -> Callable[[], None]:
    import shutil

    def go() -> None:
        for folder in folders:
            shutil.rmtree(folder, ignore_errors=True)

    return go


def _specs(loop: asyncio.AbstractEventLoop, source: object) -> list[TensorSpec]:
    """The TensorSpecs of every tensor of `source`, from its header (not timed)."""
    loader = WeightLoader(WeightLoaderConfig(cache_enabled=False, progress="off"))
    try:
        meta = loop.run_until_complete(loader.get_metadata(source))  # type: ignore[arg-type]
    finally:
        loop.run_until_complete(loader.aclose())
    return [TensorSpec(name, shape, dtype, source=source) for name, (shape, dtype) in meta.tensors.items()]  # type: ignore[arg-type]


def _ferrum_load(loop: asyncio.AbstractEventLoop, config: WeightLoaderConfig, specs: list[TensorSpec]) -> object:
    async def go() -> object:
        async with WeightLoader(config) as loader:
            return await loader.load_tensors(specs)

    return loop.run_until_complete(go())


def _plain_then_load_file(download: Callable[[], Path]) -> Callable[[], object]:
    def go() -> object:
        from safetensors.torch import load_file

        return load_file(download())

    return go


def _remote_config(args: argparse.Namespace, cache: Path) -> WeightLoaderConfig:
    return WeightLoaderConfig(cache_dir=cache, progress="off", chunk_size=int(args.chunk_mb * 1024 * 1024),
                              max_concurrent_downloads=args.concurrency)


def http_suite(args: argparse.Namespace, path: Path) -> list[Comparison]:
    import aiohttp

    from ferrum.weights import Url
    from ferrum.weights.download.downloader import Downloader
    from ferrum.weights.download.http import HttpObject

    size = path.stat().st_size
    work = path.parent / "remote-http"
    cache, plain = work / "cache", work / "plain"
    port = _free_port()
    server = _start([sys.executable, "-c", _STATIC_SERVER, str(path.parent), str(port)], port)
    url = f"http://127.0.0.1:{port}/{path.name}"
    loop = asyncio.new_event_loop()
    config = _remote_config(args, cache)
    try:
        async def aiohttp_download() -> Path:
            plain.mkdir(parents=True, exist_ok=True)
            out = plain / path.name
            async with aiohttp.ClientSession(auto_decompress=False) as session, session.get(url) as response:
                response.raise_for_status()
                with open(out, "wb") as f:  # noqa: ASYNC230 - the plain client, as people write it
                    async for block in response.content.iter_chunked(1 << 20):
                        f.write(block)
            assert out.stat().st_size == size
            return out

        async def ferrum_download() -> Path:
            obj = HttpObject(url, None, config)
            try:
                return await Downloader(config).fetch(obj)
            finally:
                await obj.aclose()

        specs = _specs(loop, Url(url))
        before = _empty(cache, plain)
        n = args.repeat
        return [
            Comparison("http", "download",
                       Timing("ferrum", best_of(n, lambda: loop.run_until_complete(ferrum_download()), before=before),
                              size),
                       Timing("aiohttp 1-stream", best_of(n, lambda: loop.run_until_complete(aiohttp_download()),
                                                          before=before), size)),
            Comparison("http", "load",
                       Timing("ferrum", best_of(n, lambda: _ferrum_load(loop, config, specs), before=before), size),
                       Timing("aiohttp+load_file", best_of(
                           n, _plain_then_load_file(lambda: loop.run_until_complete(aiohttp_download())),
                           before=before), size)),
        ]
    finally:
        loop.close()
        _stop(server)
        _empty(work)()


def s3_suite(args: argparse.Namespace, path: Path) -> list[Comparison]:
    import boto3

    from ferrum.weights import S3
    from ferrum.weights.download.downloader import Downloader
    from ferrum.weights.download.s3 import S3Object

    size = path.stat().st_size
    work = path.parent / "remote-s3"
    cache, plain = work / "cache", work / "plain"
    port = _free_port()
    moto = Path(sys.executable).with_name("moto_server")
    server = _start([str(moto), "-H", "127.0.0.1", "-p", str(port)], port)
    endpoint = f"http://127.0.0.1:{port}"
    for name, value in (("AWS_ACCESS_KEY_ID", "bench"), ("AWS_SECRET_ACCESS_KEY", "bench"),
                        ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(name, value)
    client = boto3.session.Session().client("s3", region_name="us-east-1", endpoint_url=endpoint)
    loop = asyncio.new_event_loop()
    config = _remote_config(args, cache)
    try:
        client.create_bucket(Bucket="bench")
        print("  uploading to moto ...")
        client.upload_file(str(path), "bench", path.name)
        source = S3("bench", path.name, "us-east-1", endpoint)

        def boto3_download() -> Path:
            plain.mkdir(parents=True, exist_ok=True)
            out = plain / path.name
            client.download_file("bench", path.name, str(out))
            return out

        async def ferrum_download() -> Path:
            return await Downloader(config).fetch(S3Object(source, config))

        specs = _specs(loop, source)
        before = _empty(cache, plain)
        n = args.repeat
        return [
            Comparison("s3", "download",
                       Timing("ferrum", best_of(n, lambda: loop.run_until_complete(ferrum_download()), before=before),
                              size),
                       Timing("boto3 download_file", best_of(n, boto3_download, before=before), size)),
            Comparison("s3", "load",
                       Timing("ferrum", best_of(n, lambda: _ferrum_load(loop, config, specs), before=before), size),
                       Timing("boto3+load_file", best_of(n, _plain_then_load_file(boto3_download), before=before),
                              size)),
        ]
    finally:
        loop.close()
        _stop(server)
        _empty(work)()


def hf_suite(args: argparse.Namespace, path: Path) -> list[Comparison]:
    import huggingface_hub

    from ferrum.weights import HuggingFace
    from ferrum.weights.hub.fetch import hub_fetch
    from tests.hub_mirror import HubMirror, olah_server

    size = path.stat().st_size
    work = path.parent / "remote-hf"
    _empty(work)()
    mirror = HubMirror(work / "olah")
    repo = mirror.create_repo("bench/weights")
    repo.put({"model.safetensors": path})  # an LFS pointer; the blob is a hard link to the file
    repo.commit("benchmark weights")
    ours, theirs, cache = work / "hf-ferrum", work / "hf-plain", work / "cache"
    loop = asyncio.new_event_loop()
    config = _remote_config(args, cache)
    saved = {k: os.environ.get(k) for k in ("HF_ENDPOINT", "HF_HOME", "HF_HUB_CACHE", "HF_HUB_OFFLINE",
                                            "HF_HUB_DISABLE_PROGRESS_BARS")}
    try:
        with olah_server(mirror) as server:
            os.environ.update(HF_ENDPOINT=server.endpoint, HF_HUB_DISABLE_PROGRESS_BARS="1")
            os.environ.pop("HF_HUB_OFFLINE", None)
            os.environ.pop("HF_HUB_CACHE", None)
            source = HuggingFace("bench/weights", "model.safetensors", cache_dir=ours)

            def plain_download() -> Path:
                return Path(huggingface_hub.hf_hub_download(
                    "bench/weights", "model.safetensors", cache_dir=theirs, endpoint=server.endpoint))

            specs = _specs(loop, source)
            before = _empty(ours, theirs, cache)
            n = args.repeat
            return [
                Comparison("hf", "download",
                           Timing("ferrum", best_of(n, lambda: loop.run_until_complete(hub_fetch(source, config)),
                                                    before=before), size),
                           Timing("hf_hub_download", best_of(n, plain_download, before=before), size)),
                Comparison("hf", "load",
                           Timing("ferrum", best_of(n, lambda: _ferrum_load(loop, config, specs), before=before),
                                  size),
                           Timing("hf_hub+load_file", best_of(n, _plain_then_load_file(plain_download),
                                                              before=before), size)),
            ]
    finally:
        loop.close()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        _empty(work)()


SUITES: dict[str, Callable[[argparse.Namespace, Path], list[Comparison]]] = {
    "local": local_suite,
    "http": http_suite,
    "s3": s3_suite,
    "hf": hf_suite,
}


def add_remote_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the remote suites (http, s3, hf)."""
    parser.add_argument("--chunk-mb", type=float, default=16.0, help="remote suites: Ferrum's chunk size, MiB")
    parser.add_argument("--concurrency", type=int, default=8, help="remote suites: Ferrum's chunks in flight")


# -- main -----------------------------------------------------------------------------------------------


def print_table(comparisons: list[Comparison]) -> None:
    print(
        f"\n{'suite':<7} {'workload':<18} {'ferrum s':>9} {'GB/s':>8}   "
        f"{'reference':<14} {'s':>9} {'GB/s':>8} {'ratio':>7}"
    )
    for c in comparisons:
        print(
            f"{c.suite:<7} {c.workload:<18} {c.ferrum.best:>9.4f} {c.ferrum.gbps:>8.2f}   "
            f"{c.reference.name:<14} {c.reference.best:>9.4f} {c.reference.gbps:>8.2f} {c.ratio:>7.2f}"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suites", nargs="+", default=["local"], choices=sorted(SUITES))
    ap.add_argument("--size-gb", type=float, default=1.0, help="size of the benchmark file, GiB")
    ap.add_argument("--tensor-mb", type=float, default=8.0, help="size of each big tensor, MiB")
    ap.add_argument("--small-per-big", type=int, default=2, help="small 1-D tensors per big one")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--dir", type=Path, default=None, help="where the file is kept (default: <cache>/bench)")
    ap.add_argument("--repeat", type=int, default=5, help="runs per measurement; the best is reported")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    add_remote_arguments(ap)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    layout = Layout(args.size_gb, args.tensor_mb, args.small_per_big, args.dtype)
    cache = Path(os.environ.get("FERRUM_CACHE") or DEFAULT_CACHE_DIR).expanduser()  # as `ferrum serve` takes it
    path = ensure_file(args.dir or cache / "bench", layout)
    results = []
    loads = {}
    for name in args.suites:
        before = load_average()
        print(f"suite {name} (load average {before:.2f})")
        comparisons = SUITES[name](args, path)
        loads[name] = {"before": before, "after": load_average()}
        print(f"  load average after: {loads[name]['after']:.2f}")
        results.extend(comparisons)
    print_table(results)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        payload = {
            "file": {"path": str(path), "bytes": path.stat().st_size, **asdict(layout)},
            "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
            "load_average": loads,
            "results": [
                {
                    **asdict(c),
                    "ratio": c.ratio,
                    "ferrum_gbps": c.ferrum.gbps,
                    "reference_gbps": c.reference.gbps,
                }
                for c in results
            ],
        }
        args.out.write_text(json.dumps(payload, indent=2))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
