"""Mixtures of experts on one GPU: the expert kernels against the bytes they must read, and the
Qwen3-30B-A3B shape served end to end against its active-weight floor. Prints the GPU, then a table.

    python scripts/moe_bench.py --phases kernels,decode,offline --ckpt /dev/shm/ckpt --out DIR

kernels   one MoE layer of each shape (Qwen3-30B-A3B: 128 experts of 768, top 8, hidden 2048;
          Mixtral-8x7B: 8 of 14336, top 2, hidden 4096), bf16, T tokens with random distinct experts: the
          router kernel, the per-pair and grouped expert products (each replayed in a CUDA graph), against
          the bytes of the experts the T tokens pick at the measured copy bandwidth; beside them the plain
          path (each chosen expert's matmuls, eager) and what a CUDA graph ran before the kernels (every
          expert over every token)
decode    the --shape random checkpoint (Qwen3-30B-A3B by default; mixtral-8x7b: 93 GB, an H200; written
          tiled into --ckpt, a tmpfs): batch-1 ms/token against its active-weight floor (attention,
          router, top-k experts, norms and the head a token reads), and the decode step at batch 16
          and 64 against the bytes of the experts they pick; with --quantization int4,fp8 (on load), each
          method's batch-1 against its own floor (the projections and experts as stored, the router,
          norms and head in bf16)
offline   `ferrum bench offline` on it (256 requests, 100-1024 in and out), with its roofline
profile   torch.profiler over batch-1 decode steps of the --shape checkpoint as served (CUDA graphs):
          each kernel's GPU time a layer
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gpu_suite import RESULTS, gpu_engine, print_results, record  # noqa: E402

from ferrum.bench.roofline import measure_peaks  # noqa: E402

LAYERS = {  # (experts, top k, hidden, each expert's intermediate)
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "mixtral-8x7b": (8, 2, 4096, 14336),
}


def graph_time(fn: Callable[[], object], repeats: int = 20, replays: int = 20) -> float:
    """Seconds per call of `fn`, captured `repeats` times in one CUDA graph, replayed `replays` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (replays * repeats)


