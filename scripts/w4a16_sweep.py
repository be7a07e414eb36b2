"""The int4 W4A16 Triton GEMM (ferrum.kernels.quant_matmul.triton_gemm) at decode-batch sizes on a
CUDA GPU: each tiling of a small grid against bf16 cuBLAS on the Llama-3.1-8B projections; prints,
per shape and M, every tiling's time and the best against cuBLAS.

    python scripts/w4a16_sweep.py [--m 16,64]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gemv_bench import graph_time  # noqa: E402 - median of CUDA-graph replays

from ferrum.kernels.quant_matmul import GemmConfig, triton_gemm  # noqa: E402
from ferrum.kernels.quant_weight import QuantWeight  # noqa: E402
from ferrum.weights.quantization.arith import quantize  # noqa: E402
from ferrum.weights.quantization.scheme import QuantScheme  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TILINGS = [GemmConfig(bm, bn, bk, w, s) for bm, bn, bk, w, s in [
    (16, 64, 128, 4, 4), (16, 32, 128, 4, 4), (16, 16, 128, 2, 4), (16, 128, 128, 4, 3), (16, 64, 64, 4, 4),
    (16, 32, 64, 2, 4), (32, 64, 128, 4, 4), (32, 32, 128, 4, 4), (64, 64, 128, 4, 3), (64, 32, 128, 4, 4),
    (64, 128, 64, 4, 3), (32, 128, 128, 4, 3)]]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", default="16,64")
    args = p.parse_args()
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
        qt = quantize(w, QuantScheme("int4", 128))
        qw = QuantWeight("int4", qt.parts["qweight"], qt.parts["scale"], qt.parts["zero"], 128)
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            base = graph_time(partial(torch.nn.functional.linear, x, w)) * 1e6
            results = []
            for cfg in TILINGS:
                if cfg.block_m > max(16, m):
                    continue
                try:
                    results.append((graph_time(partial(triton_gemm, x, qw, None, cfg)) * 1e6, cfg))
                except Exception as exc:  # noqa: BLE001 - a tiling that does not compile is skipped
                    print(f"{name} M={m} {cfg}: {type(exc).__name__}", flush=True)
            results.sort(key=lambda r: r[0])
            for us, cfg in results:
                print(f"{name} N={n} K={k} M={m}: {us:8.1f} us  {cfg}", flush=True)
            print(f"BEST {name} M={m}: {results[0][0]:.1f} us ({results[0][1]}) vs bf16 cuBLAS {base:.1f} us -> "
                  f"{base / results[0][0]:.2f}x", flush=True)


if __name__ == "__main__":
    main()
