"""Tensor parallelism across processes: rank 0 is the engine (scheduler, sampler, outputs), ranks
1..N-1 are worker processes started here (`python -m ferrum.engine.tp_worker`), one per device.

    RankSpec        what a worker needs to build its rank: picklable, sent over its connection
    RankGroup       rank 0's handle: starts the workers, joins torch.distributed with them (NCCL on
                    CUDA, gloo on the CPU), agrees on the KV cache size, then sends each step to
                    them; a watcher thread reads their messages and notices a worker that dies
    MirroredRunner  rank 0's ModelRunner: every call (a step, a greedy burst, its read) goes to the
                    workers first, as a small snapshot of the sequences, then to the local runner;
                    each worker replays it on its own runner, and the collectives inside the model
                    keep the ranks in step

A worker that fails to start sends its error; one that dies takes the server down with a message
naming it (the other ranks would otherwise wait in a collective forever).
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener
from typing import Any

import torch

from ferrum.engine.config import EngineConfig
from ferrum.engine.runner import GreedyBurst, ModelRunner
from ferrum.engine.sampling_params import SamplingParams
from ferrum.engine.scheduler import ScheduledSequence
from ferrum.engine.sequence import Sequence
from ferrum.engine.startup import WeightLoadReport
from ferrum.models.layers.parallel import TensorParallel
from ferrum.weights.model_files import ModelFiles
from ferrum.weights.spec import WeightLoaderConfig

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 120.0  # a worker imports torch before it connects


class TensorParallelError(RuntimeError):
    """A rank could not start, or died."""


@dataclass(frozen=True)
class RankSpec:
    rank: int
    size: int
    backend: str  # the registered backend the worker opens, e.g. "cpu", "cuda:1"
    device: str
    config: EngineConfig
    files: ModelFiles
    weights: WeightLoaderConfig
    dist_url: str
    log_level: int = logging.INFO
    threads: int = 0  # CPU: torch threads of the worker (0: torch's default)


# A sequence as a worker's runner needs it: id, tokens computed, total tokens, the tokens from the
# first uncomputed one on, the block table.
Snapshot = tuple[str, int, int, list[int], list[int]]


def snapshot(seq: Sequence) -> Snapshot:
    start = seq.num_computed_tokens
    return (seq.request_id, start, seq.num_tokens, seq.tokens(start, seq.num_tokens), list(seq.block_table))


_MIRROR_PARAMS = SamplingParams(max_tokens=1)


def mirror(snap: Snapshot) -> Sequence:
    """A stand-in Sequence on a worker: right counts, block table and uncomputed tokens (the
    computed ones are in the KV cache and never read again)."""
    request_id, computed, total, tokens, block_table = snap
    prompt = [0] * computed + tokens
    prompt += [0] * (total - len(prompt))
    seq = Sequence(request_id, prompt, _MIRROR_PARAMS, 0.0)
    seq.num_computed_tokens = computed
    seq.block_table = block_table
    return seq


def device_for_rank(backend: str, rank: int) -> str:
    """Rank r's device: the r-th device after the selected one (cuda:0 -> cuda:r); the CPU's ranks share it."""
    if backend.startswith("cuda"):
        base = int(backend.split(":")[1]) if ":" in backend else 0
        return f"cuda:{base + rank}"
    return backend


@dataclass
class _Worker:
    rank: int
    process: subprocess.Popen[bytes]
    conn: Connection
    inbox: queue.Queue[Any] = field(default_factory=queue.Queue)


class RankGroup:
    def __init__(self, workers: list[_Worker], size: int) -> None:
        self.workers = workers
        self.size = size
        self.serving = False  # after start-up a dead worker ends the process
        self.closing = False
        self.failure: str | None = None
        self._send_lock = threading.Lock()
        self._watchers = [threading.Thread(target=self._watch, args=(w,), name=f"ferrum-tp-watch-{w.rank}",
                                           daemon=True) for w in workers]
        for t in self._watchers:
            t.start()

    # -- start-up ------------------------------------------------------------------------------
    @classmethod
    def start(cls, size: int, backend: str, config: EngineConfig, files: ModelFiles,
              weights: WeightLoaderConfig, threads: int = 0) -> tuple[RankGroup, str]:
        """Starts ranks 1..size-1 and hands each its RankSpec; returns the group and the
        torch.distributed URL every rank joins."""
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        dist_url = f"tcp://127.0.0.1:{_free_port()}"
        workers: list[_Worker] = []
        procs: dict[int, subprocess.Popen[bytes]] = {}
        try:
            for rank in range(1, size):
                host, port = listener.address
                procs[rank] = subprocess.Popen(
                    [sys.executable, "-m", "ferrum.engine.tp_worker", f"{host}:{port}", authkey.hex(), str(rank)],
                    stdin=subprocess.DEVNULL, start_new_session=False,
                )
            listener._listener._socket.settimeout(CONNECT_TIMEOUT_S)  # noqa: SLF001 - no public timeout
            while len(workers) < size - 1:
                try:
                    conn = listener.accept()
                except (TimeoutError, socket.timeout):
                    raise TensorParallelError(f"tensor-parallel workers did not connect within {CONNECT_TIMEOUT_S:g} s") from None
                rank = conn.recv()
                spec = RankSpec(rank, size, device_for_rank(backend, rank), device_for_rank(backend, rank), config,
                                files, weights, dist_url, logging.getLogger().getEffectiveLevel(), threads)
                conn.send(spec)
                workers.append(_Worker(rank, procs[rank], conn))
        except BaseException:
            for p in procs.values():
                p.kill()
            raise
        finally:
            listener.close()
        workers.sort(key=lambda w: w.rank)
        return cls(workers, size), dist_url

    def join(self, device_kind: str, dist_url: str, device: torch.device | None = None,
             one_shot_bytes: int = 0, pdl: bool = False, push: bool = True) -> TensorParallel:
        """Rank 0 joins torch.distributed (the workers join at the same time)."""
        return init_distributed(0, self.size, device_kind, dist_url, device, one_shot_bytes, pdl, push)

    def agree_blocks(self, num_blocks: int) -> int:
        """The smallest KV cache any rank can hold; every worker is told it."""
        sizes = [num_blocks] + [self._expect(w, "blocks") for w in self.workers]
        smallest = min(sizes)
        log.info("tensor parallel: KV blocks each rank can hold %s; using %d", sizes, smallest)
        self.send(("blocks", smallest))
        return smallest

    def wait_ready(self) -> list[WeightLoadReport]:
        """Every worker's weight-load report once its rank is built."""
        reports = [self._expect(w, "ready") for w in self.workers]
        self.serving = True
        return reports

    def _expect(self, worker: _Worker, kind: str) -> Any:
        while True:
            try:
                message = worker.inbox.get(timeout=1.0)
            except queue.Empty:
                if self.failure:
                    raise TensorParallelError(self.failure) from None
                continue
            if message[0] == kind:
                return message[1]
            if message[0] == "failed":
                raise TensorParallelError(f"tensor-parallel rank {worker.rank} failed to start: {message[1]}")

    # -- serving -------------------------------------------------------------------------------
    def send(self, command: tuple[Any, ...]) -> None:
        with self._send_lock:
            for w in self.workers:
                try:
                    w.conn.send(command)
                except (BrokenPipeError, ConnectionResetError, EOFError, OSError):
                    self._died(w)

    def _watch(self, worker: _Worker) -> None:
        """Reads the worker's messages into its inbox; its end of the connection closing means it exited."""
        while True:
            try:
                message = worker.conn.recv()
            except (EOFError, OSError):
                break
            worker.inbox.put(message)
            if message[0] == "failed":
                self.failure = f"tensor-parallel rank {worker.rank} failed to start: {message[1]}"
                self._stop_workers()
                return
        self._died(worker)

    def _died(self, worker: _Worker) -> None:
        if self.closing:
            return
        try:
            code = worker.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            code = None
        message = (f"tensor-parallel rank {worker.rank} (pid {worker.process.pid}) "
                   f"{'exited with status ' + str(code) if code is not None else 'closed its connection'}")
        if self.failure is None:
            self.failure = message
        self._stop_workers()
        if self.serving:  # the other ranks would wait for it in a collective forever
            log.critical("%s: the model is split across every rank, so the server cannot go on; stopping", message)
            logging.shutdown()
            os._exit(1)
        log.error("%s during start-up", message)

    def _stop_workers(self) -> None:
        for w in self.workers:
            if w.process.poll() is None:
                w.process.kill()

    def close(self) -> None:
        """Stops every worker (asked first, then killed) and leaves torch.distributed, at the same
        time as the workers leave it: NCCL's teardown on a rank can wait for the others' (waiting for
        the workers to exit first took the whole 10 s grace on 2 H200s, every time)."""
        self.closing = True
        self.send(("stop",))
        leaving = threading.Thread(target=leave_distributed, name="ferrum-tp-leave", daemon=True)
        leaving.start()
        deadline = time.monotonic() + 10
        for w in self.workers:
            try:
                w.process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel rank %d did not stop in 10 s; killing it", w.rank)
                w.process.kill()
                w.process.wait()
            w.conn.close()
        leaving.join(max(0.1, deadline - time.monotonic()))
        if leaving.is_alive():
            log.warning("torch.distributed did not shut down in 10 s; going on without it")


