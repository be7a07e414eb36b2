"""int4 products of many rows (large decode batches, prefill) on a CUDA GPU, on the Llama-3.1-8B
projections: bf16 cuBLAS on the unquantized weight against the int4 paths of
ferrum.kernels.quant_matmul and two candidates:

    default      quant_matmul as served by default (the W4A16 kernels below DEQUANTIZE_FROM rows, then
                 the weight dequantized to bf16 and cuBLAS)
    int8_rule    quant_matmul with GemmRules(int4_int8_rows=DEQUANTIZE_FROM) (KernelConfig.int4_int8_rows):
                 from DEQUANTIZE_FROM rows the weight requantized to int8 with a scale an output channel
                 (requantize_int4), x quantized per row (quantize_rows), torch._int_mm, the scales
                 (_scale_kernel); `int8` is that path at every M
    triton       the same with the product and the scales in one Triton int8 GEMM (a candidate of this
                 script only: each tiling of TRITON_TILES)
    groups       the int4 codes used as int8 where they lie, one int8 MMA a group of 128 scaled into float32
                 (x per row and group; the weight exact; no transient buffer; a candidate of this script
                 only: each tiling and split of GROUPS_TILES)

and each part alone (the requantization, the dequantization, the int8 product of a requantized weight).
Prints one line per shape and M (CUDA-graph medians, us) with each path's error against the
dequantized weight's product in float32, a LAYER line per M (the four projections' sums; the candidates'
best tiling each), and writes them as JSON.

    python scripts/w4a8_bench.py [--m 64,96,129,192,256,512,2048] [--shapes qkv,o,gate_up,down] [--json FILE]
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
import triton.language as tl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gemv_bench import graph_time  # noqa: E402 - median of CUDA-graph replays
from w4a16_sweep import int4_weight  # noqa: E402 - a random bf16 weight, as int4 g128, dequantized

from ferrum.kernels import quant_matmul as qm  # noqa: E402
from ferrum.kernels.config import GemmRules  # noqa: E402
from ferrum.kernels.quant_matmul import DEQUANTIZE_FROM  # noqa: E402
from ferrum.kernels.quant_weight import QuantWeight  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
TRITON_TILES = [(128, 128, 128, 8, 3), (128, 256, 128, 8, 3), (64, 128, 128, 4, 4), (128, 128, 64, 4, 4),
                (256, 128, 128, 8, 3), (64, 256, 128, 8, 3)]  # block_m, block_n, block_k, warps, stages


@triton.jit
def _tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's output rows and columns, programs ordered GROUP_M row tiles at a time (L2 reuse)."""
    pid = tl.program_id(0)
    grid_m, grid_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    size_m = min(grid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % width) % size_m
    pid_n = (pid % width) // size_m
    return pid_m * BLOCK_M + tl.arange(0, BLOCK_M), pid_n * BLOCK_N + tl.arange(0, BLOCK_N)


