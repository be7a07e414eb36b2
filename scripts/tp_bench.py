"""Tensor parallelism on one host's GPUs: correctness against TP 1 and batch-1 decode per TP size.

    NCCL_NVLS_ENABLE=0 python scripts/tp_bench.py --shapes llama-3.2-1b,llama-3.1-8b --tp 1,2 --out DIR

For each shape (a random checkpoint with the real shape, scripts/make_random_checkpoint.py) and each
TP size: greedy tokens and the sampled rows' logits of three prompts against TP 1 (bf16: reduction
order differs, so a bound rather than equality), then batch-1 decode ms/token (CUDA graphs, greedy
bursts) timed over whole engine steps, against the floor of one rank's weight bytes over the
measured copy bandwidth of one GPU. Prints one table and writes DIR/tp.json.

Small sums go through the one-shot kernel over peer-mapped buffers (--one-shot-kb, 512 here; 0:
NCCL). Only the first split engine of a process can have it (torch keeps a group name's peer-memory
store for the life of the process): each row says how its ranks summed. To time the one-shot path
of several shapes, run one shape per process.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_suite import copy_bandwidth, weight_bytes_read_per_token  # noqa: E402 - after the path

ROWS: list[dict] = []


def record(name: str, value, unit: str = "", note: str = "") -> None:
    ROWS.append({"name": name, "value": value, "unit": unit, "note": note})
    print(f"{name:60s} {value!s:>14} {unit:8s} {note}", flush=True)


ONE_SHOT_KB = 512  # --one-shot-kb: kernels.one_shot_all_reduce_kb of every engine here
ONE_SHOT_PUSH = True  # --one-shot-pull: kernels.one_shot_push false


def engine(folder: Path, tp: int, **overrides):
    from ferrum.engine.builder import create_engine
    from ferrum.kernels.config import KernelConfig

    settings: dict[str, Any] = dict(
        dtype="bfloat16", max_num_seqs=8, max_num_batched_tokens=2048, max_model_len=2048,
        gpu_memory_utilization=0.85, tensor_parallel_size=tp,
        kernels=KernelConfig(one_shot_all_reduce_kb=ONE_SHOT_KB, one_shot_push=ONE_SHOT_PUSH))
    return create_engine(str(folder), backend="cuda", **(settings | overrides))


def sums(eng) -> str:
    """How this engine's ranks sum: torch keeps peer memory set up under a group name for the life
    of the process, so only the first split engine of a process gets the one-shot kernel."""
    tp = getattr(getattr(eng, "rank", None), "tp", None)
    if tp is None:
        return "unknown"
    if tp.size == 1:
        return "one rank"
    if tp.reduce is None:
        return "NCCL"
    return f"one-shot kernel ({'push' if getattr(tp.reduce, 'push', False) else 'pull'})"


def greedy_with_logits(eng, prompts: list[list[int]], steps: int):
    from ferrum.engine.sampling_params import SamplingParams

    seen: list[torch.Tensor] = []

    def keep(record) -> None:  # copied now: a step's logits may live in a buffer the next step reuses
        if record.logits is not None and record.logits.numel():
            seen.append(record.logits.float().cpu())

    remove = eng.add_observer(keep)
    try:  # logprobs keep every step on the host's sampler, so each step's logits are observed
        outs = eng.generate(prompts, SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, logprobs=0))
    finally:
        remove()
    return outs, seen


def batch1_ms(eng, prompt_len: int = 128, new_tokens: int = 256) -> float:
    from ferrum.engine.sampling_params import SamplingParams

    rng = random.Random(1)
    vocab = eng.model_config.vocab_size
    eng.generate([[rng.randrange(vocab - 2) for _ in range(prompt_len)]],
                 SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    eng.add_request("b1", [rng.randrange(vocab - 2) for _ in range(prompt_len)],
                    SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    eng.step()
    torch.cuda.synchronize()
    started = time.perf_counter()
    tokens = 0
    while eng.has_work:
        tokens += sum(len(out.new_token_ids) for out in eng.step())
    return (time.perf_counter() - started) * 1e3 / tokens


def main() -> None:
    global ONE_SHOT_KB, ONE_SHOT_PUSH
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama-3.2-1b")
    ap.add_argument("--tp", default="1,2")
    ap.add_argument("--ckpt", type=Path, default=Path("/tmp/ferrum-ckpt"))
    ap.add_argument("--out", type=Path, default=Path("bench-results"))
    ap.add_argument("--eager", action="store_true", help="also time with enforce_eager")
    ap.add_argument("--unfused", action="store_true", help="also time TP 1 without the fused decode chain")
    ap.add_argument("--one-shot-kb", type=int, default=ONE_SHOT_KB,
                    help="kernels.one_shot_all_reduce_kb (0: NCCL for every sum)")
    ap.add_argument("--variants", action="store_true",
                    help="also time TP > 1 without the fused decode chain, with NCCL for every sum, and both")
    ap.add_argument("--one-shot-pull", action="store_true",
                    help="the one-shot kernel pulls the peers' data (kernels.one_shot_push false)")
    args = ap.parse_args()
    ONE_SHOT_KB = args.one_shot_kb
    ONE_SHOT_PUSH = not args.one_shot_pull
    args.out.mkdir(parents=True, exist_ok=True)
    sizes = [int(t) for t in args.tp.split(",")]
    record("machine", f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}", "",
           f"torch {torch.__version__}, {platform.python_version()}, "
           f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')}")
    bw = copy_bandwidth(2**29)
    record("copy bandwidth of one GPU (read+write)", round(bw / 1e9), "GB/s")
    rng = random.Random(0)
    for shape in args.shapes.split(","):
        folder = args.ckpt / shape
        if not (folder / "config.json").exists():
            subprocess.run([sys.executable, str(ROOT / "scripts/make_random_checkpoint.py"), "--shape", shape,
                            "--out", str(folder)], check=True)
        total = weight_bytes_read_per_token(folder)
        reference = None
        prompts = [[rng.randrange(1000, 30000) for _ in range(n)] for n in (7, 33, 120)]
        for tp in sizes:
            started = time.perf_counter()
            eng = engine(folder, tp)
            record(f"{shape} TP{tp} start-up", round(time.perf_counter() - started, 1), "s")
            try:
                outs, logits = greedy_with_logits(eng, prompts, 8)
                if reference is None:
                    reference = (outs, logits)
                else:
                    compare(f"{shape} TP{tp} vs TP1", (outs, logits), reference)
                ms = batch1_ms(eng)
                floor = total / tp / bw * 1e3  # as scripts/gpu_suite.py: weight bytes over the copy bandwidth
                record(f"{shape} TP{tp} batch-1 decode", round(ms, 3), "ms/token",
                       f"floor {floor:.3f} ms (weights/TP over one GPU's read bandwidth): {floor / ms:.1%}; "
                       f"sums: {sums(eng)}")
                if tp > 1 and reports(eng):
                    record(f"{shape} TP{tp} checkpoint bytes read per rank", reports(eng), "GB",
                           f"of {total / 1e9:.2f} GB")
            finally:
                eng.release()
                del eng
                torch.cuda.empty_cache()
            from ferrum.kernels.config import KernelConfig

            variants = {}
            if tp == 1 and args.unfused:  # the noise floor of the comparison: the same model through other kernels
                variants["no fused decode chain"] = KernelConfig(fused_decode_rows=0)
            if tp > 1 and args.variants:
                variants = {"no fused decode chain": KernelConfig(fused_decode_rows=0,
                                                                  one_shot_all_reduce_kb=args.one_shot_kb),
                            "NCCL for every sum": KernelConfig(one_shot_all_reduce_kb=0),
                            "no fused decode chain, NCCL for every sum (before)":
                                KernelConfig(fused_decode_rows=0, one_shot_all_reduce_kb=0)}
            for what, kernels in variants.items():
                eng = engine(folder, tp, kernels=kernels)
                try:
                    outs, logits = greedy_with_logits(eng, prompts, 8)
                    compare(f"{shape} TP{tp} {what} vs TP1", (outs, logits), reference)
                    ms = batch1_ms(eng)
                    floor = total / tp / bw * 1e3
                    record(f"{shape} TP{tp} batch-1 decode, {what}", round(ms, 3), "ms/token",
                           f"{floor / ms:.1%} of the floor; sums: {sums(eng)}")
                finally:
                    eng.release()
                    del eng
                    torch.cuda.empty_cache()
            if args.eager:
                eng = engine(folder, tp, enforce_eager=True)
                try:
                    record(f"{shape} TP{tp} batch-1 decode, eager", round(batch1_ms(eng), 3), "ms/token")
                finally:
                    eng.release()
                    del eng
                    torch.cuda.empty_cache()
    (args.out / "tp.json").write_text(json.dumps(ROWS, indent=1))


def compare(label: str, got, reference) -> None:
    """Logits of the same steps: the largest difference, relative to the logits' spread, and top-1."""
    (outs, logits), (ref_outs, ref_logits) = got, reference
    steps = min(len(logits), len(ref_logits))
    pairs = list(zip(logits[:steps], ref_logits[:steps], strict=True))
    err = max(float((a - b).abs().max()) for a, b in pairs)
    scale = max(float(b.std()) for b in ref_logits[:steps])
    top1 = sum(int((a.argmax(-1) == b.argmax(-1)).sum()) for a, b in pairs)
    rows = sum(b.shape[0] for b in ref_logits[:steps])
    same = [next((k for k, (x, y) in enumerate(zip(o, r, strict=False)) if x != y), len(r))  # first difference
            for o, r in zip(outs, ref_outs, strict=True)]
    record(f"{label} logits max|diff|", round(err, 4), "", f"logits std {scale:.3f}; top-1 {top1}/{rows}; greedy "
           f"tokens equal before the first difference: {same} of 8 (steps after a difference see other inputs)")


def reports(eng) -> list[float]:
    return [round(r.bytes_read / 1e9, 2) for r in getattr(eng, "rank_reports", [])]


if __name__ == "__main__":
    main()
