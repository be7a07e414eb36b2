"""The tensor-parallel sum's seam and its GPU fast path.

On any machine: TensorParallel.all_reduce goes through the sum start-up chose (`reduce`), and the
one-shot setting is checked like the other kernel settings. With two GPUs (skipped otherwise): two
processes set up ferrum.engine.parallel.peer_all_reduce, whose sums (pushed and pulled) equal NCCL's, eagerly
and replayed in a CUDA graph with fresh inputs; a second group of the same name in the same processes falls back to
NCCL on both ranks instead of meeting the first one's store."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch

from ferrum.kernels.config import KernelConfig
from ferrum.models.layers.parallel import TensorParallel

ROOT = Path(__file__).resolve().parents[3]


def test_all_reduce_goes_through_the_chosen_sum() -> None:
    seen = []

    def fake_sum(x: torch.Tensor) -> torch.Tensor:
        seen.append(x)
        return x.mul_(2)

    tp = TensorParallel(rank=1, size=2, reduce=fake_sum)
    x = torch.ones(3)
    assert torch.equal(tp.all_reduce(x), torch.full((3,), 2.0)) and seen == [x]
    assert TensorParallel.single().all_reduce(x) is x  # one rank: nothing to sum


def test_one_shot_setting_is_checked() -> None:
    assert KernelConfig().one_shot_all_reduce_kb == 512
    assert KernelConfig().one_shot_push is True
    assert KernelConfig.from_mapping({"one_shot_push": False}).one_shot_push is False
    with pytest.raises(ValueError, match="one_shot_push"):
        KernelConfig(one_shot_push="yes")  # type: ignore[arg-type]
    assert KernelConfig.from_mapping({"one_shot_all_reduce_kb": 512}).one_shot_all_reduce_kb == 512
    for bad in (-1, True, 1 << 20):
        with pytest.raises(ValueError, match="one_shot_all_reduce_kb"):
            KernelConfig(one_shot_all_reduce_kb=bad)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, ports: list[int], failures) -> None:
    import torch.distributed as dist

    from ferrum.backends.registry import open_backend
    from ferrum.engine.parallel.peer_all_reduce import peer_all_reduce
    from ferrum.models.loader import run_sync

    try:
        torch.cuda.set_device(rank)
        _, gpu = run_sync(open_backend(f"cuda:{rank}", f"cuda:{rank}"))  # its Device: peer access probed
        device = gpu.torch_device
        kept = []
        for attempt, port in enumerate(ports):
            dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                                    device_id=device)
            fast = peer_all_reduce(dist.group.WORLD, gpu, 512 * 1024)
            if attempt == 1:
                assert fast is None, "a second group of the same name must fall back to NCCL"
            else:
                assert fast is not None, "two GPUs of one host should have the fast path"
                _check(fast, rank, device)
            kept.append(fast)
            dist.barrier()
            dist.destroy_process_group()
    except BaseException as exc:  # reported to the test
        failures.put(f"rank {rank}: {type(exc).__name__}: {exc}")
        raise


def _check(fast, rank: int, device: torch.device) -> None:
    """scripts/allreduce_bench.py's check: 65 sums of mixed sizes in one CUDA graph, replayed with
    fresh inputs and eager calls in between, against NCCL's sums and across ranks."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("allreduce_bench", ROOT / "scripts" / "allreduce_bench.py")
    assert spec is not None and spec.loader is not None
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    for push in (True, False, True):  # both ways, one after the other through the same buffers and counts
        fast.push = push
        result = bench.check_fast(fast, rank, 2, device)
        assert result == {"max_abs_diff_vs_nccl": 0.0, "ranks_disagreeing": 0}, (push, result)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_peer_all_reduce_on_two_gpus() -> None:
    import torch.multiprocessing as mp

    pytest.importorskip("triton")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    ctx = mp.get_context("spawn")
    failures = ctx.Queue()
    mp.start_processes(_rank, args=([_free_port(), _free_port()], failures), nprocs=2, start_method="spawn")
    assert failures.empty()