def eager_time(fn: Callable[[], object], repeats: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / repeats


def phase_kernels(args, bandwidth: float) -> None:
    for shape, (experts, top_k, hidden, inter) in LAYERS.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        stacks = ((0.02 * torch.randn(experts * 2 * inter, hidden, device="cuda", generator=gen)).bfloat16(),
                  (0.02 * torch.randn(experts * hidden, inter, device="cuda", generator=gen)).bfloat16(),
                  (0.02 * torch.randn(experts, hidden, device="cuda", generator=gen)).bfloat16())
        for tokens in (1, 4, 16, 64, 256):
            bench_layer(shape, stacks, top_k, tokens, bandwidth, gen)
        del stacks
        torch.cuda.empty_cache()


def bench_layer(shape: str, stacks: tuple[torch.Tensor, torch.Tensor, torch.Tensor], top_k: int, tokens: int,
                bandwidth: float, gen: torch.Generator) -> None:
    """One MoE layer's kernels for `tokens` tokens; stacks: gate_up, down and the router's weight."""
    from ferrum.kernels import moe

    gate_up, down, router = stacks
    experts, hidden = router.shape
    inter = down.shape[1]
    stack_gu, stack_dn = gate_up.view(experts, 2 * inter, hidden), down.view(experts, hidden, inter)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    chosen = torch.stack([torch.randperm(experts, device="cuda", generator=gen)[:top_k] for _ in range(tokens)]).int()
    weights = torch.rand(tokens, top_k, device="cuda", generator=gen)
    floor = len(set(chosen.flatten().tolist())) * 3 * hidden * inter * 2 / bandwidth
    t = graph_time(lambda: moe.route(x, router, top_k, True))
    record("kernels", f"{shape} T={tokens} route", round(t * 1e6, 1), "us")
    for per_pair in (True, False):
        if per_pair and tokens > moe.PER_PAIR_MAX_ROWS:
            continue
        t = graph_time(partial(moe.experts, x, chosen, weights, gate_up, down, experts, per_pair=per_pair))
        record("kernels", f"{shape} T={tokens} experts {'per pair' if per_pair else 'grouped'}", round(t * 1e6, 1),
               "us", f"floor {floor * 1e6:.1f} us -> {floor / t:.1%} of floor")
    if tokens > 16:
        return

    def plain() -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in torch.unique(chosen).tolist():
            rows, slot = torch.where(chosen == e)
            g, u = torch.nn.functional.linear(x[rows], stack_gu[e]).chunk(2, dim=-1)
            y = torch.nn.functional.linear(torch.nn.functional.silu(g) * u, stack_dn[e])
            out.index_add_(0, rows, y * weights[rows, slot, None].bfloat16())
        return out

    t = eager_time(plain)
    record("kernels", f"{shape} T={tokens} plain path (eager)", round(t * 1e6, 1), "us", f"{floor / t:.1%} of floor")
    if tokens == 1:
        def every_expert() -> torch.Tensor:
            g, u = torch.einsum("th,enh->ten", x, stack_gu).chunk(2, dim=-1)
            return torch.einsum("tei,ehi->th", torch.nn.functional.silu(g) * u, stack_dn)

        t = graph_time(every_expert, repeats=5, replays=5)
        record("kernels", f"{shape} T=1 every expert (the old graph path)", round(t * 1e6, 1), "us",
               f"{floor / t:.1%} of floor")


def checkpoint(root: Path, shape: str) -> Path:
    out = root / shape
    if not (out / "config.json").exists():
        started = time.perf_counter()
        subprocess.run([sys.executable, str(ROOT / "scripts/make_random_checkpoint.py"), "--shape", shape,
                        "--out", str(out), "--tiled", "--workers", "8"], check=True)
        record("decode", f"{shape} checkpoint written (tiled)", round(time.perf_counter() - started, 1), "s")
    return out


def expert_shape(c: dict) -> tuple[int, int]:
    """(experts, each expert's intermediate size) of a config.json (Qwen's names, or Mixtral's)."""
    if "num_experts" in c:
        return c["num_experts"], c["moe_intermediate_size"]
    return c["num_local_experts"], c["intermediate_size"]


# bytes a weight of a quantized linear layer, as served on load: int4 groups of 128 with a bf16 scale and
# zero each; int8 / fp8 a float32 scale per row (counted per weight over K inputs by `linear_bytes`)
WEIGHT_BYTES = {"none": 2.0, "int4": 0.5 + 4 / 128, "int8": 1.0, "fp8": 1.0}


def linear_bytes(n: int, k: int, method: str) -> float:
    return n * k * WEIGHT_BYTES[method] + (4 * n if method in ("int8", "fp8") else 0)


def active_bytes_per_token(folder: Path, method: str = "none") -> float:
    """The weight bytes one decode token reads: everything but the embedding table and the experts, plus
    top_k experts of every sparse layer; the attention projections and the experts in `method` as
    quantized on load (the router, the norms and the head stay bf16: quantization's default skip)."""
    c = json.loads((folder / "config.json").read_text())
    h, layers, d = c["hidden_size"], c["num_hidden_layers"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    experts, inter = expert_shape(c)
    dense = 2.0 * ((2 * d if c["model_type"] == "qwen3_moe" else 0) + 2 * h + experts * h)  # q/k norms, norms, router
    quantized = (linear_bytes(q + 2 * kv, h, method) + linear_bytes(h, q, method)
                 + c["num_experts_per_tok"] * (linear_bytes(2 * inter, h, method) + linear_bytes(h, inter, method)))
    return layers * (dense + quantized) + 2.0 * (h + c["vocab_size"] * h)


def step_time(engine, batch: int, prompt_len: int = 128, new_tokens: int = 64) -> float:
    """Seconds per decode iteration of `batch` greedy requests decoding together (after their prefill)."""
    from ferrum.engine.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(batch)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"s{batch}-{i}", torch.randint(0, vocab - 2, (prompt_len,), generator=gen).tolist(), params)
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.sequences.values()):
        engine.step()
    engine.device.runtime.synchronize()
    started, tokens = time.perf_counter(), 0
    while engine.has_work:
        tokens += sum(len(out.new_token_ids) for out in engine.step())
    return (time.perf_counter() - started) / (tokens / batch)


def phase_decode(args, bandwidth: float) -> None:
    for method in args.quantization.split(","):
        decode_with(args, bandwidth, method)


