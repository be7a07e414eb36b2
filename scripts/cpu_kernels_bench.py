#!/usr/bin/env python
"""The CPU kernels (ferrum.kernels.cpu) against what they replaced, in one run on this machine:

  gemv       QuantizedLinear's cpu_kernels method (the integer GEMV) against the `cpu` method (torch's
             _weight_int4pack_mm_for_cpu / _weight_int8pack_mm) and a oneDNN-prepacked bf16 linear,
             at the demo model's shapes, 30 copies of each weight so that they stream from memory as a
             model's layers do; 1, 8 and 64 rows
  model      a model's worth of int4 GEMVs (30 layers x the demo model's 4 projections, 66 MB: more
             than the cache holds) called in the decode chain's order, with 2 and 1 threads: the
             GEMVs' streaming rate (the gemv part's 30 copies of one weight stay largely in a VM's cache)
  attention  one decode query over the paged cache at 50, 2,000 and 6,000 tokens of context
             (ferrum_cpu.paged_attention over bf16 and int8 caches, q in bf16 and in float32, against
             torch_paged's gather + SDPA)
  engine     the demo model's decode step in process (LLMEngine.step, one sequence, greedy) at 50 and
             2,000 tokens of context: plain PyTorch (engine.kernels.cpu false) against the kernels, bf16
             weights against quantization auto (the decode chain and the int8 LM head), 2 threads against 1
  compile    the other way the issue names: plain PyTorch's layered forward under torch.compile (Inductor's
             CPU code generation), bf16 and torch's int4 op, against the kernels' decode chain; the first
             compiled steps' time is reported as the compile time

    python scripts/cpu_kernels_bench.py [--model models/SmolLM2-135M-Instruct] [--gguf ...Q4_1.gguf]

Not a test. Prints the CPU model and its SIMD flags first, then one table per part.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ferrum.engine.builder import create_engine  # noqa: E402
from ferrum.engine.sampling_params import SamplingParams  # noqa: E402
from ferrum.kernels.cpu.build import load_cpu_kernels  # noqa: E402
from ferrum.models.layers.quantized_linear import QuantizedLinear  # noqa: E402
from ferrum.weights.quantization.arith import quantize  # noqa: E402
from ferrum.weights.quantization.scheme import QuantScheme  # noqa: E402
from ferrum.weights.quantization.tensor import QuantizedTensor  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]  # the demo model's, LM head last


def cpu_header() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    model = next((line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in out.splitlines() if line.startswith("Flags")), [])
    simd = [f for f in flags if f.startswith(("avx", "amx", "fma", "f16c", "sse4"))]
    return f"CPU: {model}, {torch.get_num_threads()} threads; SIMD: {' '.join(simd)}; torch {torch.__version__}"


def timed(fn: Callable[[], Any], repeat: int) -> float:
    for _ in range(3):
        fn()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    return (time.perf_counter() - start) / repeat


def run_layers(layers: list[QuantizedLinear], x: torch.Tensor) -> None:
    for layer in layers:
        layer(x)


def run_dense(packed: list[torch.Tensor], x: torch.Tensor) -> None:
    for weight in packed:
        torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def gathered(k_cache: torch.Tensor, v_cache: torch.Tensor, q: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """torch_paged's decode: the context's k and v gathered by slot, then SDPA."""
    kd = k_cache.index_select(0, slots).transpose(0, 1)[None]
    vd = v_cache.index_select(0, slots).transpose(0, 1)[None]
    return F.scaled_dot_product_attention(q.transpose(0, 1)[None], kd, vd, enable_gqa=True)


def prepared_layer(stored: QuantizedTensor, kernels: str) -> QuantizedLinear:
    """A QuantizedLinear holding `stored`, through `kernels` ("cpu_kernels" or "cpu"), repacked."""
    n, k = stored.shape
    layer = QuantizedLinear(k, n, False, stored.scheme, kernels, torch.bfloat16)  # type: ignore[arg-type]
    for name, part in stored.parts.items():
        getattr(layer, name).copy_(part)
    layer.prepare()
    return layer


def gemv_table() -> None:
    print("\n| weight | scheme | rows | cpu_kernels us | torch us | bf16 oneDNN us | torch / ours |")
    print("|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for n, k in SHAPES:
        copies = 30 if n < 10000 else 2
        weight = (torch.randn(n, k) * 0.05).to(torch.bfloat16)
        packed = [torch.ops.mkldnn._reorder_linear_weight(weight.clone(), 8) for _ in range(copies)]
        for scheme in (QuantScheme("int4", group_size=32), QuantScheme("int8")):
            stored = quantize(weight, scheme)
            layers = {kernels: [prepared_layer(stored, kernels) for _ in range(copies)]
                      for kernels in ("cpu_kernels", "cpu")}
            for rows in (1, 8, 64):
                x = torch.randn(rows, k).to(torch.bfloat16)
                ours = timed(partial(run_layers, layers["cpu_kernels"], x), 20) / copies
                theirs = timed(partial(run_layers, layers["cpu"], x), 20) / copies
                dense = timed(partial(run_dense, packed, x), 20) / copies
                print(f"| {n}x{k} | {scheme.describe()} | {rows} | {ours * 1e6:.1f} | {theirs * 1e6:.1f} | "
                      f"{dense * 1e6:.1f} | {theirs / ours:.2f} |")


def model_gemvs_table() -> None:
    print("\n| threads | 120 int4 GEMVs, p50 ms | min ms | GB/s at p50 |")
    print("|---|---|---|---|")
    scheme = QuantScheme("int4", group_size=32, params=torch.float16)
    layers = [prepared_layer(quantize((torch.randn(n, k) * 0.05).to(torch.bfloat16), scheme), "cpu_kernels")
              for _ in range(30) for n, k in SHAPES[:4]]
    xs = {k: torch.randn(1, k).to(torch.bfloat16) for _, k in SHAPES[:4]}
    calls = [(xs[layer.in_features], layer.packed, layer.gemv_scale, layer.gemv_offset, bool(layer.gemv_zero_point),
              32) for layer in layers]
    nbytes = sum(layer.packed.nbytes + layer.gemv_scale.nbytes + layer.gemv_offset.nbytes for layer in layers)
    threads = torch.get_num_threads()
    for count in (threads, 1):
        torch.set_num_threads(count)
        runs = []
        for _ in range(16):
            start = time.perf_counter()
            for call in calls:
                torch.ops.ferrum_cpu.int4_gemv(*call)
            runs.append(time.perf_counter() - start)
        runs.sort()
        print(f"| {count} | {runs[8] * 1e3:.2f} | {runs[0] * 1e3:.2f} | {nbytes / runs[8] / 1e9:.1f} |", flush=True)
    torch.set_num_threads(threads)


def every_layer(caches: list[tuple[torch.Tensor, torch.Tensor]], out: torch.Tensor, q: torch.Tensor,
                rest: tuple[Any, ...]) -> None:
    for k, v in caches:
        torch.ops.ferrum_cpu.paged_attention(out, q, k, v, *rest)


def int8_caches(k: torch.Tensor, v: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[slots, KV, D] keys and values as kv_cache_dtype int8 stores them for these kernels (tiles of
    `block` slots), written by the kernels' own rope_write with cos 1 and sin 0 (no rotation)."""
    slots, kv_heads, dim = k.shape
    k8, v8 = (torch.empty(slots // block, kv_heads, block, dim + 4, dtype=torch.int8) for _ in range(2))
    qkv = torch.cat((torch.zeros(slots, dim, dtype=k.dtype), k.reshape(slots, -1), v.reshape(slots, -1)), 1)
    torch.ops.ferrum_cpu.rope_write(qkv, torch.zeros(slots, dtype=torch.long), torch.ones(1, dim),
                                    torch.zeros(1, dim), k8, v8, torch.arange(slots), 1, kv_heads)
    return k8, v8


def attention_table(q_dtype: torch.dtype) -> None:
    """One layer's cache called again and again stays in the last-level cache (4.9 MB at 6,000 tokens);
    the per-layer columns rotate through 30 layers' caches, as a decode step does, so they come from
    memory. The caches are laid out as the engine allocates them for these kernels (block-major); bf16
    and kv_cache_dtype int8 (the integer tile path: VNNI, or AVX2 alone). q_dtype: the activations'
    (float32: what auto serves on a CPU without bf16 units, over a bf16 or int8 cache)."""
    print(f"\nq in {str(q_dtype).removeprefix('torch.')}:")
    print("\n| context | bf16 one cache, warm us | bf16 per layer, 30 caches us | GB/s | int8 one cache, warm us | "
          "int8 per layer us | GB/s | int8 / bf16 | gather + SDPA us (bf16, warm) |")
    print("|---|---|---|---|---|---|---|---|---|")
    heads, kv_heads, dim, block = 9, 3, 64, 16
    blocks = 400

    def block_major(cache: torch.Tensor) -> torch.Tensor:
        return cache.view(-1, block, *cache.shape[1:]).transpose(1, 2).contiguous()

    flat = [(torch.randn(blocks * block, kv_heads, dim).to(torch.bfloat16),
             torch.randn(blocks * block, kv_heads, dim).to(torch.bfloat16)) for _ in range(30)]
    caches = {"bf16": [(block_major(k), block_major(v)) for k, v in flat],
              "int8": [int8_caches(k, v, block) for k, v in flat]}
    k_cache, v_cache = caches["bf16"][0]
    order = torch.randperm(blocks)
    for context in (50, 2000, 6000):
        table = order[: -(-context // block)].to(torch.int32)[None]
        q = torch.randn(1, heads, dim).to(q_dtype)
        out = torch.empty_like(q)
        rest = (table, torch.tensor([context], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32), block,
                dim**-0.5)
        warm = timed(partial(torch.ops.ferrum_cpu.paged_attention, out, q, k_cache, v_cache, *rest), 50)
        warm8 = timed(partial(torch.ops.ferrum_cpu.paged_attention, out, q, *caches["int8"][0], *rest), 50)
        per_layer = {name: timed(partial(every_layer, c, out, q, rest), 5) / len(c) for name, c in caches.items()}
        read = {name: 2 * context * kv_heads * c[0][0].shape[-1] * c[0][0].element_size() for name, c in caches.items()}
        slots = (table[0].long()[:, None] * block + torch.arange(block)).reshape(-1)[:context]
        theirs = timed(partial(gathered, flat[0][0], flat[0][1], q.to(torch.bfloat16), slots), 50)
        print(f"| {context} | {warm * 1e6:.1f} | {per_layer['bf16'] * 1e6:.1f} | "
              f"{read['bf16'] / per_layer['bf16'] / 1e9:.1f} | {warm8 * 1e6:.1f} | {per_layer['int8'] * 1e6:.1f} | "
              f"{read['int8'] / per_layer['int8'] / 1e9:.1f} | {per_layer['int8'] / per_layer['bf16']:.2f} | "
              f"{theirs * 1e6:.1f} |")


def decode_ms(model: str, context: int, **settings: Any) -> float:
    engine = create_engine(model, backend="cpu", max_model_len=4096, kv_cache_memory_gb=0.25, **settings)
    try:
        prompt = [(i * 7919) % 40000 + 100 for i in range(context)]
        engine.add_request("r", prompt, SamplingParams(max_tokens=41, temperature=0.0, ignore_eos=True))
        steps = []
        while engine.has_work:
            start = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - start)
        return sorted(steps[-32:])[16] * 1e3
    finally:
        engine.release()


def engine_table(model: str, gguf: str | None) -> None:
    print("\n| model | setting | threads | decode ms @50 | decode ms @2000 |")
    print("|---|---|---|---|---|")
    runs: list[tuple[str, str, dict[str, Any]]] = [
        (model, "plain PyTorch, bf16", {"kernels": {"cpu": False}}),
        (model, "kernels, bf16", {}),
        (model, "kernels, quantization auto", {"quantization": {"method": "auto"}}),
    ]
    if gguf:
        runs += [(gguf, "plain PyTorch", {"kernels": {"cpu": False}}),
                 (gguf, "kernels, quantization auto", {"quantization": {"method": "auto"}})]
    for path, label, settings in runs:
        for threads in (2, 1):
            cells = [decode_ms(path, context, threads=threads, **settings) for context in (50, 2000)]
            print(f"| {Path(path).name} | {label} | {threads} | {cells[0]:.2f} | {cells[1]:.2f} |", flush=True)


def compiled_decode(model: str, settings: dict[str, Any]) -> tuple[float, float, float]:
    """(seconds until the first decode step is done, decode ms p50 @50, @2000): the model's forward
    under torch.compile, the step otherwise the engine's own."""
    engine = create_engine(model, backend="cpu", max_model_len=4096, kv_cache_memory_gb=0.25,
                           kernels={"cpu": False}, **settings)
    try:
        runner = engine.runner
        runner.model.forward = torch.compile(runner.model.forward, dynamic=True)  # type: ignore[attr-defined]
        results = []
        for context in (50, 2000):
            prompt = [(i * 7919) % 40000 + 100 for i in range(context)]
            engine.add_request(f"r{context}", prompt, SamplingParams(max_tokens=41, temperature=0.0, ignore_eos=True))
            steps = []
            while engine.has_work:
                t = time.perf_counter()
                engine.step()
                steps.append(time.perf_counter() - t)
            if context == 50:
                results.append(steps[0] + steps[1])  # the prefill and the first decode: both compile
            results.append(sorted(steps[-32:])[16] * 1e3)
        return results[0], results[1], results[2]
    finally:
        engine.release()


def compile_table(model: str) -> None:
    print("\n| path | first prefill + decode s (compile) | decode ms @50 | decode ms @2000 |")
    print("|---|---|---|---|")
    for label, settings in (("torch.compile, plain PyTorch, bf16", {}),
                            ("torch.compile, plain PyTorch, int4 g32 (torch's op)",
                             {"quantization": {"method": "int4", "group_size": 32}})):
        try:
            first, at50, at2000 = compiled_decode(model, settings)
            print(f"| {label} | {first:.1f} | {at50:.2f} | {at2000:.2f} |", flush=True)
        except Exception as exc:  # noqa: BLE001 - a path that does not compile is a result too
            print(f"| {label} | failed: {type(exc).__name__}: {str(exc)[:200]} | - | - |", flush=True)
    chain = [decode_ms(model, context, quantization={"method": "auto"}) for context in (50, 2000)]
    print(f"| C++ kernels, quantization auto (decode chain, int8 head) | - | {chain[0]:.2f} | {chain[1]:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--gguf", default=str(ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"))
    parser.add_argument("--parts", default="gemv,model,attention,engine,compile")
    args = parser.parse_args()
    load_cpu_kernels(Path("~/.cache/ferrum/kernels").expanduser())
    torch.set_num_threads(len(__import__("os").sched_getaffinity(0)))
    print(cpu_header())
    parts = args.parts.split(",")
    if "gemv" in parts:
        gemv_table()
    if "model" in parts:
        model_gemvs_table()
    if "attention" in parts:
        for q_dtype in (torch.bfloat16, torch.float32):
            attention_table(q_dtype)
    if "engine" in parts:
        engine_table(args.model, args.gguf if Path(args.gguf).is_file() else None)
    if "compile" in parts:
        compile_table(args.model)


if __name__ == "__main__":
    main()
