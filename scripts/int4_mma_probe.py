"""Probe: int4 products of few rows on tensor cores, the group's scale and zero applied to the sums.

    python scripts/int4_mma_probe.py [--quick] [--out FILE]

The fused GEMV (ferrum.kernels.gemv) reads int4 at ~60% of the bandwidth at batch 1: it turns every
weight into a float32 (a mask and an OR) and multiplies it on the CUDA cores, plus each word's scale,
zero and x sums; the W4A16 GEMM (quant_matmul) dequantizes every weight ((q - 8) * scale + zero, to
bf16). Here a weight costs less than one instruction: one lop3 makes two bf16 values 128 + q (the
nibble OR-ed into the mantissa of 128.0, exact), the tensor cores take the sum over a group of x *
(128 + q) in float32, and the group's scale and zero come after, on the sums:
    sum_k x w = s * sum_k x (128 + q) + (z - 136 s) * sum_k x      (w = (q - 8) s + z)
x padded to 16 rows (tl.dot's least); out^T = W @ x^T so that the dequantized weight is the
register operand. Split-K by atomics where N alone gives few programs.

Times each projection of the Llama-3.1-8B shape (weights rotated through 400 MB so that L2 holds
none) against the fused GEMV with its default table, at M = 1 (and 16 / 64 beside bf16 cuBLAS
unless --quick), as CUDA-graph replays. Prints the fraction of the read bandwidth.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ferrum.kernels.quant_weight import QuantWeight  # noqa: E402

GROUP = 128
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@triton.jit
def _bf16_pairs(u: tl.tensor) -> tl.tensor:
    """u [..., 8] int32 (element e the word shifted right by 4 (e // 2)) -> bf16 [..., 8]: element e
    is 128 + the nibble at bits 0-3 (e even) or 16-19 (e odd) of u's element e - e % 2 (the mask and
    the OR are one lop3 a value; an inline-asm lop3 making two values a register was tried: its
    output packing came out wrong, and its speed was the same)."""
    e = tl.arange(0, 8)
    odd = (e % 2 == 1)
    v = tl.where(odd, u >> 16, u) & 0xF
    return (v | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def _group(acc, w_rows, x_cols, S, Z, n, nmask, mmask, kk, j, shifts, g, stride_sn, GROUP: tl.constexpr,  # noqa: ANN001
           BLOCK_N: tl.constexpr, INTERPRETED: tl.constexpr):
    KW: tl.constexpr = GROUP // 8
    words = tl.load(w_rows + (g * KW + j)[None, :], mask=nmask[:, None], other=0)  # [BN, KW]
    u = words[:, :, None] >> shifts[None, None, :]
    wb = tl.reshape(_bf16_pairs(u), [BLOCK_N, GROUP])
    xt = tl.load(x_cols + (g * GROUP + kk)[:, None], mask=mmask[None, :], other=0.0)  # [GROUP, BM]
    if INTERPRETED:  # the interpreter's dot takes bf16 operands as their bits
        part = tl.dot(wb.to(tl.float32), xt.to(tl.float32), input_precision="ieee")
    else:
        part = tl.dot(wb, xt)
    xsum = tl.sum(xt.to(tl.float32), axis=0)
    s = tl.load(S + n * stride_sn + g, mask=nmask, other=0.0).to(tl.float32)
    z = tl.load(Z + n * stride_sn + g, mask=nmask, other=0.0).to(tl.float32)
    return acc + part * s[:, None] + (z - 136.0 * s)[:, None] * xsum[None, :]


@triton.jit
def _w4_mma_kernel(X, W, S, Z, OUT, M, N, groups, stride_xm, stride_wn, stride_sn, stride_om,
                   GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, SPLIT: tl.constexpr,
                   STAGES: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    nmask = n < N
    mmask = m < M
    KW: tl.constexpr = GROUP // 8
    j = tl.arange(0, KW)
    e = tl.arange(0, 8)
    perm = e // 2 + 4 * (e % 2)  # element e of a word's 8: input 8j + perm[e]
    kk = tl.reshape(8 * j[:, None] + perm[None, :], [GROUP])
    shifts = 4 * (e // 2)
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    w_rows = W + n[:, None].to(tl.int64) * stride_wn
    x_cols = X + m[None, :].to(tl.int64) * stride_xm
    share = tl.cdiv(groups, SPLIT)
    first = tl.program_id(2) * share
    last = tl.minimum(first + share, groups)
    if STAGES > 1:
        for g in tl.range(first, last, num_stages=STAGES):
            acc = _group(acc, w_rows, x_cols, S, Z, n, nmask, mmask, kk, j, shifts, g, stride_sn, GROUP, BLOCK_N,
                         STAGES == 1)
    else:  # Triton's interpreter: no tl.range over tensors
        for g in range(first, last):
            acc = _group(acc, w_rows, x_cols, S, Z, n, nmask, mmask, kk, j, shifts, g, stride_sn, GROUP, BLOCK_N,
                         STAGES == 1)
    omask = nmask[:, None] & mmask[None, :]
    optr = OUT + m[None, :].to(tl.int64) * stride_om + n[:, None]
    if SPLIT == 1:
        tl.store(optr, acc.to(OUT.dtype.element_ty), mask=omask)
    else:
        tl.atomic_add(optr, acc, mask=omask, sem="relaxed")


def w4_mma(x: torch.Tensor, w: QuantWeight, out: torch.Tensor, block_n: int, split: int, stages: int,
           warps: int, block_m: int = 16) -> torch.Tensor:
    m, k = x.shape
    n = w.qweight.shape[0]
    words = w.qweight.view(torch.int32)
    if split > 1:
        out.zero_()
    grid = (triton.cdiv(n, block_n), triton.cdiv(m, block_m), split)
    _w4_mma_kernel[grid](x, words, w.scale, w.zero, out, m, n, k // GROUP, x.stride(0), words.stride(0),
                         w.scale.stride(0),
                         out.stride(0), GROUP=GROUP, BLOCK_N=block_n, BLOCK_M=block_m, SPLIT=split,
                         STAGES=stages, num_warps=warps)
    return out


def _each_gemv(gemv: Callable, x: torch.Tensor, ws: list[QuantWeight], table: object) -> None:
    for w in ws:
        gemv(x, w, table, pdl=True)


def _each_mma(x: torch.Tensor, ws: list[QuantWeight], outs: list[torch.Tensor], cfg: tuple[int, ...]) -> None:
    for i, w in enumerate(ws):
        w4_mma(x, w, outs[i % len(outs)], *cfg)


def _each_dense(x: torch.Tensor, dense: list[torch.Tensor]) -> None:
    for d in dense:
        torch.nn.functional.linear(x, d)


def random_int4(n: int, k: int, dev: str) -> QuantWeight:
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
    s = (torch.rand(n, k // GROUP, device=dev) * 1e-2 + 1e-3).to(torch.bfloat16)
    z = (torch.randn(n, k // GROUP, device=dev) * 1e-3).to(torch.bfloat16)
    return QuantWeight("int4", q, s, z, GROUP)


def dequantized(w: QuantWeight) -> torch.Tensor:
    assert w.zero is not None
    q = torch.stack((w.qweight & 0xF, w.qweight >> 4), dim=-1).reshape(w.qweight.shape[0], -1).float()
    n, k = q.shape
    g = (q.reshape(n, k // GROUP, GROUP) - 8) * w.scale.float()[..., None] + w.zero.float()[..., None]
    return g.reshape(n, k)


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.float() - ref).norm() / ref.norm()).item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--interpret-check", action="store_true", help="a small correctness check only (CPU)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    if args.interpret_check:  # TRITON_INTERPRET=1 on the CPU: the pure-Triton unpacking
        sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
        from triton_interpreter import _patch_interpreter_index  # type: ignore[import-not-found]

        _patch_interpreter_index()
        for m, split in ((1, 1), (3, 2)):
            w = random_int4(32, 512, "cpu")
            x = torch.randn(m, 512, dtype=torch.bfloat16)
            out = torch.zeros(m, 32, dtype=torch.float32 if split > 1 else torch.bfloat16)
            got = w4_mma(x, w, out, 16, split, 1, 4)
            print(f"interpret m={m} split={split}: rel err {rel_err(got, x.float() @ dequantized(w).T):.2e}")
        return
    from gemv_bench import graph_time, read_bandwidth

    from ferrum.kernels.config import KernelConfig
    from ferrum.kernels.gemv import gemv

    bw = read_bandwidth()
    print(f"{torch.cuda.get_device_name()}: read bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    record: dict = {"device": torch.cuda.get_device_name(), "read_bandwidth": bw, "rows": []}
    table = KernelConfig().gemv_table("int4")
    configs = [(bn, split, 3, 4) for bn, split in ((16, 1), (32, 1), (64, 1), (32, 2), (64, 2), (64, 4))]
    configs += [(32, 1, 4, 4), (64, 1, 4, 4), (64, 2, 2, 4), (128, 2, 3, 4), (64, 1, 3, 8), (128, 1, 3, 8)]
    if args.quick:
        configs = configs[:6]
    totals: dict[str, float] = {}
    for name, (n, k) in SHAPES.items():
        one = random_int4(n, k, "cuda")
        size = sum(t.numel() * t.element_size() for t in (one.qweight, one.scale, one.zero) if t is not None)
        copies = max(2, -(-(400 << 20) // size))
        ws = [one] + [random_int4(n, k, "cuda") for _ in range(copies - 1)]
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        ref = x.float() @ dequantized(one).T
        got = gemv(x, one, table)
        base = graph_time(partial(_each_gemv, gemv, x, ws, table)) / copies
        line = (f"{name} [{n}x{k}] gemv default: {base * 1e6:.1f} us {size / base / bw:.0%} "
                f"err {rel_err(got, ref):.1e}")
        print(line, flush=True)
        record["rows"].append({"shape": name, "kernel": "gemv", "us": base * 1e6, "fraction": size / base / bw})
        totals.setdefault("gemv", 0.0)
        totals["gemv"] += base
        best = None
        for bn, split, stages, warps in configs:
            label = f"bn{bn} split{split} st{stages} w{warps}"
            try:
                outs = [torch.zeros(1, n, dtype=torch.float32 if split > 1 else torch.bfloat16, device="cuda")
                        for _ in range(2)]
                got = w4_mma(x, one, outs[0], bn, split, stages, warps)
                err = rel_err(got, ref)
                sec = graph_time(partial(_each_mma, x, ws, outs, (bn, split, stages, warps))) / copies
            except Exception as exc:  # noqa: BLE001 - a tiling that does not compile
                print(f"  {label}: FAILED {repr(exc)[:200]}", flush=True)
                continue
            print(f"  {label}: {sec * 1e6:.1f} us {size / sec / bw:.0%} err {err:.1e}", flush=True)
            record["rows"].append({"shape": name, "kernel": label, "us": sec * 1e6, "fraction": size / sec / bw,
                                   "rel_err": err})
            if err < 1e-2 and (best is None or sec < best[0]):
                best = (sec, label)
        if best:
            print(f"  best {best[1]}: {base / best[0]:.2f}x the gemv", flush=True)
            totals.setdefault("mma best", 0.0)
            totals["mma best"] += best[0]
        if not args.quick:
            for m in (16, 64):
                xm = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
                dense = [torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
                         for _ in range(max(2, copies // 4))]
                t_b = graph_time(partial(_each_dense, xm, dense)) / len(dense)
                refm = xm.float() @ dequantized(one).T
                for bm, bn, split in ((16, 64, 1), (32, 64, 1), (64, 64, 1), (64, 128, 1), (16, 128, 1)):
                    out = torch.zeros(m, n, dtype=torch.bfloat16, device="cuda")
                    try:
                        err = rel_err(w4_mma(xm, one, out, bn, split, 3, 4, bm), refm)
                        sec = graph_time(partial(_each_mma, xm, ws, [out], (bn, split, 3, 4, bm))) / copies
                    except Exception as exc:  # noqa: BLE001
                        print(f"  M={m} bm{bm} bn{bn}: FAILED {repr(exc)[:200]}", flush=True)
                        continue
                    print(f"  M={m} bm{bm} bn{bn}: {sec * 1e6:.1f} us, bf16 cuBLAS {t_b * 1e6:.1f} us: "
                          f"{t_b / sec:.2f}x err {err:.1e}", flush=True)
                    record["rows"].append({"shape": name, "m": m, "kernel": f"bm{bm} bn{bn}", "us": sec * 1e6,
                                           "cublas_us": t_b * 1e6, "rel_err": err})
                del dense
        del ws
    print("four projections (one layer):", {k: f"{v * 1e6:.1f} us" for k, v in totals.items()}, flush=True)
    record["layer_us"] = {k: v * 1e6 for k, v in totals.items()}
    if args.out:
        args.out.write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
