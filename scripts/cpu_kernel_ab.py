#!/usr/bin/env python
"""Two or more versions of the CPU attention kernel side by side in one process, their calls interleaved.

A small VM's speed drifts by 20-30% over minutes, so versions timed one process after another are often
indistinguishable. Here each version is built under its own op namespace (ferrum.kernels.cpu.build's
build_kernels), all are loaded at once, and every pass times each version in turn (the order reversed every
other pass), so that the drift falls on all alike. It reports each version's median over the passes and its
ratio to the first version's.

    python scripts/cpu_kernel_ab.py --variant head=HEAD --variant mine=ferrum/kernels/cpu \\
        [--threads 1,2] [--contexts 512,6000] [--modes warm,cold] [--order sequential|scattered] [--passes 12]

A variant is NAME=REV (a git revision: its ferrum/kernels/cpu sources) or NAME=DIR (a folder holding
them, such as the working tree's). The workload: one decode query (the demo model's 9 heads over 3 kv
heads, head_dim 64, float32 q) over int8 or bfloat16 caches of 4,000 blocks a layer, 30 layers; warm
reads one layer's cache 30 times, cold reads the 30 in turn after 64 MB of other writes. The blocks of the
sequence are in order (as a long prompt's are) or scattered over the 4,000. Not a test: prints the CPU
model and its SIMD flags first.

With --gemv-rows 1,8,31 it times int4_gemv instead: the demo model's 30 x 4 projections (int4 in groups of
32, float16 scales, as quantization auto serves them) on x of each row count, each variant's outputs
compared bit for bit with the first's. With --head-rows 4,64,256 it times int8_float_gemv (the int8 LM head,
49152 x 576) with torch's dense float32 and bfloat16 products of the same weight beside it, and checks that
the last row's logits are the same bits as that row's alone.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ferrum.kernels.cpu.build import HEADERS, SOURCES, build_kernels  # noqa: E402

sys.path.insert(0, str(ROOT / "scripts"))
from cpu_kernels_bench import cpu_header  # noqa: E402

KERNELS = "ferrum/kernels/cpu"
HEADS, KV_HEADS, HEAD_DIM, BLOCK, BLOCKS, LAYERS = 9, 3, 64, 16, 4000, 30


def sources(spec: str) -> dict[str, bytes]:
    """The kernel files of a variant: a folder's, or a git revision's."""
    folder = Path(spec)
    if folder.is_dir():
        return {name: (folder / name).read_bytes() for name in (*SOURCES, *HEADERS)}
    return {name: subprocess.run(["git", "show", f"{spec}:{KERNELS}/{name}"], cwd=ROOT, check=True,
                                 capture_output=True).stdout for name in (*SOURCES, *HEADERS)}


def built(name: str, spec: str, cache: Path) -> Any:
    """The variant's ops (torch.ops.ferrum_ab_<name>), built for this machine once per content into `cache`."""
    files = sources(spec)
    namespace = f"ferrum_ab_{name}"
    library_cpp = files["library.cpp"].decode()
    if "FERRUM_CPU_OPS" not in library_cpp:  # a version from before the namespace could be chosen
        files["library.cpp"] = library_cpp.replace("TORCH_LIBRARY(ferrum_cpu,", f"TORCH_LIBRARY({namespace},").replace(
            "TORCH_LIBRARY_IMPL(ferrum_cpu,", f"TORCH_LIBRARY_IMPL({namespace},").encode()
    with tempfile.TemporaryDirectory() as tmp:
        for file, text in files.items():
            (Path(tmp) / file).write_bytes(text)
        started = time.perf_counter()
        library = build_kernels(Path(tmp), cache, namespace)
        print(f"{name} ({spec}) ready in {time.perf_counter() - started:.0f} s", flush=True)
    torch.ops.load_library(str(library))
    return getattr(torch.ops, namespace)