@triton.jit
def _i8_gemm_kernel(X, W, XS, WS, OUT, M, N, K, stride_xm, stride_wn, stride_om,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    rm, rn = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.int32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(X + rm[:, None].to(tl.int64) * stride_xm + (k0 + rk)[None, :], mask=(rm < M)[:, None], other=0)
        b = tl.load(W + rn[None, :].to(tl.int64) * stride_wn + (k0 + rk)[:, None], mask=(rn < N)[None, :], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    y = acc.to(tl.float32) * tl.load(XS + rm, mask=rm < M, other=0.0)[:, None] * tl.load(
        WS + rn, mask=rn < N, other=0.0)[None, :]
    tl.store(OUT + rm[:, None].to(tl.int64) * stride_om + rn[None, :], y.to(OUT.dtype.element_ty),
             mask=(rm < M)[:, None] & (rn < N)[None, :])


@triton.jit
def _quantize_groups_kernel(X, Q, XS, XSUM, K, G, stride_xm, GROUP: tl.constexpr):
    """x [M, K] -> int8 q (one step a row's GROUP inputs: their largest magnitude / 127), the steps [M, G] and
    each group's sum of the rounded x, step * sum(q) [M, G] (float32). One program a (row, group)."""
    row, g = tl.program_id(0).to(tl.int64), tl.program_id(1)
    kk = g * GROUP + tl.arange(0, GROUP)
    x = tl.load(X + row * stride_xm + kk, mask=kk < K, other=0.0).to(tl.float32)
    step = tl.maximum(tl.max(tl.abs(x), axis=0), 1e-30) / 127.0
    v = x / step
    q = tl.where(v >= 0, tl.floor(v + 0.5), -tl.floor(0.5 - v))
    tl.store(Q + row * K + kk, q.to(tl.int8), mask=kk < K)
    tl.store(XS + row * G + g, step)
    tl.store(XSUM + row * G + g, step * tl.sum(q, axis=0))  # the rounded x's: the product is x rounded times w


@triton.jit
def _w4a8_groups_kernel(XQ, XS, XSUM, W, S, Z, OUT, M, N, K, G, stride_wn, stride_sn, stride_om,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, SPLIT: tl.constexpr):
    """out tile [BLOCK_M, BLOCK_N] = sum over groups of 128: step_x[m, g] * scale[n, g] * (xq . q) + xsum[m, g] *
    (zero[n, g] - 8 scale[n, g]), the int4 codes q (0..15) used as int8 where they lie: the weight exact, x
    rounded to int8 per row and group; one int8 MMA a group, its int32 sums scaled into float32. SPLIT > 1:
    program (tile, s) sums the s-th of SPLIT runs of groups into float32 partials OUT [SPLIT, M, N]."""
    rm, rn = _tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    mmask, nmask = rm < M, rn < N
    rk = tl.arange(0, 128)
    rw = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    per = tl.cdiv(G, SPLIT)
    for g in range(tl.program_id(1) * per, tl.minimum(G, (tl.program_id(1) + 1) * per)):
        a = tl.load(XQ + rm[:, None].to(tl.int64) * K + (g * 128 + rk)[None, :], mask=mmask[:, None], other=0)
        words = tl.load(W + rn[:, None].to(tl.int64) * stride_wn + (g * 16 + rw)[None, :], mask=nmask[:, None],
                        other=0)
        p0 = (words & 0xF).to(tl.int8)
        p1 = ((words >> 4) & 0xF).to(tl.int8)
        p2 = ((words >> 8) & 0xF).to(tl.int8)
        p3 = ((words >> 12) & 0xF).to(tl.int8)
        p4 = ((words >> 16) & 0xF).to(tl.int8)
        p5 = ((words >> 20) & 0xF).to(tl.int8)
        p6 = ((words >> 24) & 0xF).to(tl.int8)
        p7 = ((words >> 28) & 0xF).to(tl.int8)
        a0 = tl.reshape(tl.join(p0, p4), (BLOCK_N, 32))
        a1 = tl.reshape(tl.join(p1, p5), (BLOCK_N, 32))
        a2 = tl.reshape(tl.join(p2, p6), (BLOCK_N, 32))
        a3 = tl.reshape(tl.join(p3, p7), (BLOCK_N, 32))
        b0 = tl.reshape(tl.join(a0, a2), (BLOCK_N, 64))
        b1 = tl.reshape(tl.join(a1, a3), (BLOCK_N, 64))
        wq = tl.reshape(tl.join(b0, b1), (BLOCK_N, 128))  # input order: column 8j + i is word j's input i
        dots = tl.dot(a, tl.trans(wq), tl.zeros((BLOCK_M, BLOCK_N), tl.int32), out_dtype=tl.int32)
        xs = tl.load(XS + rm * G + g, mask=mmask, other=0.0)
        xsum = tl.load(XSUM + rm * G + g, mask=mmask, other=0.0)
        s = tl.load(S + rn * stride_sn + g, mask=nmask, other=0.0).to(tl.float32)
        z = tl.load(Z + rn * stride_sn + g, mask=nmask, other=0.0).to(tl.float32)
        acc += dots.to(tl.float32) * xs[:, None] * s[None, :] + xsum[:, None] * (z - 8.0 * s)[None, :]
    out = OUT + tl.program_id(1).to(tl.int64) * M * N if SPLIT > 1 else OUT
    tl.store(out + rm[:, None].to(tl.int64) * stride_om + rn[None, :], acc.to(OUT.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])


def w4a8_groups(x: torch.Tensor, w: QuantWeight, tile: tuple[int, int, int, int, int]) -> torch.Tensor:
    """int4 in groups of 128 against x rounded to int8 per row and group, the codes as int8 in one Triton GEMM
    (tile: block_m, block_n, warps, stages, split; a split's float32 partials summed by torch)."""
    m, k = x.shape
    n, groups = w.out_features, k // 128
    xq = torch.empty(m, k, dtype=torch.int8, device=x.device)
    xs = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    xsum = torch.empty_like(xs)
    _quantize_groups_kernel[(m, groups)](x, xq, xs, xsum, k, groups, x.stride(0), GROUP=128, num_warps=1)
    words = w.qweight.view(torch.int32)
    bm, bn, warps, stages, split = tile
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if split == 1 else torch.empty(
        split, m, n, dtype=torch.float32, device=x.device)
    _w4a8_groups_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn), split)](
        xq, xs, xsum, words, w.scale, w.zero, out, m, n, k, groups, words.stride(0), w.scale.stride(0),
        n, BLOCK_M=bm, BLOCK_N=bn, GROUP_M=8, SPLIT=split, num_warps=warps, num_stages=stages)
    return out if split == 1 else out.sum(0).to(x.dtype)


def best_of(row: dict, kind: str) -> tuple[float, str]:
    """The fastest timing of a row's candidates of one kind ("triton", "groups") and its key; inf where none ran."""
    times = [(v, key) for key, v in row.items()
             if key.startswith(kind) and key[len(kind):len(kind) + 1].isdigit() and not key.endswith("_err")]
    return min(times, default=(float("inf"), "none"))


