"""A tensor-parallel worker: rank r of N, started by rank 0 (ferrum.engine.parallel.group).

    python -m ferrum.engine.parallel.worker HOST:PORT AUTHKEY_HEX RANK

It connects back, receives the `RankSpec`, opens its device through the backend registry, builds
its rank through the set-up path every rank takes (ferrum.engine.parallel.rank) in step with rank
0, then replays rank 0's runner calls until told to stop. It never outlives rank 0.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Client


def main(argv: list[str]) -> int:
    address, authkey, rank_arg = argv
    rank = int(rank_arg)
    host, port = address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(authkey))
    conn.send(rank)
    spec = conn.recv()

    from ferrum.engine.parallel.distributed import leave_distributed
    from ferrum.engine.parallel.mirror import serve_commands
    from ferrum.engine.parallel.spec import RankSpec, device_for_rank

    assert isinstance(spec, RankSpec)
    watch_parent()
    logging.basicConfig(level=spec.log_level,
                        format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    try:
        from ferrum.backends.registry import open_backend
        from ferrum.engine.parallel.rank import build_rank
        from ferrum.models.loader import run_sync

        device_name = device_for_rank(spec.backend, rank)
        _, device = run_sync(open_backend(device_name, device_name))

        def agree_blocks(num_blocks: int) -> int:
            conn.send(("blocks", num_blocks))
            reply = conn.recv()
            return int(reply[1])

        model_rank = build_rank(spec, rank, device, agree_blocks=agree_blocks)
        conn.send(("ready", model_rank.weight_load))
    except BaseException as exc:  # reported to rank 0, which names the rank
        logging.getLogger(__name__).exception("rank %d failed to start", rank)
        try:
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        return 1
    try:
        serve_commands(conn.recv, model_rank.runner)
    except EOFError:  # rank 0 is gone
        return 1
    finally:
        leave_distributed()
    return 0


def watch_parent() -> None:
    """A worker exits when the process that started it is gone (it would otherwise wait forever)."""
    parent = os.getppid()

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=watch, name="ferrum-tp-parent", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