def init_distributed(rank: int, size: int, device_kind: str, dist_url: str,
                     device: torch.device | None = None, one_shot_bytes: int = 0, pdl: bool = False,
                     push: bool = True) -> TensorParallel:
    """Joins torch.distributed as `rank` of `size`; on CUDA `device` is this rank's GPU (NCCL binds
    to it), and sums of up to `one_shot_bytes` go through the peer-mapped one-shot kernel where
    every rank can have it (the same choice on every rank: ferrum.engine.peer_all_reduce; launched
    with programmatic dependent launch when `pdl`; pushing to the peers when `push`, else pulling)."""
    import datetime

    import torch.distributed as dist

    backend = "nccl" if device_kind == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=dist_url, rank=rank, world_size=size,
                            timeout=datetime.timedelta(minutes=30), device_id=device)
    reduce = None
    if backend == "nccl" and device is not None and one_shot_bytes > 0:
        from ferrum.engine.peer_all_reduce import peer_all_reduce

        reduce = peer_all_reduce(dist.group.WORLD, device, one_shot_bytes, pdl, push)
    return TensorParallel(rank, size, dist.group.WORLD, backend, reduce)


def leave_distributed() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class _Burst:
    inner: GreedyBurst
    id: int

    @property
    def steps(self) -> int:
        return self.inner.steps