def layer_cache(ops: Any, kv_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's k and v caches, head-major [blocks, kv, block, width] as the engine allocates them,
    every slot written by rope_write (int8 tiles with their scales; or the values as they are)."""
    width = HEAD_DIM + 4 if kv_dtype == torch.int8 else HEAD_DIM
    k, v = (torch.empty(KV_HEADS, BLOCKS, BLOCK, width, dtype=kv_dtype).transpose(0, 1) for _ in range(2))
    slots = BLOCKS * BLOCK
    x = torch.randn(slots, 2, KV_HEADS * HEAD_DIM)
    qkv = torch.cat((torch.zeros(slots, HEAD_DIM), x[:, 0], x[:, 1]), 1)
    ops.rope_write(qkv, torch.zeros(slots, dtype=torch.long), torch.ones(1, HEAD_DIM), torch.zeros(1, HEAD_DIM),
                   k, v, torch.arange(slots), 1, KV_HEADS)
    return k, v


def gemv_table(ops: list[Any], names: list[str], row_counts: list[int], passes: int) -> None:
    """int4_gemv of each variant over the demo model's projections, ms a pass (all 120), interleaved."""
    from cpu_kernels_bench import SHAPES, prepared_layer

    from ferrum.weights.quantization.arith import quantize
    from ferrum.weights.quantization.scheme import QuantScheme

    torch.manual_seed(0)
    scheme = QuantScheme("int4", group_size=32, params=torch.float16)
    layers = [prepared_layer(quantize((torch.randn(n, k) * 0.05).to(torch.bfloat16), scheme), "cpu_kernels")
              for _ in range(LAYERS) for n, k in SHAPES[:4]]
    print(f"\nint4_gemv, {len(layers)} projections, {passes} passes; ms a pass, median (min); ratio to {names[0]}'s")
    print("| rows | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for rows in row_counts:
        xs = {k: torch.randn(rows, k) for _, k in SHAPES[:4]}

        def run(variant: Any, xs: dict[int, torch.Tensor] = xs) -> list[torch.Tensor]:
            return [variant.int4_gemv(xs[layer.in_features], layer.packed, layer.gemv_scale, layer.gemv_offset,
                                      layer.gemv_zero_point, 32) for layer in layers]

        outs = [run(variant) for variant in ops]
        times: list[list[float]] = [[] for _ in names]
        for p in range(passes):
            for i in (range(len(names)) if p % 2 == 0 else reversed(range(len(names)))):
                started = time.perf_counter()
                run(ops[i])
                times[i].append((time.perf_counter() - started) * 1e3)
        base = statistics.median(times[0])
        cells = [f"{statistics.median(t):.2f} ({min(t):.2f}) {statistics.median(t) / base:.3f}x" for t in times]
        same = all(torch.equal(a, b) for out in outs[1:] for a, b in zip(outs[0], out, strict=True))
        print(f"| {rows} | " + " | ".join(cells) + " |" + ("" if same else " outputs differ"), flush=True)


def head_table(ops: list[Any], names: list[str], row_counts: list[int], passes: int) -> None:
    """int8_float_gemv (the int8 LM head) of each variant on the demo model's head, 49152 x 576, with
    torch's dense float32 and bfloat16 products of the same weight as reference columns."""
    torch.manual_seed(0)
    n, k, group = 49152, 576, 32
    qweight = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    scale = torch.rand(n, k // group) * 1e-3
    dense = {dtype: (qweight.float().view(n, -1, group) * scale[..., None]).view(n, k).to(dtype)
             for dtype in (torch.float32, torch.bfloat16)}
    columns = names + ["dense float32", "dense bfloat16"]
    print(f"\nint8_float_gemv, {n} x {k} in groups of {group}, {passes} passes; ms, median (min); "
          f"ratio to {names[0]}'s")
    print("| rows | " + " | ".join(columns) + " |")
    print("|---|" + "---|" * len(columns))
    for rows in row_counts:
        x = torch.randn(rows, k)
        calls = [lambda op=op, x=x: op.int8_float_gemv(x, qweight, scale, group) for op in ops]
        calls += [lambda w=w, x=x: F.linear(x.to(w.dtype), w) for w in dense.values()]
        outs = [call() for call in calls[: len(ops)]]
        alone = [op.int8_float_gemv(x[-1:], qweight, scale, group) for op in ops]
        times: list[list[float]] = [[] for _ in calls]
        for p in range(passes):
            for i in (range(len(calls)) if p % 2 == 0 else reversed(range(len(calls)))):
                started = time.perf_counter()
                calls[i]()
                times[i].append((time.perf_counter() - started) * 1e3)
        base = statistics.median(times[0])
        cells = [f"{statistics.median(t):.2f} ({min(t):.2f}) {statistics.median(t) / base:.3f}x" for t in times]
        same = all(torch.equal(outs[0], out) for out in outs[1:])
        batch_free = all(torch.equal(out[-1:], one) for out, one in zip(outs, alone, strict=True))
        print(f"| {rows} | " + " | ".join(cells) + " |" + ("" if same else " outputs differ")
              + ("" if batch_free else " last row differs from it alone"), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", action="append", required=True, help="NAME=REV or NAME=DIR (two or more)")
    parser.add_argument("--threads", default="2")
    parser.add_argument("--contexts", default="512,6000")
    parser.add_argument("--modes", default="warm,cold")
    parser.add_argument("--order", choices=("sequential", "scattered"), default="sequential")
    parser.add_argument("--kv-dtype", choices=("int8", "bfloat16"), default="int8")
    parser.add_argument("--passes", type=int, default=12)
    parser.add_argument("--cache", type=Path, default=Path("~/.cache/ferrum/kernel-ab").expanduser())
    parser.add_argument("--gemv-rows", default="", help="e.g. 1,8,31: time int4_gemv at these row counts instead")
    parser.add_argument("--head-rows", default="", help="e.g. 4,64,256: time int8_float_gemv (the LM head) instead")
    args = parser.parse_args()
    variants = [v.split("=", 1) for v in args.variant]
    if len(variants) < 2 or any(len(v) != 2 or not v[0].isidentifier() for v in variants):
        parser.error("give two or more --variant NAME=REV|DIR, NAME an identifier")
    print(cpu_header(), flush=True)
    ops = [built(name, spec, args.cache) for name, spec in variants]
    names = [name for name, _ in variants]
    if args.gemv_rows:
        gemv_table(ops, names, [int(r) for r in args.gemv_rows.split(",")], args.passes)
        return
    if args.head_rows:
        head_table(ops, names, [int(r) for r in args.head_rows.split(",")], args.passes)
        return
    kv_dtype = torch.int8 if args.kv_dtype == "int8" else torch.bfloat16
    caches = [layer_cache(ops[0], kv_dtype) for _ in range(LAYERS)]
    evict = torch.randn(16 << 20)
    q = torch.randn(1, HEADS, HEAD_DIM)
    outs = [torch.empty_like(q) for _ in names]
    # a build whose paged_attention takes `generated` reads the query as a generated token's (a decode's)
    flags = [(torch.tensor([True]),) if "generated" in str(op.paged_attention.default._schema) else () for op in ops]
    print(f"\n{args.kv_dtype} cache, blocks {args.order}, {args.passes} passes; us a layer, median (min); "
          f"ratio to {names[0]}'s median")
    print("| threads | context | mode | " + " | ".join(names) + " |")
    print("|---|---|---|" + "---|" * len(names))
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for context in (int(c) for c in args.contexts.split(",")):
            used = -(-context // BLOCK)
            ids = torch.randperm(BLOCKS)[:used] if args.order == "scattered" else torch.arange(used)
            rest = (ids.to(torch.int32)[None], torch.tensor([context], dtype=torch.int32),
                    torch.tensor([0, 1], dtype=torch.int32), BLOCK, HEAD_DIM ** -0.5, 0, None, None)
            for mode in args.modes.split(","):
                layers = caches[:1] * LAYERS if mode == "warm" else caches
                times: list[list[float]] = [[] for _ in names]
                for p in range(args.passes):
                    for i in (range(len(names)) if p % 2 == 0 else reversed(range(len(names)))):
                        if mode == "cold":
                            evict.add_(1.0)
                        started = time.perf_counter()
                        for k, v in layers:
                            ops[i].paged_attention(outs[i], q, k, v, *rest, *flags[i])
                        times[i].append((time.perf_counter() - started) / LAYERS * 1e6)
                base = statistics.median(times[0])
                cells = [f"{statistics.median(t):.1f} ({min(t):.1f}) {statistics.median(t) / base:.3f}x" for t in times]
                differ = max((outs[0] - o).abs().max().item() for o in outs[1:])
                note = f" outputs differ by {differ:.2g}" if differ > 0 else ""
                print(f"| {threads} | {context} | {mode} | " + " | ".join(cells) + f" |{note}", flush=True)


if __name__ == "__main__":
    main()
