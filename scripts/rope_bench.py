"""rope_and_store (ferrum.kernels.rope) of this checkout against another checkout's, on a CUDA GPU: the same
inputs through each, outputs compared bit for bit, the median-free best of 5 replays of a CUDA graph of 20
calls each, for the 8B and 1B shapes' heads at 1, 256 and 8,192 tokens.

    python scripts/rope_bench.py --old /path/to/older/checkout
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ferrum.kernels import rope as new  # noqa: E402

SHAPES = {"llama-3.1-8b": (32, 8, 128), "llama-3.2-1b": (32, 8, 64)}  # heads, kv heads, head dim


def time_us(mod, args: tuple, calls: int = 20) -> float:
    for _ in range(3):
        mod.rope_and_store(*args)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            mod.rope_and_store(*args)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(5):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / calls * 1000)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--old", type=Path, required=True, help="another Ferrum checkout")
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("old_rope", args.old / "ferrum/kernels/rope.py")
    assert spec is not None and spec.loader is not None
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    print(torch.cuda.get_device_name())
    for name, (h, kv, d) in SHAPES.items():
        for tokens in (1, 256, 8192):
            qkv = torch.randn(tokens, (h + 2 * kv) * d, device="cuda", dtype=torch.bfloat16)
            pos = torch.randint(0, 2000, (tokens,), device="cuda")
            cos, sin = torch.randn(4096, d, device="cuda"), torch.randn(4096, d, device="cuda")
            slots = torch.randperm(20000, device="cuda")[:tokens]
            outs, times = {}, {}
            for tag, mod in (("old", old), ("new", new)):
                kc = torch.zeros(20000, kv, d, device="cuda", dtype=torch.bfloat16)
                vc = torch.zeros_like(kc)
                call = (qkv, pos, cos, sin, slots, kc, vc, h, kv, d)
                outs[tag] = (mod.rope_and_store(*call), kc, vc)
                times[tag] = time_us(mod, call)
            same = all(torch.equal(a, b) for a, b in zip(outs["old"], outs["new"], strict=True))
            print(f"{name} T={tokens}: old {times['old']:.2f} us, new {times['new']:.2f} us, "
                  f"{times['old'] / times['new']:.2f}x, outputs identical {same}", flush=True)


if __name__ == "__main__":
    main()
