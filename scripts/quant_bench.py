"""Quantized decode on a CUDA GPU, measured in one go beside its peer; prints a table at the end.

    python scripts/quant_bench.py --out DIR [--shapes llama-3.1-8b,llama-3.2-1b] [--methods bf16,int8,int4,fp8]
        [--gpt-fast PATH] [--batches 16,64] [--offline] [--tests]

A method int4-a8 / int4-a16 is int4 with the decode GEMV's int8 inputs on / off
(KernelConfig.gemv_int4.int8_inputs; plain int4: the default).

For each shape (random-weight checkpoints made by scripts/make_random_checkpoint.py) and method:
  batch-1   ms/token of one greedy request (128-token prompt, 256 tokens; scripts/gpu_suite.py's timing),
            beside the method's floor: the bytes of every weight one token reads in the format served
            (the output head as served) over the measured read bandwidth. Each quantized method twice:
            Ferrum's default (`skip: [lm_head]`, head in bf16) and `skip: []` (head quantized, as
            gpt-fast's quantize.py does), the like-for-like comparison with gpt-fast.
  batch-B   ms per decode step with B requests decoding at once (--batches)
  offline   `ferrum bench offline` (256 requests, 100-1024 in and out) with --quantization (--offline)
  peer      gpt-fast (scripts/gptfast_peer.py, a checkout at --gpt-fast) bf16, int8 and int4 g128, in the same run
Uses only public surfaces: create_engine with the engine settings, LLMEngine requests and steps, the CLI.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gemv_bench import read_bandwidth  # noqa: E402 - a 2 GiB sum, as the GEMV benches measure it
from gpu_suite import (  # noqa: E402 - shared GPU timing
    RESULTS,
    checkpoint,
    gpu_engine,
    print_results,
    record,
    record_offline,
    time_batch1_decode,
)


def linear_bytes(n: int, k: int, method: str, group: int = 128) -> int:
    """Bytes one [n, k] linear weight is stored as (ferrum.weights.quantization's layouts)."""
    if method == "bf16":
        return 2 * n * k
    if method in ("int8", "fp8"):
        return n * k + 4 * n
    return n * k // 2 + 2 * 2 * n * (k // group)  # packed values, bf16 scale and zero per group


def floor_bytes(folder: Path, method: str, head_quantized: bool) -> int:
    """The bytes of every weight one token reads, in the format served."""
    c = json.loads((folder / "config.json").read_text())
    h, i, v, layers = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    per_layer = (linear_bytes(q + 2 * kv, h, method) + linear_bytes(h, q, method)
                 + linear_bytes(2 * i, h, method) + linear_bytes(h, i, method) + 2 * 2 * h)
    tied = c.get("tie_word_embeddings", False)
    head = linear_bytes(v, h, method if head_quantized and not tied else "bf16")
    return layers * per_layer + head + 2 * h


def quant_setting(method: str, head: bool) -> dict[str, Any]:
    """The engine settings of a method; int4-a8 / int4-a16: int4 with the decode GEMV's int8 inputs on / off
    (KernelConfig.gemv_int4.int8_inputs; plain int4: the default); int4-r8: int4 with its products of
    DEQUANTIZE_FROM rows and more as W8A8 in int8 (KernelConfig.int4_w8a8_rows); int4-f8: the same in fp8 (int4's
    default on compute capability 9.0); int4-w16: W4A16 at every M (int4_w8a8_rows 0)."""
    if method == "bf16":
        return {}
    if method == "int4-w16":
        return {"quantization": {"method": "int4", "skip": [] if head else ["lm_head"]},
                "kernels": {"int4_w8a8_rows": 0}}
    if method in ("int4-r8", "int4-f8"):
        return {"quantization": {"method": "int4", "skip": [] if head else ["lm_head"]},
                "kernels": {"int4_w8a8_rows": INT8_ROWS, "int4_w8a8_format": "fp8" if method == "int4-f8" else "int8"}}
    base, _, inputs = method.partition("-a")
    setting: dict[str, Any] = {"quantization": {"method": base, "skip": [] if head else ["lm_head"]}}
    if inputs:
        setting["kernels"] = {"gemv_int4": {"int8_inputs": inputs == "8"}}
    return setting


INT8_ROWS = 129  # int4-r8's KernelConfig.int4_w8a8_rows: quant_matmul.DEQUANTIZE_FROM


def batch_step_ms(folder: Path, batch: int, setting: dict[str, Any], prompt_len: int = 128, tokens: int = 64) -> float:
    """Milliseconds per decode step with `batch` greedy requests decoding together."""
    from ferrum.engine.sampling_params import SamplingParams

    engine = gpu_engine(folder, max_num_seqs=max(batch, 8), max_model_len=2048, **setting)
    rng = random.Random(2)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    engine.generate([[rng.randrange(vocab - 2) for _ in range(prompt_len)] for _ in range(batch)],
                    SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for r in range(batch):
        engine.add_request(f"b{r}", [rng.randrange(vocab - 2) for _ in range(prompt_len)], params)
    started_ids: set[str] = set()
    while engine.has_work and len(started_ids) < batch:  # the prefills, until every request has a token
        started_ids |= {o.request_id for o in engine.step() if o.new_token_ids}
    engine.device.runtime.synchronize()
    started, produced = time.perf_counter(), 0
    while engine.has_work:
        produced += sum(len(o.new_token_ids) for o in engine.step())
    elapsed = time.perf_counter() - started
    engine.release()
    del engine
    torch.cuda.empty_cache()
    return elapsed / max(produced / batch, 1) * 1e3


def run_peer(args: argparse.Namespace, shape: str, mode: str) -> dict[str, Any] | None:
    cmd = [sys.executable, str(ROOT / "scripts/gptfast_peer.py"), "--gpt-fast", str(args.gpt_fast), "--shape", shape,
           "--mode", mode]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
    if done.returncode or not lines:
        record("peer", f"gpt-fast {shape} {mode}", "failed", note=done.stderr[-600:].replace("\n", " | "))
        return None
    return json.loads(lines[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("quant-bench"))
    p.add_argument("--ckpt", type=Path, default=Path("/tmp/ferrum-ckpt"))
    p.add_argument("--shapes", default="llama-3.1-8b,llama-3.2-1b")
    p.add_argument("--methods", default="bf16,int8,int4,fp8")
    p.add_argument("--gpt-fast", type=Path, default=None)
    p.add_argument("--peer-modes", default="bf16,int8,int4", help="gpt-fast's modes to run")
    p.add_argument("--no-batch1", action="store_true", help="skip the batch-1 decode of Ferrum's methods")
    p.add_argument("--batches", default="16,64")
    p.add_argument("--offline", action="store_true")
    p.add_argument("--tests", action="store_true", help="the quantized kernels' GPU tests first")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    record("env", "gpu", props.name, note=f"cc {props.major}.{props.minor}")
    bandwidth = read_bandwidth()
    record("env", "read bandwidth (2 GiB sum)", round(bandwidth / 1e9), "GB/s")
    if args.tests:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                               "tests/kernels/test_quant_kernels.py", "tests/models/test_quantized.py"],
                              capture_output=True, text=True, cwd=ROOT)
        record("tests", "quantized kernels and layers on the GPU", done.stdout.strip().splitlines()[-1] if
               done.stdout.strip() else "no output", note=done.stdout[-1500:] if done.returncode else "")
    methods = args.methods.split(",")
    for shape in filter(None, args.shapes.split(",")):
        folder = checkpoint(shape, args.ckpt)
        base = None
        for method in [] if args.no_batch1 else methods:
            for head in ([False] if method == "bf16" else [False, True]):
                label = method if method == "bf16" else f"{method}{' head quantized' if head else ''}"
                try:
                    per_token = time_batch1_decode(folder, **quant_setting(method, head))
                except Exception:  # noqa: BLE001 - recorded, the run goes on
                    record("batch1", f"{shape} {label}", "failed", note=traceback.format_exc()[-800:])
                    continue
                floor = floor_bytes(folder, method, head) / bandwidth
                base = per_token if method == "bf16" else base
                speed = f", {base / per_token:.2f}x bf16" if base else ""
                record("batch1", f"{shape} {label}", round(per_token * 1e3, 3), "ms/token",
                       f"floor {floor * 1e3:.3f} ms ({floor_bytes(folder, method, head) / 1e9:.2f} GB) -> "
                       f"{floor / per_token:.1%} of floor{speed}")
        for batch in filter(None, args.batches.split(",")):
            for method in methods:
                try:
                    ms = batch_step_ms(folder, int(batch), quant_setting(method, False))
                    record(f"batch{batch}", f"{shape} {method}", round(ms, 3), "ms/step")
                except Exception:  # noqa: BLE001
                    record(f"batch{batch}", f"{shape} {method}", "failed", note=traceback.format_exc()[-800:])
        if args.gpt_fast is not None:
            for mode in filter(None, args.peer_modes.split(",")):
                res = run_peer(args, shape, mode)
                if res:
                    floor = res["weight_bytes_per_token"] / bandwidth
                    record("peer", f"gpt-fast {shape} {mode}", round(res["ms_per_token"], 3), "ms/token",
                           f"floor {floor * 1e3:.3f} ms -> {floor / (res['ms_per_token'] / 1e3):.1%} of floor")
        if args.offline:
            for method in methods:
                setting = quant_setting(method, False)
                record_offline(f"{shape} {method}", folder, args.out / f"offline-{shape}-{method}.json",
                               setting.get("quantization", {}).get("method"), setting.get("kernels"))
        (args.out / "quant_bench.json").write_text(json.dumps(RESULTS, indent=1))
    print_results(args.out / "quant_bench.json")


if __name__ == "__main__":
    main()