def decode_with(args, bandwidth: float, method: str) -> None:
    """Batch-1 decode against the active floor (bf16: also the decode step at batch 16 and 64) with the
    layers quantized on load by `method` (none: bf16)."""
    from gpu_suite import batch1_per_token

    shape = args.shape
    folder = checkpoint(args.ckpt, shape)
    active = active_bytes_per_token(folder, method)
    floor = active / bandwidth
    label = shape if method == "none" else f"{shape} {method}"
    started = time.perf_counter()
    settings = {} if method == "none" else {"quantization": {"method": method}}
    engine = gpu_engine(folder, max_num_seqs=64, max_model_len=2048, **settings)
    record("decode", f"{label} engine ready", round(time.perf_counter() - started, 1), "s")
    experts, top_k, hidden, inter = LAYERS[shape]
    expert_bytes = 3 * hidden * inter * 2 * engine.model_config.num_layers
    base = active_bytes_per_token(folder) - top_k * expert_bytes
    for batch in args.step_batches if method == "none" else ():
        t = step_time(engine, batch)
        touched = experts * (1 - (1 - top_k / experts) ** batch)  # expected distinct experts a layer
        step_floor = (base + touched * expert_bytes) / bandwidth
        record("decode", f"{shape} decode step, batch {batch}", round(t * 1e3, 3), "ms",
               f"floor {step_floor * 1e3:.3f} ms ({touched:.0f} experts a layer) -> {step_floor / t:.1%}")
    per_token = batch1_per_token(engine)
    record("decode", f"{label} batch-1 ms/token", round(per_token * 1e3, 3), "ms",
           f"active floor {floor * 1e3:.3f} ms ({active / 1e9:.2f} GB) -> {floor / per_token:.1%} of floor")
    del engine  # released by batch1_per_token: the offline phase's process needs the device's memory
    import gc

    gc.collect()
    torch.cuda.empty_cache()


def phase_profile(args) -> None:
    from torch.profiler import ProfilerActivity, profile

    from ferrum.engine.sampling_params import SamplingParams

    shape = args.shape
    folder = checkpoint(args.ckpt, shape)
    engine = gpu_engine(folder, max_num_seqs=8, max_model_len=2048)
    layers = engine.model_config.num_layers
    params = SamplingParams(max_tokens=1800, temperature=0, ignore_eos=True)
    engine.add_request("profile", list(range(100, 228)), params)
    for _ in range(10):  # warm-up (a step may decode several tokens)
        engine.step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        tokens = sum(len(out.new_token_ids) for _ in range(10) for out in engine.step())
        torch.cuda.synchronize()
    engine.release()
    for event in sorted(prof.key_averages(), key=lambda e: -e.self_device_time_total)[:12]:
        per_layer = event.self_device_time_total / tokens / layers
        record("profile", f"{shape} {event.key} ({event.count} launches, {tokens} tokens)", round(per_layer, 2),
               "us a layer")


def phase_offline(args) -> None:
    shape = args.shape
    folder = checkpoint(args.ckpt, shape)
    out = args.out / f"offline-{shape}.json"
    done = subprocess.run([sys.executable, "-m", "ferrum.cli", "bench", "offline", "--model", str(folder),
                           "--max-model-len", "2048", "--num-prompts", "256", "--output-json", str(out)],
                          capture_output=True, text=True, cwd=ROOT)
    print(done.stdout[-3000:], done.stderr[-2000:])
    if done.returncode or not out.exists():
        record("offline", shape, "failed", note=done.stderr[-600:])
        return
    res = json.loads(out.read_text())
    r = res["roofline"]
    record("offline", f"{shape} bench offline", round(res["output_tokens_per_s"]), "output tok/s",
           f"{res['elapsed_s']:.1f}s; roofline {r['seconds']:.1f}s = {r['fraction']:.1%} "
           f"({r['compute_bound_passes']}/{r['passes']} passes compute-bound); KV {res['kv_cache_tokens']} tokens")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phases", default="kernels,decode,offline")
    parser.add_argument("--ckpt", type=Path, default=Path("/dev/shm/ckpt"))
    parser.add_argument("--out", type=Path, default=Path("moe-bench"))
    parser.add_argument("--quantization", default="none",
                        help="the decode phase's methods, quantized on load: none (bf16), int4, int8, fp8; "
                             "comma-separated")
    parser.add_argument("--step-batches", type=lambda s: [int(b) for b in s.split(",") if b], default=[16, 64],
                        help="the bf16 decode phase's step batches (comma-separated; empty: batch 1 only)")
    parser.add_argument("--shape", choices=sorted(LAYERS), default="qwen3-30b-a3b",
                        help="the checkpoint of the decode and offline phases")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    print(f"GPU: {props.name}, {props.total_memory / 2**30:.0f} GiB, torch {torch.__version__}", flush=True)
    peaks = measure_peaks(torch.device("cuda"), torch.bfloat16)
    record("env", "peaks", peaks.describe())
    phases = {"kernels": lambda: phase_kernels(args, peaks.bandwidth),
              "decode": lambda: phase_decode(args, peaks.bandwidth), "offline": lambda: phase_offline(args),
              "profile": lambda: phase_profile(args)}
    for phase in args.phases.split(","):
        try:
            phases[phase]()
        except Exception as e:  # noqa: BLE001  (one phase's failure is recorded; the others still run)
            record(phase, "failed", repr(e)[-500:])
        print_results(args.out / "moe_bench.json")
    assert RESULTS


if __name__ == "__main__":
    main()
