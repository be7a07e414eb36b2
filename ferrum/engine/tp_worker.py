"""A tensor-parallel worker: rank r of N, started by rank 0 (ferrum.engine.tensor_parallel).

    python -m ferrum.engine.tp_worker HOST:PORT AUTHKEY_HEX RANK

It connects back, receives its RankSpec, opens its device through the backend registry, joins
torch.distributed, builds its `ModelRank` (its shard of the weights, its part of the KV cache) in
step with rank 0, then replays rank 0's runner calls until told to stop. It never outlives rank 0.
"""

from __future__ import annotations

import logging
import sys
from multiprocessing.connection import Client

import torch


def main(argv: list[str]) -> int:
    address, authkey, rank = argv
    host, port = address.rsplit(":", 1)
    conn = Client((host, int(port)), authkey=bytes.fromhex(authkey))
    conn.send(int(rank))
    spec = conn.recv()

    from ferrum.engine.tensor_parallel import (
        RankSpec,
        init_distributed,
        leave_distributed,
        serve_commands,
        watch_parent,
    )

    assert isinstance(spec, RankSpec)
    watch_parent()
    logging.basicConfig(level=spec.log_level, format=f"%(asctime)s %(levelname)s rank{spec.rank} %(name)s: %(message)s")
    if spec.threads:
        torch.set_num_threads(spec.threads)
    try:
        from ferrum.engine.builder import EngineSpec, open_device
        from ferrum.engine.model_rank import ModelRank
        from ferrum.models.config import load_model_config
        from ferrum.models.loader import run_sync

        _, device = run_sync(open_device(EngineSpec(spec.config, spec.backend, spec.device, spec.files, spec.weights)))
        if device.kind == "cuda":  # CUDA graphs and NCCL work on the current device
            torch.cuda.set_device(device.torch_device)
        config = spec.config.for_device(device)
        model_config = load_model_config(spec.files.folder)
        tp = init_distributed(spec.rank, spec.size, device.kind, spec.dist_url,
                              device.torch_device if device.kind == "cuda" else None,
                              config.kernels.one_shot_all_reduce_kb * 1024, config.kernels.pdl and device.pdl,
                              config.kernels.one_shot_push)

        def agree_blocks(num_blocks: int) -> int:
            conn.send(("blocks", num_blocks))
            reply = conn.recv()
            return int(reply[1])

        dtype = config.serving_dtype(model_config.dtype, device)
        max_model_len = config.max_model_len  # rank 0 resolved it
        model_rank = ModelRank(config, device, model_config, spec.files, spec.weights, dtype, max_model_len, tp,
                               agree_blocks=agree_blocks)
        conn.send(("ready", model_rank.weight_load))
    except BaseException as exc:  # noqa: BLE001 - reported to rank 0, which names the rank
        logging.getLogger(__name__).exception("rank %d failed to start", spec.rank)
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
