"""Tensor parallelism on the CPU with gloo, world size 2: every family's logits equal the
single-process model's within float32 tolerance, greedy outputs are equal, each rank reads about
half of the weight bytes, an impossible split stops start-up with a clear message, and a rank that
dies takes the server down instead of leaving it hanging."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from ferrum.engine.observer import StepRecord
from ferrum.engine.sampling_params import SamplingParams
from ferrum.models.config import load_model_config
from ferrum.models.layers.parallel import ShardingError, ShardPlan
from tests.engines import local_engine
from tests.live_server import server_process
from tests.tiny_model import COMMON, FAMILIES, save_hf_model, tiny_config

PROMPTS = [[5, 17, 42, 7, 99, 3, 250, 11, 64, 8, 301, 2, 77], [400, 1, 2, 3], [9] * 21]


def _run(engine, prompts: list[list[int]], max_tokens: int = 6) -> tuple[list[list[int]], list[torch.Tensor]]:
    records: list[StepRecord] = []
    remove = engine.add_observer(records.append)
    try:
        outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    finally:
        remove()
    return outs, [r.logits.clone() for r in records if r.logits is not None and r.logits.numel()]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    out = {}
    for family in FAMILIES:
        save_hf_model(root / family, tiny_config(family), demo_tokenizer=True)
        out[family] = root / family
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_two_ranks_match_one_process(folders: dict[str, Path], family: str) -> None:
    settings: dict[str, Any] = dict(
        dtype="float32", max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory_gb=0.01)
    single = local_engine(folders[family], **settings)
    try:
        want_tokens, want_logits = _run(single, PROMPTS)
        total_read = single.weight_load.bytes_read
    finally:
        single.release()
    split = local_engine(folders[family], tensor_parallel_size=2, **settings)
    try:
        got_tokens, got_logits = _run(split, PROMPTS)
        reports = split.rank_reports
    finally:
        split.release()
    assert got_tokens == want_tokens
    assert len(got_logits) == len(want_logits)
    for got, want in zip(got_logits, want_logits, strict=True):
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-4)
    # each rank read about half of the checkpoint (norms, and the KV heads of a model with fewer
    # KV heads than ranks, are read by both)
    assert total_read > 0 and len(reports) == 2
    kv_heads = load_model_config(folders[family]).num_kv_heads
    for report in reports:
        share = report.bytes_read / total_read
        assert 0.45 < share < (0.60 if kv_heads < 2 else 0.52), (family, share)
        assert report.nbytes < 0.6 * single.weight_load.nbytes


def test_impossible_splits_are_refused_before_loading(folders: dict[str, Path]) -> None:
    config = load_model_config(folders["smollm2-like"])  # 6 heads, 2 KV heads
    with pytest.raises(ShardingError, match="does not divide the model's 6 attention heads"):
        ShardPlan.check(config, 4)
    with pytest.raises(ShardingError, match="3 and the model's 2 KV heads"):
        ShardPlan.check(load_model_config(folders["llama2-mha"]).__class__(
            **{**config.__dict__, "num_heads": 6, "num_kv_heads": 2, "intermediate_size": 120}), 3)
    odd = folders["llama2-mha"].parent / "three-kv-heads"
    transformers = pytest.importorskip("transformers")
    six_heads = {**COMMON, "num_attention_heads": 6, "hidden_size": 96}
    save_hf_model(odd, transformers.LlamaConfig(**six_heads, num_key_value_heads=3), demo_tokenizer=True)
    with pytest.raises(ShardingError, match="tensor_parallel_size=2 and the model's 3 KV heads"):
        local_engine(odd, dtype="float32", tensor_parallel_size=2, kv_cache_memory_gb=0.01)


def test_more_ranks_than_devices_names_the_backends(folders: dict[str, Path]) -> None:
    cores = os.cpu_count() or 1
    result = subprocess.run(
        [".venv/bin/ferrum", "serve", "--model", str(folders["llama2-mha"]), "--backend", "cpu",
         "--tensor-parallel-size", str(cores * 4), "--failed-start-linger", "0", "--port", "0"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[3],
    )
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"requires tensor parallelism over {cores * 4} devices, can span {cores}" in result.stderr, \
        result.stderr[-2000:]


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _descends_from(pid: int, ancestor: int) -> bool:
    while pid > 1:
        try:
            pid = _parent(pid)
        except (FileNotFoundError, ProcessLookupError):
            return False
        if pid == ancestor:
            return True
    return False


@pytest.mark.slow
@pytest.mark.parametrize("engine_process", ["off", "on"])
def test_a_rank_that_dies_takes_the_server_down(folders: dict[str, Path], engine_process: str) -> None:
    """With the engine on a thread of the server (the CPU's default) the workers are the server's
    children; with the engine in a process of its own (the GPU's default) they are that process's,
    and the server must notice its engine process ending."""
    with server_process("--model", str(folders["llama2-mha"]), "--backend", "cpu", "--dtype", "float32",
                        "--tensor-parallel-size", "2", "--kv-cache-memory-gb", "0.01",
                        "--engine-process", engine_process) as server:
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200
        workers = subprocess.run(["pgrep", "-f", "ferrum.engine.parallel.worker"], capture_output=True,
                                 text=True)
        mine = [int(pid) for pid in workers.stdout.split() if _descends_from(int(pid), server.proc.pid)]
        assert len(mine) == 1, workers.stdout
        os.kill(mine[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while server.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert server.proc.returncode == 1, server.log()[-3000:]
        log = server.log()
        assert "tensor-parallel rank 1" in log and "exited with status -9" in log, log[-3000:]


@pytest.mark.slow
def test_bench_offline_at_tensor_parallel_size_2(folders: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "offline.json"
    result = subprocess.run(
        [sys.executable, "-m", "ferrum.cli", "bench", "offline", "--model", str(folders["llama2-mha"]),
         "--backend", "cpu", "--dtype", "float32", "--tensor-parallel-size", "2", "--kv-cache-memory-gb", "0.01",
         "--num-prompts", "4", "--input-len", "4:16", "--output-len", "2:6", "--output-json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["engine"]["tensor_parallel_size"] == 2
    assert report["num_requests"] == 4
    assert report["output_tokens_as_requested"] is True
