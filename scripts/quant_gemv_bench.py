"""Quantized decode GEMV and prefill GEMM at the Llama-3.1-8B shapes, on a GPU, in one command.

    python scripts/quant_gemv_bench.py [--kinds int4,int8,fp8] [--quick] [--out DIR]

A kind ending in -a8 / -a16 (int4-a8, int4-k-a16) is that storage with its tables' int8_inputs on / off (x rounded
to int8, dp4a products: ferrum.kernels.gemv_chunks); without, as KernelConfig's table says.

1. The pure-read bandwidth (a float32 sum over 2 GiB of bf16): the fractions below are of it.
2. Batch-1 GEMV per kind (bf16 beside) for each projection shape, with the kind's default table
   (KernelConfig.gemv_table) and a few candidates: time, GB/s of the weight's bytes as stored
   (packed values + scales + zeros), fraction of the read bandwidth. Copies of each weight rotate
   so that L2 holds none of them between calls; everything is timed as CUDA-graph replays.
3. The decode chain (32 layers of norm+q/k/v, o+residual, norm+gate/up+silu*mul, down+residual,
   then the normed LM head in bf16 as served by default) per kind with the default tables, batch 1
   and 4: time per step, and fraction of its floor (the bytes it reads over the read bandwidth).
4. quant_matmul (its path by M: ferrum/kernels/quant_matmul.py) against bf16 cuBLAS at M = 4, 16,
   64, 300 and 2048, and the Triton GEMM at the same M (the path it takes otherwise).
Prints a table; JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemv_bench import graph_time, read_bandwidth  # noqa: E402 - the same timing as the bf16 GEMV bench

from ferrum.kernels.config import GemvTable, KernelConfig  # noqa: E402
from ferrum.kernels.gemv import gemv, kernel_weight, qkv_rope_store, slicing  # noqa: E402
from ferrum.kernels.quant_matmul import quant_matmul, triton_gemm  # noqa: E402
from ferrum.kernels.quant_weight import QuantWeight  # noqa: E402

HIDDEN, INTER, VOCAB, LAYERS = 4096, 14336, 128256, 32
QKV = 4096 + 2 * 1024
SHAPES = {  # name: (weight rows, K, gated, norm, residual)
    "qkv": (QKV, HIDDEN, False, True, False),
    "o": (HIDDEN, HIDDEN, False, False, True),
    "gate_up": (2 * INTER, HIDDEN, True, True, False),
    "down": (HIDDEN, INTER, False, False, True),
}
GROUP = 128
Row = tuple[str, str, str]


class Rows(list[Row]):
    """The table, each row also printed as it comes (a run cut short still shows its rows)."""

    def append(self, row: Row) -> None:
        print("  ".join(row), flush=True)
        super().append(row)


def random_weight(kind: str, n: int, k: int) -> torch.Tensor | QuantWeight:
    """A weight of `kind` with random contents of the right ranges (timing only)."""
    dev = "cuda"
    if kind == "bf16":
        return torch.randn(n, k, dtype=torch.bfloat16, device=dev) * 0.02
    if kind == "int8":
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8, device=dev)
        return QuantWeight("int8", q, torch.rand(n, device=dev) * 1e-3)
    if kind == "fp8":
        q = (torch.randn(n, k, device=dev) * 64).to(torch.float8_e4m3fn)
        return QuantWeight("fp8", q, torch.rand(n, device=dev) * 1e-3)
    q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
    if kind == "int4-g32":  # GGUF Q4_1's layout: groups of 32, float32 scales and zeros
        s32 = torch.rand(n, k // 32, device=dev) * 1e-2
        return QuantWeight("int4", q, s32, torch.randn(n, k // 32, device=dev) * 1e-3, 32)
    if kind == "int4-k":  # GGUF Q4_K's own factors (QuantScheme.sub_scales)
        sub = torch.randint(0, 64, (n, k // 32, 2), dtype=torch.uint8, device=dev)
        sup = (torch.rand(n, k // 256, 2, device=dev) * 1e-3).half().float()
        return QuantWeight("int4", q, sub.view(torch.int16)[..., 0], sup.view(torch.int64)[..., 0], 32,
                           sub_scales=True)
    s = (torch.rand(n, k // GROUP, device=dev) * 1e-2).to(torch.bfloat16)
    return QuantWeight("int4", q, s, (torch.randn(n, k // GROUP, device=dev) * 1e-3).to(torch.bfloat16), GROUP)


def nbytes(w: torch.Tensor | QuantWeight) -> int:
    if isinstance(w, torch.Tensor):
        return w.numel() * w.element_size()
    parts = [w.qweight, w.scale] + ([w.zero] if w.zero is not None else [])
    return sum(p.numel() * p.element_size() for p in parts)


def dequantized(w: torch.Tensor | QuantWeight) -> torch.Tensor:
    if isinstance(w, torch.Tensor):
        return w.float()
    if w.kind in ("int8", "fp8"):
        return w.qweight.float() * w.scale[:, None]
    assert w.zero is not None
    q = torch.stack((w.qweight & 0xF, w.qweight >> 4), dim=-1).reshape(w.qweight.shape[0], -1).float()
    n, k = q.shape
    scale, zero, g = w.scale.float(), w.zero.float(), w.group_size
    if w.sub_scales:  # w = d sc q - dmin m
        sub = w.scale.view(torch.uint8).reshape(n, k // 32, 2).float()
        sup = w.zero.view(torch.float32).reshape(n, k // 256, 2).repeat_interleave(8, dim=1)
        scale, zero = sup[..., 0] * sub[..., 0], 8 * sup[..., 0] * sub[..., 0] - sup[..., 1] * sub[..., 1]
    grouped = (q.reshape(n, k // g, g) - 8) * scale[..., None] + zero[..., None]
    return grouped.reshape(n, k)


def table(f: int, whole_norm: int, whole: int, k_slice: int, warps: int) -> GemvTable:
    return GemvTable(features_per_program=f, num_warps=warps, whole_k_with_norm=whole_norm,
                     whole_k_without_norm=whole, k_slice=k_slice, qkv_two_slices_from=k_slice)


def describe(t: GemvTable) -> str:
    return (f"f{t.features_per_program} w{t.num_warps} whole {t.whole_k_with_norm}/{t.whole_k_without_norm} "
            f"slice {t.k_slice}")


CANDIDATES = {  # (features, whole K with norm, whole K without, K slice, warps); the default comes first anyway
    "bf16": [table(2, 4096, 2048, 2048, 4), table(4, 4096, 2048, 2048, 8)],
    "int8": [table(8, 2048, 2048, 2048, 8), table(4, 2048, 2048, 2048, 8), table(4, 4096, 4096, 4096, 4),
             table(8, 4096, 4096, 4096, 8), table(2, 2048, 2048, 2048, 4)],
    "int4": [table(4, 4096, 4096, 4096, 4), table(2, 4096, 4096, 4096, 4), table(8, 4096, 4096, 4096, 8),
             table(4, 2048, 2048, 2048, 8), table(2, 2048, 2048, 2048, 4), table(16, 2048, 2048, 2048, 8)],
    "fp8": [table(4, 4096, 4096, 4096, 4), table(8, 4096, 4096, 4096, 8), table(2, 4096, 4096, 4096, 4),
            table(4, 1024, 1024, 1024, 4), table(8, 2048, 2048, 2048, 8)],
}


def kind_table(kind: str, t: GemvTable) -> GemvTable:
    """`t` as `kind` runs it (-a8 / -a16: int8 inputs on / off; else as the table says)."""
    if kind.endswith(("-a8", "-a16")):
        return replace(t, int8_inputs=kind.endswith("-a8"))
    return t


def storage(kind: str) -> str:
    """The weight's storage of a kind (without -a8 / -a16)."""
    return kind.removesuffix("-a8").removesuffix("-a16")


