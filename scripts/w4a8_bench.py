"""int4 products of many rows (large decode batches, prefill) on a CUDA GPU, on the Llama-3.1-8B
projections: bf16 cuBLAS on the unquantized weight against the int4 paths of ferrum.kernels.quant_matmul:

    default      as served by default (the W4A16 kernels below DEQUANTIZE_FROM rows, then the weight
                 dequantized to bf16 and cuBLAS)
    w8a8_int8    GemmRules(int4_w8a8_rows=DEQUANTIZE_FROM): from DEQUANTIZE_FROM rows the weight
                 requantized to int8 a channel (requantize_int4), x to int8 a row, the Triton int8 GEMM
                 with the scales in its epilogue (w8a8_int8_gemm)
    w8a8_fp8     the same rule in fp8 e4m3: requantize_int4(w, fp8), x per row, torch._scaled_mm
    int_mm       the int8 requantization with torch._int_mm and the scale kernel (int8's own W8A8)

each path's parts alone (the requantizations, the dequantization, each GEMM on a requantized weight) and
the Triton int8 GEMM's tilings (TILES, on a requantized weight). Prints one line per shape and M
(CUDA-graph medians, us) with each path's error against the dequantized weight's product in float32, a
LAYER line per M (the four projections' sums), and writes them as JSON. (A W4A8 kernel that used the int4
codes as int8 where they lie, one int8 MMA a group of 128 scaled into float32, ran a layer 0.30-0.86x bf16
on an H100, slower than these at every M: benchmarks/quantization.md, 2026-12-08.)

    python scripts/w4a8_bench.py [--m 64,129,192,256,512,2048] [--shapes qkv,o,gate_up,down] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
import triton

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gemv_bench import graph_time  # noqa: E402 - median of CUDA-graph replays
from w4a16_sweep import int4_weight  # noqa: E402 - a random bf16 weight, as int4 g128, dequantized

from ferrum.kernels import quant_matmul as qm  # noqa: E402
from ferrum.kernels.config import GemmRules  # noqa: E402
from ferrum.kernels.quant_matmul import DEQUANTIZE_FROM, GemmConfig  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TILES = [GemmConfig(64, 128, 128, 4, 4), GemmConfig(128, 128, 128, 8, 3), GemmConfig(64, 64, 128, 4, 4),
         GemmConfig(128, 256, 128, 8, 3), GemmConfig(64, 256, 128, 8, 3), GemmConfig(128, 128, 64, 4, 4),
         GemmConfig(128, 64, 128, 4, 4)]
PATHS = ("default", "w8a8_int8", "w8a8_fp8", "int_mm")


def scaled_mm_rows(x: torch.Tensor, wf8: qm.QuantWeight, pad: int) -> Callable[[], torch.Tensor]:
    """torch._scaled_mm alone on x rounded to fp8 per row, its rows padded with zeros to a multiple of `pad`
    (cuBLAS's choice of kernel by M: odd row counts may take a slower one)."""
    m = x.shape[0]
    rows = -(-m // pad) * pad
    xq, xs = qm.quantize_rows(torch.cat([x, x.new_zeros(rows - m, x.shape[1])]), torch.float8_e4m3fn)
    return partial(torch._scaled_mm, xq, wf8.qweight.t(), scale_a=xs[:, None], scale_b=wf8.scale[None, :],
                   out_dtype=x.dtype)


def int_mm_path(x: torch.Tensor, qw: qm.QuantWeight) -> torch.Tensor:
    """The int8 requantization, then int8's own W8A8 (torch._int_mm and the scale kernel)."""
    return qm._w8a8_int8(x, qm.requantize_int4(qw), None)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", default="64,129,192,256,512,2048")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--json", help="write every timing here")
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    rows: list[dict] = []
    fp8 = torch.float8_e4m3fn
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w, qw, deq = int4_weight(n, k)
        w8, wf8 = qm.requantize_int4(qw), qm.requantize_int4(qw, fp8)
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ deq.float().T
            paths: dict[str, Callable[[], Any]] = {
                "bf16": partial(torch.nn.functional.linear, x, w),
                "default": partial(qm.quant_matmul, x, qw),
                "w8a8_int8": partial(qm.quant_matmul, x, qw, rules=GemmRules(int4_w8a8_rows=DEQUANTIZE_FROM)),
                "w8a8_fp8": partial(qm.quant_matmul, x, qw,
                                    rules=GemmRules(int4_w8a8_rows=DEQUANTIZE_FROM, int4_w8a8_format="fp8")),
                "int_mm": partial(int_mm_path, x, qw),
                "requantize_int8": partial(qm.requantize_int4, qw),
                "requantize_fp8": partial(qm.requantize_int4, qw, fp8),
                "dequantize": partial(qm.dequantize_int4, qw, torch.bfloat16),
                "int8_gemm": partial(qm.w8a8_int8_gemm, x, w8),
                "fp8_gemm": partial(qm._w8a8_fp8, x, wf8, None),
                "int_mm_gemm": partial(qm._w8a8_int8, x, w8, None),
                "scaled_mm": scaled_mm_rows(x, wf8, 1),
                "scaled_mm_pad64": scaled_mm_rows(x, wf8, 64),
                "scaled_mm_pad128": scaled_mm_rows(x, wf8, 128),
            }
            for tile in TILES:
                label = f"tile{tile.block_m}x{tile.block_n}x{tile.block_k}x{tile.num_warps}x{tile.num_stages}"
                paths[label] = partial(qm.w8a8_int8_gemm, x, w8, None, tile)
            row: dict = {"shape": name, "n": n, "k": k, "m": m}
            for label, fn in paths.items():
                try:
                    out = fn()
                    if isinstance(out, torch.Tensor) and out.shape == ref.shape and label != "bf16":
                        row[label + "_err"] = float((out.float() - ref).norm() / ref.norm())
                    row[label] = graph_time(fn) * 1e6
                except Exception as exc:  # noqa: BLE001 - a tiling that does not compile is reported and skipped
                    print(f"{name} M={m} {label}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            tiles = [(v, key) for key, v in row.items() if key.startswith("tile") and not key.endswith("_err")]
            row["tile_best"] = min(tiles, default=(float("inf"), "none"))[1]
            rows.append(row)
            print(f"{name:8} M={m:5}: bf16 {row['bf16']:7.1f} | " + " | ".join(
                f"{key} {row.get(key, float('nan')):7.1f} ({row['bf16'] / row.get(key, float('nan')):.2f}x, "
                f"err {row.get(key + '_err', 0):.1e})" for key in PATHS)
                + f" | parts: requant i8 {row.get('requantize_int8', 0):.1f} f8 {row.get('requantize_fp8', 0):.1f}, "
                f"dequant {row.get('dequantize', 0):.1f}, int8 gemm {row.get('int8_gemm', 0):.1f}, fp8 gemm "
                f"{row.get('fp8_gemm', 0):.1f} (_scaled_mm {row.get('scaled_mm', 0):.1f}, rows padded to 64: "
                f"{row.get('scaled_mm_pad64', 0):.1f}, 128: {row.get('scaled_mm_pad128', 0):.1f}), "
                f"_int_mm {row.get('int_mm_gemm', 0):.1f}; best tile "
                f"{row['tile_best']} {row.get(row['tile_best'], 0):.1f}", flush=True)
    for m in sorted({r["m"] for r in rows}):
        sel = [r for r in rows if r["m"] == m]
        totals = {key: sum(r.get(key, float("nan")) for r in sel) for key in ("bf16", *PATHS)}
        print(f"LAYER M={m}: bf16 {totals['bf16']:.1f} us | " + " | ".join(
            f"{key} {totals[key]:.1f} ({totals['bf16'] / totals[key]:.2f}x)" for key in PATHS), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
