"""Ferrum's int4 products (ferrum.kernels.quant_matmul.quant_matmul: the GEMV up to its rows, then the
W4A16 Triton GEMM or dequantize + cuBLAS) against torch's own int4 kernel (`_weight_int4pack_mm`,
tinygemm: what gpt-fast and torchao's int4 weight-only run) and bf16 cuBLAS, on the Llama-3.1-8B
projections, groups of 128, at 1 to 256 rows. The same quantized weights go to both int4 kernels
(tinygemm dequantizes (q - 8) * scale + zero, as Ferrum's format does). Each time is the median of CUDA
graph replays; the error is against the dequantized weight's bf16 product. Beside them, up to
--gemv-rows rows, Ferrum's decode GEMV (which quant_matmul takes at 1 row only) for int4, int8 and fp8
(per-channel scales): whether more rows should take it. Prints the GPU, a table per shape, the
layer's sum, and writes JSON with --out.

    python scripts/int4_gemm_peers.py [--m 1,4,16,64,256] [--gemv-rows 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gemv_bench import graph_time  # noqa: E402 - median of CUDA-graph replays

from ferrum.kernels.config import KernelConfig  # noqa: E402
from ferrum.kernels.gemv import gemv  # noqa: E402
from ferrum.kernels.quant_matmul import quant_matmul  # noqa: E402
from ferrum.kernels.quant_weight import QuantWeight  # noqa: E402
from ferrum.weights.quantization.arith import dequantize, quantize  # noqa: E402
from ferrum.weights.quantization.scheme import QuantScheme  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
GROUP = 128


def tinygemm_weight(qweight: torch.Tensor, scale: torch.Tensor,
                    zero: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Ferrum's int4 parts in torch's int4pack layout: uint8 [N, K/2] with the even input in the high
    nibble (Ferrum's has it in the low one), and scales_and_zeros [K/g, N, 2] bf16."""
    swapped = ((qweight & 0xF) << 4) | (qweight >> 4)
    packed = torch.ops.aten._convert_weight_to_int4pack(swapped.contiguous(), 8)
    scales_and_zeros = torch.stack((scale.t(), zero.t()), dim=-1).to(torch.bfloat16).contiguous()
    return packed, scales_and_zeros


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", default="1,2,4,8,16,32,64,128,256")
    p.add_argument("--gemv-rows", type=int, default=8, help="the GEMV column up to this many rows")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    props = torch.cuda.get_device_properties(0)
    print(f"GPU: {props.name} (cc {props.major}.{props.minor}); torch {torch.__version__}", flush=True)
    rows = [int(v) for v in args.m.split(",")]
    results: dict[str, dict[int, dict[str, float]]] = {}
    torch.manual_seed(0)
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
        qt = quantize(w, QuantScheme("int4", GROUP))
        qw = QuantWeight("int4", qt.parts["qweight"], qt.parts["scale"], qt.parts["zero"], GROUP)
        deq = dequantize(qt, torch.bfloat16)
        packed, sz = tinygemm_weight(qt.parts["qweight"], qt.parts["scale"], qt.parts["zero"])
        others = {}  # int8 and fp8 per channel, for the GEMV column
        for kind in ("int8", "fp8"):
            q8 = quantize(w, QuantScheme(kind))
            others[kind] = QuantWeight(kind, q8.parts["qweight"], q8.parts["scale"], None, 0)
        int4_bytes = qt.nbytes
        results[name] = {}
        print(f"\n{name} [{n} x {k}], int4 g{GROUP}: {int4_bytes / 1e6:.1f} MB (bf16 {n * k * 2 / 1e6:.1f} MB)")
        print(f"{'M':>5} | {'bf16 cuBLAS us':>14} | {'ferrum int4 us':>14} | {'tinygemm us':>11} | "
              f"{'ferrum / tinygemm':>17} | {'ferrum / bf16':>13} | err ferrum | err tinygemm")
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = torch.nn.functional.linear(x, deq).float()
            scale = ref.abs().max().item()
            ours = quant_matmul(x, qw).float()
            tiny = torch.ops.aten._weight_int4pack_mm(x, packed, GROUP, sz).float()
            err_ours = (ours - ref).abs().max().item() / scale
            err_tiny = (tiny - ref).abs().max().item() / scale
            t_bf16 = graph_time(partial(torch.nn.functional.linear, x, w)) * 1e6
            t_ours = graph_time(partial(quant_matmul, x, qw)) * 1e6
            t_tiny = graph_time(partial(torch.ops.aten._weight_int4pack_mm, x, packed, GROUP, sz)) * 1e6
            results[name][m] = {"bf16_us": t_bf16, "ferrum_us": t_ours, "tinygemm_us": t_tiny,
                                "err_ferrum": err_ours, "err_tinygemm": err_tiny}
            extra = ""
            if m <= args.gemv_rows:
                for kind, weight in (("int4", qw), *others.items()):
                    table = KernelConfig().gemv_table(kind)  # type: ignore[arg-type]
                    t_gemv = graph_time(partial(gemv, x, weight, table)) * 1e6
                    results[name][m][f"gemv_{kind}_us"] = t_gemv
                    if kind != "int4":
                        results[name][m][f"{kind}_us"] = graph_time(partial(quant_matmul, x, weight)) * 1e6
                    extra += f" | GEMV {kind} {t_gemv:.1f}"
                extra += f" (int8 as served {results[name][m]['int8_us']:.1f}, fp8 {results[name][m]['fp8_us']:.1f})"
                if m > 1:
                    err = (gemv(x, qw, KernelConfig().gemv_table("int4")).float() - ref).abs().max().item() / scale
                    extra += f" | GEMV int4 err {err:.2e}"
            print(f"{m:>5} | {t_bf16:>14.1f} | {t_ours:>14.1f} | {t_tiny:>11.1f} | {t_ours / t_tiny:>17.2f} | "
                  f"{t_ours / t_bf16:>13.2f} | {err_ours:.2e} | {err_tiny:.2e}{extra}", flush=True)
    print("\nthe four projections summed (one layer), us:")
    print(f"{'M':>5} | {'bf16':>8} | {'ferrum':>8} | {'tinygemm':>8} | ferrum / tinygemm | ferrum / bf16")
    layer = {}
    for m in rows:
        keys = [key for key in results["qkv"][m] if key.endswith("_us")]
        total = {key: sum(results[s][m][key] for s in SHAPES) for key in keys}
        layer[m] = total
        gemvs = " | ".join(f"{key[:-3]} {total[key]:.1f}" for key in keys if key.startswith(("gemv", "int8", "fp8")))
        print(f"{m:>5} | {total['bf16_us']:>8.1f} | {total['ferrum_us']:>8.1f} | {total['tinygemm_us']:>8.1f} | "
              f"{total['ferrum_us'] / total['tinygemm_us']:>17.2f} | {total['ferrum_us'] / total['bf16_us']:>13.2f}"
              + (f" | {gemvs}" if gemvs else ""))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "int4_gemm_peers.json").write_text(json.dumps(
            {"gpu": props.name, "torch": torch.__version__, "group": GROUP, "shapes": results, "layer": layer},
            indent=1))


if __name__ == "__main__":
    main()
