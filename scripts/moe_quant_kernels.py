"""One Qwen3-30B-A3B mixture-of-experts layer's per-pair expert kernels (ferrum.kernels.moe.experts) with
int4 (groups of 128) and int8 expert stacks on a CUDA GPU: the quantized words read in chunks of 4 a thread
(the dense GEMV's, ferrum.kernels.gemv_chunks; int4 also with x as int8, as served) against one word a thread
(chunk_words forced to 1), at 1 and 4 tokens with random distinct experts. Prints each one's time (CUDA-graph
median), its fraction of the chosen experts' bytes at the measured read bandwidth, and its error against the
same kernels over the stacks dequantized to bf16 (whose time comes first).

    python scripts/moe_quant_kernels.py
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path
from typing import Literal

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gemv_bench import graph_time, read_bandwidth  # noqa: E402

from ferrum.kernels import moe  # noqa: E402
from ferrum.kernels.config import GemvTable  # noqa: E402
from ferrum.kernels.quant_weight import QuantWeight  # noqa: E402
from ferrum.weights.quantization.arith import dequantize, quantize  # noqa: E402
from ferrum.weights.quantization.scheme import QuantScheme  # noqa: E402

EXPERTS, TOP_K, HIDDEN, INTER = 128, 8, 2048, 768  # Qwen3-30B-A3B


def stack(w: torch.Tensor, kind: Literal["int4", "int8"]) -> tuple[QuantWeight, torch.Tensor]:
    """The stack quantized as the loader stores it, and its bf16 dequantization."""
    qt = quantize(w, QuantScheme(kind, 128) if kind == "int4" else QuantScheme(kind))
    group = 128 if kind == "int4" else 0
    return (QuantWeight(kind, qt.parts["qweight"], qt.parts["scale"], qt.parts.get("zero"), group),
            dequantize(qt, torch.bfloat16))


def main() -> None:
    bandwidth = read_bandwidth()  # bytes a second
    print(f"{torch.cuda.get_device_name()}: read bandwidth {bandwidth / 1e9:.0f} GB/s", flush=True)
    torch.manual_seed(0)
    gate_up = torch.randn(EXPERTS * 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16) / 32
    down = torch.randn(EXPERTS * HIDDEN, INTER, device="cuda", dtype=torch.bfloat16) / 32
    served = moe.chunk_words
    kinds: tuple[Literal["int4", "int8"], ...] = ("int4", "int8")
    for kind in kinds:
        (q_gu, d_gu), (q_dn, d_dn) = stack(gate_up, kind), stack(down, kind)
        weight_bytes = 0.5 + 4 / 128 if kind == "int4" else 1 + 4 / HIDDEN  # a weight with its factors' share
        for tokens in (1, 4):
            x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
            chosen = torch.stack([torch.randperm(EXPERTS, device="cuda")[:TOP_K] for _ in range(tokens)])
            chosen = chosen.to(torch.int32)
            weights = torch.softmax(torch.randn(tokens, TOP_K, device="cuda"), -1)
            ref = moe.experts(x, chosen, weights, d_gu, d_dn, EXPERTS, per_pair=True).float()
            floor = len(set(chosen.flatten().tolist())) * 3 * HIDDEN * INTER * weight_bytes / bandwidth
            t_bf16 = graph_time(partial(moe.experts, x, chosen, weights, d_gu, d_dn, EXPERTS, per_pair=True))
            cells = [f"the bf16 stacks {t_bf16 * 1e6:.1f} us"]
            ways = [("one word a thread", lambda *a: 1, False), ("chunks", served, False)]
            if kind == "int4":
                ways.append(("chunks, x as int8 (served)", served, True))
            for name, words, int8_inputs in ways:
                moe.chunk_words = words
                try:
                    table = GemvTable(int8_inputs=int8_inputs)
                    y = moe.experts(x, chosen, weights, q_gu, q_dn, EXPERTS, table).float()
                    t = graph_time(partial(moe.experts, x, chosen, weights, q_gu, q_dn, EXPERTS, table))
                finally:
                    moe.chunk_words = served
                err = float((y - ref).norm() / ref.norm())
                cells.append(f"{name} {t * 1e6:.1f} us ({floor / t:.0%} of the bytes' {floor * 1e6:.1f} us), "
                             f"err {err:.1e}")
            print(f"{kind}, {tokens} token(s): " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
