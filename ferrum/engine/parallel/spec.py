"""`RankSpec`: what every rank of a tensor-parallel model builds its shard from, as rank 0 resolved
it (picklable: each worker receives it over its connection), and which device each rank runs on."""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

import torch

from ferrum.engine.config import EngineConfig
from ferrum.models.config import ModelConfig
from ferrum.weights.locations.model_files import ModelFiles
from ferrum.weights.spec.loader_config import WeightLoaderConfig


@dataclass(frozen=True)
class RankSpec:
    size: int  # ranks
    backend: str  # the registered backend rank 0 runs on, e.g. "cpu", "cuda:0" (rank r's: device_for_rank)
    config: EngineConfig  # its device defaults filled in
    model_config: ModelConfig
    dtype: torch.dtype  # what the weights and activations are kept in
    max_model_len: int
    files: ModelFiles  # complete: every rank reads its shards from the same local files
    weights: WeightLoaderConfig
    dist_url: str  # where the ranks meet to join torch.distributed
    log_level: int = logging.INFO


def device_for_rank(backend: str, rank: int) -> str:
    """Rank r's device (and backend): the r-th device after rank 0's (cuda:0 -> cuda:r); the CPU's
    ranks share it."""
    if backend.startswith("cuda"):
        base = int(backend.split(":")[1]) if ":" in backend else 0
        return f"cuda:{base + rank}"
    return backend


def local_dist_url() -> str:
    """A torch.distributed rendezvous on a free port of this host."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"