def requantized_product(x: torch.Tensor, w: QuantWeight) -> torch.Tensor:
    """The served W8A8 path's two steps: the int4 weight requantized, then int8's W8A8."""
    return qm._w8a8_int8(x, qm.requantize_int4(w), None)


GROUPS_TILES = [(64, 128, 4, 3, 1), (128, 128, 8, 3, 1), (128, 64, 4, 3, 1), (64, 64, 4, 4, 1), (128, 256, 8, 3, 1),
                (64, 64, 4, 4, 2), (64, 64, 4, 4, 4), (64, 128, 4, 3, 4), (128, 64, 4, 3, 2)]


def triton_int8(x: torch.Tensor, w: QuantWeight, tile: tuple[int, int, int, int, int]) -> torch.Tensor:
    """The int4 weight requantized, x per row, one Triton GEMM with the scales in its epilogue."""
    w8 = qm.requantize_int4(w)
    xq, xs = qm.quantize_rows(x, torch.int8)
    m, k = x.shape
    n = w8.qweight.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    bm, bn, bk, warps, stages = tile
    _i8_gemm_kernel[(triton.cdiv(m, bm) * triton.cdiv(n, bn),)](
        xq, w8.qweight, xs, w8.scale, out, m, n, k, xq.stride(0), w8.qweight.stride(0), out.stride(0),
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=warps, num_stages=stages)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--m", default="64,96,129,192,256,512,2048")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--json", help="write every timing here")
    args = p.parse_args()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    rows: list[dict] = []
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w, qw, deq = int4_weight(n, k)
        w8 = qm.requantize_int4(qw)
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            ref = x.float() @ deq.float().T
            paths: dict[str, Callable[[], Any]] = {
                "bf16": partial(torch.nn.functional.linear, x, w),
                "default": partial(qm.quant_matmul, x, qw),
                "int8_rule": partial(qm.quant_matmul, x, qw, rules=GemmRules(int4_int8_rows=DEQUANTIZE_FROM)),
                "int8": partial(requantized_product, x, qw),
                "requantize": partial(qm.requantize_int4, qw),
                "dequantize_only": partial(qm.dequantize_int4, qw, torch.bfloat16),
                "int8_product_only": partial(qm._w8a8_int8, x, w8, None),
                "int_mm_only": partial(torch._int_mm, qm.quantize_rows(x, torch.int8)[0], w8.qweight.t()),
            }
            for tile in TRITON_TILES:
                paths["triton" + "x".join(map(str, tile))] = partial(triton_int8, x, qw, tile)
            for gtile in GROUPS_TILES:
                paths["groups" + "x".join(map(str, gtile))] = partial(w4a8_groups, x, qw, gtile)
            row: dict = {"shape": name, "n": n, "k": k, "m": m}
            for label, fn in paths.items():
                try:
                    out = fn()
                    if isinstance(out, torch.Tensor) and out.shape == ref.shape and out.dtype == torch.bfloat16 \
                            and label != "bf16":
                        row[label + "_err"] = float((out.float() - ref).norm() / ref.norm())
                    row[label] = graph_time(fn) * 1e6
                except Exception as exc:  # noqa: BLE001 - a tiling that does not compile is reported and skipped
                    print(f"{name} M={m} {label}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
            best = {kind: best_of(row, kind) for kind in ("triton", "groups")}
            row.update({f"{kind}_best": key for kind, (_, key) in best.items()})
            rows.append(row)
            print(f"{name:8} M={m:5}: bf16 {row['bf16']:7.1f} | default {row['default']:7.1f} "
                  f"({row['bf16'] / row['default']:.2f}x) | int8 {row['int8']:7.1f} "
                  f"({row['bf16'] / row['int8']:.2f}x, err {row.get('int8_err', 0):.1e}) | "
                  + " | ".join(f"best {kind} {us:7.1f} ({row['bf16'] / us:.2f}x, {key}, "
                               f"err {row.get(key + '_err', 0):.1e})" for kind, (us, key) in best.items())
                  + f" | parts: requantize {row['requantize']:.1f}, dequantize {row['dequantize_only']:.1f}, "
                  f"int8 product {row['int8_product_only']:.1f}, _int_mm {row['int_mm_only']:.1f}", flush=True)
    for m in sorted({r["m"] for r in rows}):
        sel = [r for r in rows if r["m"] == m]
        totals = {key: sum(r[key] for r in sel) for key in ("bf16", "default", "int8_rule", "int8")}
        totals.update({kind: sum(best_of(r, kind)[0] for r in sel) for kind in ("triton", "groups")})
        print(f"LAYER M={m}: bf16 {totals['bf16']:.1f} us | " + " | ".join(
            f"{key} {totals[key]:.1f} ({totals['bf16'] / totals[key]:.2f}x)"
            for key in ("default", "int8_rule", "int8", "triton", "groups")), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
