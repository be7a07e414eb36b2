"""Small-message all-reduce on one host's GPUs: NCCL against torch's symmetric-memory ops and
Ferrum's one-shot kernel (ferrum.engine.parallel.peer_all_reduce), eager and inside CUDA graphs.

    NCCL_NVLS_ENABLE=0 python scripts/allreduce_bench.py [--world 2] [--out DIR]

One process per GPU. Checks first (every size decode uses, many calls in one graph replayed with
fresh inputs, against NCCL's sums and across ranks), then times a graph of 64 back-to-back
all-reduces per size and method (median of replays, per call). Prints a table; DIR/allreduce.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import socket
import sys
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SIZES_KB = [8, 16, 32, 64, 128, 256, 512]
CALLS = 64  # all-reduces in one timed graph


def say(rank: int, *parts) -> None:
    if rank == 0:
        print(*parts, flush=True)


def graph_us(fn, rank: int, replays: int = 20) -> float:
    """Median per-call time of a graph of CALLS calls of fn, replayed in step on every rank."""
    import torch.distributed as dist

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    torch.cuda.synchronize()
    dist.barrier()
    graph.replay()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    torch.cuda.synchronize()
    dist.barrier()
    del graph
    return sorted(times)[len(times) // 2]


def eager_us(fn, iters: int = 200) -> float:
    import torch.distributed as dist

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def gpu(rank: int):
    """GPU `rank`'s `Device`, its backend initialised in this process as an engine's rank opens it."""
    from ferrum.backends.registry import open_backend
    from ferrum.models.loader import run_sync

    return run_sync(open_backend(f"cuda:{rank}", f"cuda:{rank}"))[1]


def check_fast(fast, rank: int, world: int, device: torch.device) -> dict:
    """Many calls of mixed sizes in one graph, replayed with fresh inputs: equal to NCCL's sums,
    and the same bits on every rank; eager calls between replays."""
    import torch.distributed as dist

    sizes = [4096, 4096, 8192, 1, 32768, 4096 * 8, 4096, 100, 4096 * 3, fast.max_bytes // 2] * 7
    sizes = sizes[:65]
    inputs = [torch.empty(n, dtype=torch.bfloat16, device=device) for n in sizes]
    work = [torch.empty_like(t) for t in inputs]

    def body():
        for src, dst in zip(inputs, work, strict=True):
            dst.copy_(src)
            fast(dst)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    worst, mismatched = 0.0, 0
    for round_ in range(6):
        gen = torch.Generator(device=device).manual_seed(1000 * round_ + rank)
        for t in inputs:
            t.copy_(torch.randn(t.shape, generator=gen, device=device, dtype=torch.float32) * 3)
        refs = [t.clone() for t in inputs]
        for r in refs:
            dist.all_reduce(r)
        for _ in range(5):
            graph.replay()
        if round_ % 2:  # eager calls between replays keep the counts in step too
            extra = [t.clone() for t in inputs[:7]]
            for e in extra:
                fast(e)
            for e, r in zip(extra, refs[:7], strict=True):
                worst = max(worst, float((e.float() - r.float()).abs().max()))
        torch.cuda.synchronize()
        for w, r in zip(work, refs, strict=True):
            diff = float((w.float() - r.float()).abs().max())
            worst = max(worst, diff)
        sums = torch.stack([w.float().sum() for w in work])
        gathered = [torch.empty_like(sums) for _ in range(world)]
        dist.all_gather(gathered, sums)
        mismatched += sum(int(not torch.equal(g, gathered[0])) for g in gathered)
    del graph
    return {"max_abs_diff_vs_nccl": worst, "ranks_disagreeing": mismatched}


def rank_main(rank: int, world: int, port: int, out: str) -> None:
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=device)
    group = dist.group.WORLD
    assert group is not None
    result: dict = {"torch": torch.__version__, "world": world, "rows": []}
    names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("symm_mem::"))
    say(rank, "torch", torch.__version__, "symm_mem ops:", " ".join(n.split("::")[1] for n in names))
    say(rank, "peer access:", [torch.cuda.can_device_access_peer(rank, p) for p in range(world) if p != rank],
        "TORCH_SYMM_MEM_DISABLE_MULTICAST", os.environ.get("TORCH_SYMM_MEM_DISABLE_MULTICAST"))
    result["symm_mem_ops"] = names

    import torch.distributed._symmetric_memory as symm_mem

    fast = None
    try:
        from ferrum.engine.parallel.peer_all_reduce import peer_all_reduce

        fast = peer_all_reduce(group, gpu(rank), 512 * 1024)
        say(rank, "ferrum peer all-reduce:", "available" if fast else "NOT available")
        if fast is not None:
            result["check"] = check_fast(fast, rank, world, device)
            say(rank, "ferrum check:", result["check"])
    except Exception:  # noqa: BLE001
        say(rank, "ferrum peer all-reduce FAILED:\n" + traceback.format_exc())
        print(f"rank {rank}:", traceback.format_exc(), flush=True)

    header = (f"{'KB':>5} {'nccl eager':>11} {'nccl graph':>11} {'torch 1shot':>12} {'torch 2shot':>12} "
              f"{'ferrum push':>12} {'ferrum pull':>12}  (us per call)")
    say(rank, header)
    for kb in SIZES_KB:
        n = kb * 1024 // 2
        row: dict[str, object] = {"kb": kb}
        x = torch.randn(n, dtype=torch.bfloat16, device=device)
        row["nccl_eager"] = eager_us(functools.partial(dist.all_reduce, x))
        row["nccl_graph"] = graph_us(functools.partial(dist.all_reduce, x), rank)
        for name, op in (("torch_one_shot", "one_shot"), ("torch_two_shot", "two_shot")):
            try:
                buf = symm_mem.empty(n, dtype=torch.bfloat16, device=device)
                symm_mem.rendezvous(buf, group.group_name)
                buf.copy_(x)
                ops = torch.ops.symm_mem
                if op == "one_shot":
                    if hasattr(ops, "one_shot_all_reduce_copy"):
                        fn = functools.partial(ops.one_shot_all_reduce_copy, buf, x, "sum", group.group_name)
                    else:
                        fn = functools.partial(ops.one_shot_all_reduce, buf, "sum", group.group_name)
                    got = fn()
                    ref = x.clone()
                    dist.all_reduce(ref)
                    row[name + "_diff"] = float((got.float() - ref.float()).abs().max())
                else:
                    fn = functools.partial(ops.two_shot_all_reduce_, buf, "sum", group.group_name)
                row[name] = graph_us(fn, rank)
            except Exception as exc:  # noqa: BLE001
                row[name] = None
                row[name + "_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        if fast is not None:
            y = x.clone()
            for push, name in ((True, "ferrum"), (False, "ferrum_pull")):
                fast.push = push
                row[name] = graph_us(functools.partial(fast, y), rank)
                row[name + "_eager"] = eager_us(functools.partial(fast, y))
            fast.push = True
        result["rows"].append(row)

        def fmt(v):
            return f"{v:.1f}" if isinstance(v, float) else "-"

        say(rank, f"{kb:>5} {fmt(row['nccl_eager']):>11} {fmt(row['nccl_graph']):>11} "
                  f"{fmt(row.get('torch_one_shot')):>12} {fmt(row.get('torch_two_shot')):>12} "
                  f"{fmt(row.get('ferrum')):>12} {fmt(row.get('ferrum_pull')):>12}"
                  + "".join(f"  {k}={v}" for k, v in row.items() if k.endswith("_error") or k.endswith("_diff")))
    if rank == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "allreduce.json").write_text(json.dumps(result, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def reinit_main(rank: int, world: int, ports: list[int], out: str) -> None:
    """Two process groups one after the other in the same processes (as two engines in one
    process): the fast path set up and checked in each, the first one's objects still alive."""
    import torch.distributed as dist

    from ferrum.engine.parallel.peer_all_reduce import peer_all_reduce

    torch.cuda.set_device(rank)
    device = torch.device("cuda", rank)
    kept = []
    for port in ports:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=device)
        fast = peer_all_reduce(dist.group.WORLD, gpu(rank), 512 * 1024)
        say(rank, f"group on port {port}: fast path", "available" if fast else "NOT available",
            check_fast(fast, rank, world, device) if fast else "")
        kept.append(fast)
        dist.barrier()
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--out", default="bench-results")
    ap.add_argument("--reinit", action="store_true", help="only check two groups one after the other")
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    import torch.multiprocessing as mp

    if args.reinit:
        mp.spawn(reinit_main, args=(args.world, [free_port(), free_port()], args.out), nprocs=args.world)
        return
    mp.spawn(rank_main, args=(args.world, free_port(), args.out), nprocs=args.world)


if __name__ == "__main__":
    main()
