"""Batch-1 projections of the Llama-3.2-1B shape: cuBLAS vs Ferrum's fused Triton GEMV, on a GPU.

For each projection shape, 16 copies of the weight (one per layer, so that L2 holds none of them
between calls) are multiplied by one activation row inside a CUDA graph; the time per call gives
the achieved read bandwidth. Then whole chains (16 layers of q/k/v, o, gate/up, down and the LM
head) as the layered path runs them (norm, cuBLAS, activation kernels) and fused, with the best
and the default table (GemvTable); then batch-1 decode attention by split count and tile size.
Fractions are of the pure-read bandwidth measured first. Prints a table; JSON to --out.

    python scripts/gemv_bench.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferrum.kernels import norm as tk_norm  # noqa: E402
from ferrum.kernels import paged_attention as tk_attention  # noqa: E402
from ferrum.kernels.config import GemvTable, KernelConfig  # noqa: E402
from ferrum.kernels.gemv import gemv, slicing  # noqa: E402

HIDDEN, INTER, VOCAB, LAYERS = 2048, 8192, 128256, 16
QKV = 2048 + 2 * 512
SHAPES = {  # name: (weight rows, K, gated)
    "qkv": (QKV, HIDDEN, False),
    "o": (HIDDEN, HIDDEN, False),
    "gate_up": (2 * INTER, HIDDEN, True),
    "down": (HIDDEN, INTER, False),
    "lm_head": (VOCAB, HIDDEN, False),
}


def table(features: int, k_slice: int, warps: int) -> GemvTable:
    """A GemvTable whose projections read K in `k_slice`-wide slices (all of K when it is narrower),
    `features` output features a program, with `warps` warps."""
    return GemvTable(features_per_program=features, num_warps=warps, whole_k_with_norm=k_slice,
                     whole_k_without_norm=k_slice, k_slice=k_slice)


def describe(t: GemvTable) -> str:
    return f"features {t.features_per_program} slice {t.k_slice} warps {t.num_warps}"


NORM_CONFIGS = [table(f, k, w) for f, k, w in [(2, 2048, 4), (4, 2048, 4), (2, 2048, 2), (4, 2048, 8), (1, 2048, 2),
                                             (2, 1024, 4)]]
CONFIGS = [table(f, k, w) for f, k, w in [
    (2, 1024, 4), (4, 2048, 8), (2, 2048, 4), (4, 8192, 8), (2, 8192, 8), (2, 8192, 4), (4, 4096, 8), (1, 2048, 2),
    (2, 2048, 2), (8, 8192, 16),
]]


def graph_time(fn, reps: int = 30) -> float:
    """Median seconds of one replay of a graph of fn()."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del g
    return statistics.median(times)