def per_shape(kind: str, bw: float, quick: bool, rows: list[Row], record: dict) -> None:
    config = KernelConfig()
    default = kind_table(kind, config.gemv_table(None if kind == "bf16" else kind[:4]))  # type: ignore[arg-type]
    for name, (n_rows, k, gated, norm, residual) in SHAPES.items():
        one = random_weight(storage(kind), n_rows, k)
        size = nbytes(one)
        copies = max(2, -(-(400 << 20) // size))
        ws = [one] + [random_weight(storage(kind), n_rows, k) for _ in range(copies - 1)]
        n = n_rows // 2 if gated else n_rows
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        nw = torch.rand(k, dtype=torch.bfloat16, device="cuda") + 0.5
        res = torch.randn(1, n, dtype=torch.bfloat16, device="cuda")
        ref = (x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * nw.float() if norm
               else x.float()) @ dequantized(one).T
        if gated:
            ref = F.silu(ref[:, :n]) * ref[:, n:]
        if residual:
            ref = ref + res.float()
        tables = [default] + [kind_table(kind, t) for t in CANDIDATES[kind[:4]][: 3 if quick else None]
                              if kind_table(kind, t) != default]
        results = []
        extra = {"norm_weight": nw if norm else None, "gated": gated, "residual": res if residual else None}
        for t in tables:
            try:
                got = gemv(x, one, t, **extra).float()  # type: ignore[arg-type]
                err = ((got - ref).norm() / ref.norm()).item()
                sec = graph_time(partial(_each, ws, x, t, extra)) / copies
            except Exception as e:  # a table that does not compile (registers, shared memory)
                rows.append((f"{kind} {name} {describe(t)}", "FAILED", repr(e)[:100]))
                continue
            cut = slicing(k, 1, t, norm=norm, min_k=kernel_weight(one).planes)
            label = (f"{kind} {name} [{n_rows}x{k}] {'DEFAULT ' if t is default else ''}{describe(t)} "
                     f"(K slice {cut.block_k})")
            results.append((sec, t))
            rows.append((label, f"{sec * 1e6:.1f} us",
                         f"{size / sec / 1e9:.0f} GB/s = {size / sec / bw:.0%}; rel err {err:.1e}"))
            record.setdefault(kind, {}).setdefault(name, []).append(
                {"table": describe(t), "default": t is default, "us": sec * 1e6, "fraction": size / sec / bw,
                 "rel_err": err})
        if results:
            best = min(results, key=lambda r: r[0])
            rows.append((f"{kind} {name}: best", describe(best[1]), f"{size / best[0] / bw:.0%} of read BW"))
        if name == "qkv":  # as Llama runs it: with rope and the KV-cache write (two rows a program)
            pos = torch.zeros(1, dtype=torch.int64, device="cuda")
            cos = torch.ones(16, 128, device="cuda")
            cache = torch.empty(16, 8, 128, dtype=torch.bfloat16, device="cuda")
            sec = graph_time(partial(_each_qkv, ws, x, nw, default, pos, cos, cache)) / copies
            rows.append((f"{kind} qkv_rope_store, default table", f"{sec * 1e6:.1f} us",
                         f"{size / sec / 1e9:.0f} GB/s = {size / sec / bw:.0%}"))
        del ws


def _each(ws: list[torch.Tensor | QuantWeight], x: torch.Tensor, t: GemvTable, extra: dict) -> None:
    for w in ws:
        gemv(x, w, t, pdl=True, **extra)


def _each_qkv(ws: list[torch.Tensor | QuantWeight], x: torch.Tensor, nw: torch.Tensor, t: GemvTable,
              pos: torch.Tensor, cos: torch.Tensor, cache: torch.Tensor) -> None:
    for w in ws:
        qkv_rope_store(x, w, None, nw, 1e-6, pos, cos, cos, pos, cache, cache, 32, 8, 128, t, pdl=True)


def _step(h: torch.Tensor, layers: list[dict[str, torch.Tensor | QuantWeight]], head: torch.Tensor,
          norm_w: torch.Tensor, t: GemvTable, head_t: GemvTable) -> torch.Tensor:
    res = h
    for layer in layers:
        qkv = gemv(res, layer["qkv"], t, norm_weight=norm_w, pdl=True)
        res = gemv(qkv[:, :HIDDEN], layer["o"], t, residual=res, pdl=True)
        act = gemv(res, layer["gate_up"], t, norm_weight=norm_w, gated=True, pdl=True)
        res = gemv(act, layer["down"], t, residual=res, pdl=True)
    return gemv(res, head, head_t, norm_weight=norm_w, out_dtype=torch.float32, pdl=True)


def chain(kind: str, bw: float, rows: list[Row], record: dict) -> None:
    """32 layers + bf16 LM head, default tables, batch 1 and 4."""
    config = KernelConfig()
    t = kind_table(kind, config.gemv_table(None if kind == "bf16" else kind[:4]))  # type: ignore[arg-type]
    head_t = config.gemv
    layers = [{name: random_weight(storage(kind), n, k) for name, (n, k, *_rest) in SHAPES.items()}
              for _ in range(LAYERS)]
    head = torch.randn(VOCAB, HIDDEN, dtype=torch.bfloat16, device="cuda") * 0.02
    norm_w = torch.rand(HIDDEN, dtype=torch.bfloat16, device="cuda") + 0.5
    total = sum(nbytes(w) for layer in layers for w in layer.values()) + nbytes(head)
    floor = total / bw
    for m in (1, 4):
        h = torch.randn(m, HIDDEN, dtype=torch.bfloat16, device="cuda")
        sec = graph_time(partial(_step, h, layers, head, norm_w, t, head_t), 20)
        rows.append((f"chain {kind} batch {m} (32 layers + bf16 head)", f"{sec * 1e3:.3f} ms",
                     f"{floor / sec:.0%} of its floor {floor * 1e3:.3f} ms ({total / 1e9:.2f} GB)"))
        record.setdefault("chain", {})[f"{kind} batch {m}"] = {"ms": sec * 1e3, "floor_ms": floor * 1e3}
    del layers


def prefill(kind: str, rows: list[Row], record: dict) -> None:
    for name in ("gate_up", "down"):
        n, k = SHAPES[name][:2]
        w = random_weight(kind, n, k)
        assert isinstance(w, QuantWeight)
        dense = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        for m in (4, 16, 64, 300, 2048):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ref = x.float() @ dequantized(w).T
            got = quant_matmul(x, w).float()
            err = ((got - ref).norm() / ref.norm()).item()
            t_q = graph_time(partial(quant_matmul, x, w), 10)
            t_b = graph_time(partial(F.linear, x, dense), 10)
            rows.append((f"quant_matmul {kind} {name} M={m}", f"{t_q * 1e6:.0f} us",
                         f"bf16 cuBLAS {t_b * 1e6:.0f} us: {t_b / t_q:.2f}x; rel err {err:.1e}"))
            record.setdefault("prefill", {})[f"{kind} {name} {m}"] = {"us": t_q * 1e6, "bf16_us": t_b * 1e6,
                                                                      "rel_err": err}
            if m >= 16:  # the path quant_matmul takes otherwise
                t_g = graph_time(partial(triton_gemm, x, w), 10)
                rows.append((f"  {kind} {name} M={m}: the Triton GEMM", f"{t_g * 1e6:.0f} us", ""))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--kinds", default="bf16,int4,int8,fp8")
    parser.add_argument("--quick", action="store_true", help="the default and two candidate tables a shape")
    parser.add_argument("--skip", default="", help="sections to skip: shapes,chain,prefill")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    kinds = args.kinds.split(",")
    skip = set(args.skip.split(","))
    rows: list[Row] = Rows()
    record: dict = {"device": torch.cuda.get_device_name()}
    bw = read_bandwidth()
    rows.append(("read bandwidth (sum of 2 GiB)", f"{bw / 1e9:.0f} GB/s", ""))
    record["read_bandwidth"] = bw
    for kind in kinds:
        if "shapes" not in skip:
            per_shape(kind, bw, args.quick, rows, record)
        if "chain" not in skip:
            chain(kind, bw, rows, record)
        if "prefill" not in skip and kind != "bf16" and storage(kind) == kind:
            prefill(kind, rows, record)
        torch.cuda.empty_cache()
    width = max(len(r[0]) for r in rows)
    print()
    for r in rows:
        print(f"{r[0]:<{width}}  {r[1]:>14}  {r[2]}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "quant_gemv_bench.json").write_text(json.dumps({"rows": rows, **record}, indent=1))


if __name__ == "__main__":
    main()
