"""The int4 W4A16 Triton GEMM (ferrum.kernels.quant_matmul.triton_gemm) at decode-batch sizes on a
CUDA GPU: each candidate tiling (block_n, block_k, split_k, x permuted or read strided, warps; block_m
from M as w4a16_config takes it) against bf16 cuBLAS on the Llama-3.1-8B projections. Prints, per
shape and M, every candidate's time (the launch, split-K's reduce and permute_x's copy of x included)
and error against the dequantized weight, the table's own pick (w4a16_config), and the best.

    python scripts/w4a16_sweep.py [--m 16,64] [--shapes qkv,o,gate_up,down] [--quick] [--permuted-only]
        [--bf16x2 on|off|both] [--block-m 16,32,64] [--kernel planes|tiles|both] [--json FILE]

From TILES_FROM rows the weight-tiles kernel's candidates (GemmConfig.weight_tiles: 64- and 128-row tiles,
splits 1, 2, 4) join the planes kernel's (--kernel picks one or both).

--bf16x2 both: every tiling with the weights dequantized in bf16 pairs (GemmConfig.bf16x2) and in float32,
and a SUMMARY line per shape and M with the best of each.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gemv_bench import graph_time  # noqa: E402 - median of CUDA-graph replays

from ferrum.kernels.quant_matmul import TILES_FROM, GemmConfig, quant_matmul, triton_gemm, w4a16_config  # noqa: E402
from ferrum.kernels.quant_weight import QuantWeight  # noqa: E402
from ferrum.weights.quantization.arith import dequantize, quantize  # noqa: E402
from ferrum.weights.quantization.scheme import QuantScheme  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# (block_n, block_k, num_warps, num_stages) x split_k x permute_x; block_m from M (w4a16_config's rule)
TILES = [(32, 128, 4, 4), (64, 128, 4, 4), (128, 128, 4, 4), (128, 128, 8, 4), (64, 256, 4, 3), (128, 256, 8, 3)]
QUICK_TILES = [(32, 128, 4, 4), (64, 128, 4, 4), (128, 128, 8, 4)]
SPLITS = (1, 2, 4, 8)
# the weight-tiles kernel's candidates (from TILES_FROM rows): (block_m, block_n, num_warps, num_stages) x split_k
WEIGHT_TILES = [(64, 64, 4, 2), (64, 64, 4, 4), (128, 64, 4, 2), (128, 128, 8, 3), (64, 128, 4, 3)]


def tilings(m: int, quick: bool, permutes: tuple[bool, ...], packed: tuple[bool, ...],
            block_ms: tuple[int, ...] = ()) -> list[GemmConfig]:
    """The candidates at M rows: block_m from M as w4a16_config takes it, or each of block_ms."""
    return [GemmConfig(block_m, bn, bk, warps, stages, split, permute, bf16x2)
            for block_m in block_ms or (w4a16_config(m, 1, 4096).block_m,)
            for bn, bk, warps, stages in (QUICK_TILES if quick else TILES)
            for split in SPLITS for permute in permutes for bf16x2 in packed]


def weight_tilings(m: int, packed: tuple[bool, ...]) -> list[GemmConfig]:
    """The weight-tiles kernel's candidates at M rows (none below TILES_FROM)."""
    if m < TILES_FROM:
        return []
    return [GemmConfig(bm, bn, 128, warps, stages, split, bf16x2=bf16x2, weight_tiles=True)
            for bm, bn, warps, stages in WEIGHT_TILES if bm <= max(64, m) for split in (1, 2, 4) for bf16x2 in packed]


def int4_weight(n: int, k: int) -> tuple[torch.Tensor, QuantWeight, torch.Tensor]:
    """A random bf16 weight [n, k] on the GPU, it quantized to int4 in groups of 128 as the kernels take it, and
    that dequantized to bf16."""
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
    qt = quantize(w, QuantScheme("int4", 128))
    qw = QuantWeight("int4", qt.parts["qweight"], qt.parts["scale"], qt.parts["zero"], 128)
    return w, qw, dequantize(qt, torch.bfloat16)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", default="16,64")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--quick", action="store_true", help="three tiles a program, not six")
    p.add_argument("--permuted-only", action="store_true", help="x permuted only (not also read strided)")
    p.add_argument("--bf16x2", choices=("on", "off", "both"), default="on")
    p.add_argument("--block-m", default="", help="rows a program, e.g. 16,32,64 (default: w4a16_config's)")
    p.add_argument("--kernel", choices=("planes", "tiles", "both"), default="both",
                   help="candidates of the planes kernel, the weight-tiles kernel (from TILES_FROM rows) or both")
    p.add_argument("--json", help="write every timing here")
    args = p.parse_args()
    permutes = (True,) if args.permuted_only else (False, True)
    packed = {"on": (True,), "off": (False,), "both": (False, True)}[args.bf16x2]
    block_ms = tuple(int(v) for v in args.block_m.split(",") if v)
    rows: list[dict] = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w, qw, deq = int4_weight(n, k)
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = torch.nn.functional.linear(x, deq).float()
            base = graph_time(partial(torch.nn.functional.linear, x, w)) * 1e6
            served = graph_time(partial(quant_matmul, x, qw)) * 1e6
            print(f"SERVED {name} M={m}: quant_matmul {served:.1f} us, bf16 cuBLAS {base:.1f} us", flush=True)
            table = w4a16_config(m, n, k)
            results = []
            candidates = [dataclasses.replace(table, bf16x2=b) for b in packed]
            others = (tilings(m, args.quick, permutes, packed, block_ms) if args.kernel != "tiles" else []) + (
                weight_tilings(m, packed) if args.kernel != "planes" else [])
            for cfg in candidates + [c for c in others if c not in candidates]:
                try:
                    y = triton_gemm(x, qw, None, cfg).float()
                    err = float((y - ref).norm() / ref.norm())
                    results.append((graph_time(partial(triton_gemm, x, qw, None, cfg)) * 1e6, err, cfg))
                except Exception as exc:  # noqa: BLE001 - a tiling that does not compile is skipped
                    print(f"{name} M={m} {cfg}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            if not results:
                continue
            picked = results[0]
            rows += [{"shape": name, "n": n, "k": k, "m": m, "us": us, "err": err, "bf16_us": base,
                      "table": i < len(packed), **dataclasses.asdict(cfg)} for i, (us, err, cfg) in enumerate(results)]
            results.sort(key=lambda r: r[0])
            for us, err, cfg in results:
                flag = "  WRONG" if err > 1e-2 else ""
                print(f"{name} N={n} K={k} M={m}: {us:8.1f} us  err {err:.1e}{flag}  {cfg}", flush=True)
            print(f"TABLE {name} M={m}: {picked[0]:.1f} us ({picked[2]}) -> {base / picked[0]:.2f}x cuBLAS", flush=True)
            print(f"BEST {name} M={m}: {results[0][0]:.1f} us ({results[0][2]}) vs bf16 cuBLAS {base:.1f} us -> "
                  f"{base / results[0][0]:.2f}x", flush=True)
            if len(packed) > 1:
                best = {b: min((r for r in results if r[2].bf16x2 == b), key=lambda r: r[0]) for b in packed}
                print(f"SUMMARY {name} M={m}: bf16 cuBLAS {base:.1f} us | " + " | ".join(
                    f"{'bf16x2' if b else 'float32'} {r[0]:.1f} us err {r[1]:.1e} "
                    f"(n{r[2].block_n} w{r[2].num_warps} split {r[2].split_k})"
                    for b, r in best.items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