def read_bandwidth() -> float:
    """Bytes a pure read moves per second (a float32 sum over 2 GiB of bf16): what a GEMV does."""
    big = torch.randn(2**30, dtype=torch.bfloat16, device="cuda")
    t = graph_time(lambda: big.sum(dtype=torch.float32), 10)
    return 2 * 2**30 / t


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--quick", action="store_true", help="fewer configurations (CPU smoke test)")
    args = parser.parse_args()
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    rows: list[tuple] = []
    bw = read_bandwidth()
    rows.append(("read bandwidth (sum of 2 GiB)", f"{bw / 1e9:.0f} GB/s", ""))
    best: dict[str, tuple[float, GemvTable]] = {}
    best_norm: dict[str, GemvTable] = {}

    weights: dict[str, list[torch.Tensor]] = {}
    x = torch.randn(1, INTER, dtype=dt, device=dev)
    nw = torch.rand(INTER, dtype=dt, device=dev) + 0.5
    for name, (n, k, gated) in SHAPES.items():
        copies = 2 if name == "lm_head" else LAYERS
        ws = [torch.randn(n, k, dtype=dt, device=dev) * 0.02 for _ in range(copies)]
        weights[name] = ws
        nbytes = n * k * 2
        xk = x[:, :k]
        t = graph_time(lambda xk=xk, ws=ws: [F.linear(xk, w) for w in ws]) / copies
        rows.append((f"{name} [{n}x{k}] cuBLAS", f"{t * 1e6:.2f} us",
                     f"{nbytes / t / 1e9:.0f} GB/s = {nbytes / t / bw:.0%} of read BW"))
        results = []
        for cfg in CONFIGS[:4] if args.quick else CONFIGS:
            if k > cfg.k_slice and k % cfg.k_slice:
                continue
            try:
                ref = F.linear(xk.float(), ws[0].float())
                if gated:
                    g, u = ref.split(n // 2, -1)
                    ref = F.silu(g) * u
                got = gemv(xk, ws[0], cfg, gated=gated).float()
                err = ((got - ref).norm() / ref.norm()).item()
                if not err < 2e-2:
                    rows.append((f"{name} {cfg}", "WRONG", f"rel err {err:.3g}"))
                    continue
                t = graph_time(lambda xk=xk, ws=ws, cfg=cfg, gated=gated: [gemv(xk, w, cfg, gated=gated) for w in ws])
                t /= copies
            except Exception as e:  # a configuration that does not compile (registers, shared memory)
                rows.append((f"{name} {cfg}", "FAILED", repr(e)[:80]))
                continue
            results.append((t, cfg))
        results.sort(key=lambda r: r[0])

        for t, cfg in results[:3]:
            rows.append((f"{name} triton {describe(cfg)}", f"{t * 1e6:.2f} us",
                         f"{nbytes / t / 1e9:.0f} GB/s = {nbytes / t / bw:.0%}"))
        best[name] = results[0]
        if name in ("qkv", "gate_up", "lm_head"):  # with the RMSNorm prologue
            normed = []
            for cfg in NORM_CONFIGS:
                if k > cfg.k_slice and k % cfg.k_slice:
                    continue
                t = graph_time(lambda xk=xk, ws=ws, cfg=cfg, gated=gated, k=k:
                               [gemv(xk, w, cfg, gated=gated, norm_weight=nw[:k]) for w in ws]) / copies
                normed.append((t, cfg))
            normed.sort(key=lambda r: r[0])
            for t, cfg in normed[:4]:
                rows.append((f"{name} + norm: {describe(cfg)}", f"{t * 1e6:.2f} us",
                             f"{nbytes / t / 1e9:.0f} GB/s"))
            best_norm[name] = normed[0][1]

    # whole chains: 16 layers + LM head, batch 1
    h = torch.randn(1, HIDDEN, dtype=dt, device=dev)
    norm_w = torch.rand(HIDDEN, dtype=dt, device=dev) + 0.5

    def cublas_chain():
        res = h
        y = h
        for i in range(LAYERS):
            a, res = tk_norm.rms_norm(y, norm_w, 1e-5, res)
            qkv = F.linear(a, weights["qkv"][i])
            o = F.linear(qkv[:, :HIDDEN], weights["o"][i])
            a, res = tk_norm.rms_norm(o, norm_w, 1e-5, res)
            act = tk_norm.silu_and_mul(F.linear(a, weights["gate_up"][i]))
            y = F.linear(act, weights["down"][i])
        a, _ = tk_norm.rms_norm(y, norm_w, 1e-5, res)
        return F.linear(a, weights["lm_head"][0]).float()

    def fused_chain(cfgs=None, ncfgs=None):
        cfgs = cfgs or {name: b[1] for name, b in best.items()}
        ncfgs = ncfgs or best_norm

        def run():
            res = h
            for i in range(LAYERS):
                qkv = gemv(res, weights["qkv"][i], ncfgs["qkv"], norm_weight=norm_w)
                res = gemv(qkv[:, :HIDDEN], weights["o"][i], cfgs["o"], residual=res)
                act = gemv(res, weights["gate_up"][i], ncfgs["gate_up"], norm_weight=norm_w, gated=True)
                res = gemv(act, weights["down"][i], cfgs["down"], residual=res)
            return gemv(res, weights["lm_head"][0], ncfgs["lm_head"], norm_weight=norm_w, out_dtype=torch.float32)
        return run

    served = KernelConfig().gemv  # the served bf16 table: its slicing per shape is gemv.slicing
    defaults = {name: served for name in SHAPES}
    defaults_norm = defaults
    for name, (w_rows, k, gated) in SHAPES.items():
        n = w_rows // 2 if gated else w_rows
        cut, cut_norm = slicing(k, 1, served, n=n), slicing(k, 1, served, norm=True, n=n)
        rows.append((f"{name} default slicing", f"K slice {cut.block_k}", f"with the norm {cut_norm.block_k}"))
    total_bytes = LAYERS * sum(SHAPES[s][0] * SHAPES[s][1] * 2 for s in ("qkv", "o", "gate_up", "down")) \
        + VOCAB * HIDDEN * 2
    floor = total_bytes / bw
    rows.append(("chain floor (weight bytes / read BW)", f"{floor * 1e3:.3f} ms", f"{total_bytes / 1e9:.2f} GB"))
    for label, fn in [("chain: norms + cuBLAS + silu (today)", cublas_chain),
                      ("chain: fused Triton GEMV, best configs", fused_chain()),
                      ("chain: fused Triton GEMV, default configs", fused_chain(defaults, defaults_norm))]:
        try:
            t = graph_time(fn)
            ref = fused_chain()()
            got = fn()
            err = ((got - ref).norm() / ref.norm()).item()
            rows.append((label, f"{t * 1e3:.3f} ms", f"{floor / t:.0%} of floor; rel diff to fused {err:.2e}"))
        except Exception as e:
            rows.append((label, "FAILED", repr(e)[:120]))
    # batch-1 decode attention of the 1B shape (8 kv heads x 4 query heads, head dim 64) over a
    # 512-token context, 16 layers' caches: split count, tile size, and who combines the splits
    page, ctx, kvh, dim = 16, 512, 8, 64
    caches = [(torch.randn(4096, kvh, dim, dtype=dt, device=dev), torch.randn(4096, kvh, dim, dtype=dt, device=dev))
              for _ in range(LAYERS)]
    table = torch.randperm(4096 // page, device=dev)[: ctx // page].to(torch.int32)[None]
    lens = torch.tensor([ctx], dtype=torch.int32, device=dev)
    q = torch.randn(1, 4 * kvh, dim, dtype=dt, device=dev)
    ref = tk_attention.paged_decode(q, *caches[0], table, lens, page, dim**-0.5, 1)
    for ctx in (256, 1024):
        lens = torch.tensor([ctx], dtype=torch.int32, device=dev)
        table = torch.randperm(4096 // page, device=dev)[: ctx // page].to(torch.int32)[None]
        ref = tk_attention.paged_decode(q, *caches[0], table, lens, page, dim**-0.5, 1)
        for splits, block_n, warps in [(16, 32, 4), (16, 32, 2), (8, 32, 2), (16, 16, 2), (32, 16, 2), (8, 64, 4),
                                       (32, 32, 2)]:
            got = tk_attention.paged_decode(q, *caches[0], table, lens, page, dim**-0.5, splits, block_n=block_n,
                                            num_warps=warps)
            err = ((got.float() - ref.float()).norm() / ref.float().norm()).item()
            t = graph_time(lambda table=table, lens=lens, splits=splits, block_n=block_n, warps=warps:
                           [tk_attention.paged_decode(q, kc, vc, table, lens, page, dim**-0.5, splits,
                                                      block_n=block_n, num_warps=warps) for kc, vc in caches]) / LAYERS
            rows.append((f"attention ctx {ctx} splits {splits} block_n {block_n} warps {warps}", f"{t * 1e6:.2f} us",
                         f"rel diff {err:.1e}"))
    # launch gaps: 112 tiny dependent kernels in one graph
    small = torch.randn(1, HIDDEN, dtype=dt, device=dev)
    t = graph_time(lambda: [tk_norm.rms_norm(small, norm_w, 1e-5) for _ in range(112)])
    rows.append(("112 tiny rms_norm launches in a graph", f"{t * 1e6:.1f} us", f"{t / 112 * 1e6:.2f} us each"))
    width = max(len(r[0]) for r in rows)
    print()
    for r in rows:
        print(f"{r[0]:<{width}}  {r[1]:>12}  {r[2]}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gemv_bench.json").write_text(json.dumps(
            {"device": torch.cuda.get_device_name(), "rows": rows,
             "best": {k: [v[0], describe(v[1])] for k, v in best.items()}}, indent=1))


if __name__ == "__main__":
    main()