class MirroredRunner:
    """Rank 0's runner: each call replayed on every worker's runner, then run here."""

    def __init__(self, local: ModelRunner, group: RankGroup) -> None:
        self.local = local
        self.group = group
        self.max_burst = local.max_burst
        self._next_burst = 0

    def execute(self, scheduled: list[ScheduledSequence]) -> tuple[torch.Tensor, list[Sequence]]:
        self.group.send(("execute", [(snapshot(s.seq), s.num_new_tokens) for s in scheduled]))
        return self.local.execute(scheduled)

    def launch_greedy(self, seqs: list[Sequence], steps: int, continue_at: list[int] | None = None) -> GreedyBurst:
        self._next_burst += 1
        self.group.send(("launch", self._next_burst, [snapshot(s) for s in seqs], steps, continue_at))
        return _Burst(self.local.launch_greedy(seqs, steps, continue_at), self._next_burst)

    def read_greedy(self, burst: GreedyBurst) -> list[list[int]]:
        assert isinstance(burst, _Burst)
        self.group.send(("read", burst.id))
        return self.local.read_greedy(burst.inner)

    def release(self) -> None:
        self.group.send(("release",))
        self.local.release()
        self.group.close()


def serve_commands(recv: Callable[[], tuple[Any, ...]], runner: ModelRunner) -> None:
    """A worker's loop: replays rank 0's runner calls until told to stop."""
    bursts: dict[int, GreedyBurst] = {}
    while True:
        command = recv()
        kind = command[0]
        if kind == "execute":
            runner.execute([ScheduledSequence(mirror(snap), n) for snap, n in command[1]])
        elif kind == "launch":
            _, burst_id, snaps, steps, continue_at = command
            bursts[burst_id] = runner.launch_greedy([mirror(s) for s in snaps], steps, continue_at)
        elif kind == "read":
            runner.read_greedy(bursts.pop(command[1]))
        elif kind == "release":
            runner.release()
        elif kind == "stop":
            return


def watch_parent() -> None:
    """A worker exits when the process that started it is gone (it would otherwise wait forever)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="ferrum-tp-parent", daemon=True).start()


__all__ = [
    "MirroredRunner",
    "RankGroup",
    "RankSpec",
    "TensorParallelError",
    "device_for_rank",
    "init_distributed",
    "leave_distributed",
    "mirror",
    "serve_commands",
    "snapshot",
    "watch_parent",
]
