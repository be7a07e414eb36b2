"""Does programmatic dependent launch (PDL) overlap kernels inside a CUDA graph, and what does one
dependent kernel boundary cost? Prints a table; JSON to --out.

    python scripts/pdl_probe.py --out DIR

1. Two kernels in a graph: A spins for 20 us, B (launched with PDL) stamps the global timer when it
   starts and again after griddepcontrol.wait. B starting before A ends means the graph kept the
   programmatic edge; the second stamp minus A's end is the wait's release latency.
2. Chains of 200 one-program kernels, each reading what the last wrote, with and without PDL:
   time per kernel boundary.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ferrum.kernels.pdl import pdl_launch, pdl_wait  # noqa: E402


@triton.jit
def _now():
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1)


@triton.jit
def _spin_kernel(STAMPS, spin_ns, PDL: tl.constexpr):
    pdl_wait(PDL)
    t0 = _now()
    t = t0
    while t - t0 < spin_ns:
        t = _now()
    tl.store(STAMPS + 0, t)


@triton.jit
def _stamp_kernel(STAMPS, PDL: tl.constexpr):
    tl.store(STAMPS + 1, _now())
    pdl_wait(PDL)
    tl.store(STAMPS + 2, _now())


@triton.jit
def _step_kernel(BUF, PDL: tl.constexpr):
    pdl_wait(PDL)
    tl.store(BUF, tl.load(BUF) + 1)


def graph_of(fn) -> torch.cuda.CUDAGraph:
    fn()  # compile
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    args = parser.parse_args()
    rows = []
    stamps = torch.zeros(3, dtype=torch.int64, device="cuda")
    for mode in (0, 1):
        def pair(mode=mode):
            _spin_kernel[(1,)](stamps, 20_000, PDL=mode, **pdl_launch(mode))
            _stamp_kernel[(1,)](stamps, PDL=mode, **pdl_launch(mode))

        g = graph_of(pair)
        starts, releases = [], []
        for _ in range(20):
            g.replay()
            torch.cuda.synchronize()
            a_end, b_start, b_after = stamps.tolist()
            starts.append((b_start - a_end) / 1e3)
            releases.append((b_after - a_end) / 1e3)
        starts.sort()
        releases.sort()
        rows.append(dict(test="pair", pdl=mode, b_start_minus_a_end_us=starts[10],
                         b_after_wait_minus_a_end_us=releases[10]))
    buf = torch.zeros(1, dtype=torch.int32, device="cuda")
    for mode in (0, 1):
        def chain(mode=mode):
            for _ in range(200):
                _step_kernel[(1,)](buf, PDL=mode, **pdl_launch(mode))

        g = graph_of(chain)
        for _ in range(3):
            g.replay()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20):
            g.replay()
        b.record()
        b.synchronize()
        rows.append(dict(test="chain of 200", pdl=mode, us_per_kernel=a.elapsed_time(b) * 1e3 / 20 / 200))
    for r in rows:
        print(r)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "pdl_probe.json").write_text(json.dumps(dict(gpu=torch.cuda.get_device_name(), rows=rows), indent=2))


if __name__ == "__main__":
    main()
