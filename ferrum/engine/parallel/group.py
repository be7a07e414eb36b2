"""`RankGroup`: rank 0's handle on the worker processes of a tensor-parallel model (ranks 1..N-1,
`python -m ferrum.engine.parallel.worker`, one per device).

It starts the workers and hands each the `RankSpec`, settles the KV cache size with them, then
sends each of rank 0's runner calls to them (ferrum.engine.parallel.mirror); a watcher thread per
worker reads its messages and notices a worker that dies. A worker that fails to start sends its
error; one that dies takes the server down with a message naming it (the other ranks would
otherwise wait in a collective forever).
"""

from __future__ import annotations

import logging
import os
import queue
import secrets
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, Listener
from typing import Any

from ferrum.engine.parallel.distributed import leave_distributed
from ferrum.engine.parallel.errors import TensorParallelError
from ferrum.engine.parallel.spec import RankSpec
from ferrum.models.loader import WeightLoadReport

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 120.0  # a worker imports torch before it connects


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
    def start(cls, spec: RankSpec) -> RankGroup:
        """Starts ranks 1..size-1 and hands each the spec (they join torch.distributed at its URL)."""
        authkey = secrets.token_bytes(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        workers: list[_Worker] = []
        procs: dict[int, subprocess.Popen[bytes]] = {}
        try:
            for rank in range(1, spec.size):
                host, port = listener.address
                procs[rank] = subprocess.Popen(
                    [sys.executable, "-m", "ferrum.engine.parallel.worker", f"{host}:{port}", authkey.hex(),
                     str(rank)],
                    stdin=subprocess.DEVNULL, start_new_session=False,
                )
            # accept() has no public timeout
            listener._listener._socket.settimeout(CONNECT_TIMEOUT_S)  # type: ignore[attr-defined]
            while len(workers) < spec.size - 1:
                try:
                    conn = listener.accept()
                except TimeoutError:
                    raise TensorParallelError(
                        f"tensor-parallel workers did not connect within {CONNECT_TIMEOUT_S:g} s") from None
                rank = conn.recv()
                conn.send(spec)
                workers.append(_Worker(rank, procs[rank], conn))
        except BaseException:
            for p in procs.values():
                p.kill()
            raise
        finally:
            listener.close()
        workers.sort(key=lambda w: w.rank)
        return cls(workers, spec.size)

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
