"""Time to the first token in process, by prompt length: the engine as it serves (on a GPU, prompt chunks
that fit the largest decode graph's rows replay it: DecodeGraphs.run_rows) beside the same engine
with `enforce_eager` (every prefill an eager forward), in one run.

    python scripts/first_token_bench.py --backend cuda --model <folder> [--lengths 13,50,100,200,250,400]

Random prompt ids (no prefix-cache hits), max_tokens 1, one request at a time; medians of --repeats after
one warm-up each. Prints a markdown table; --out writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ferrum.engine.builder import create_engine  # noqa: E402
from ferrum.engine.sampling_params import SamplingParams  # noqa: E402


def first_token_ms(model: str, backend: str, lengths: list[int], repeats: int, **settings) -> dict[int, float]:
    engine = create_engine(model, backend=backend, max_model_len=2048, **settings)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    vocab = engine.tokenizer.vocab_size

    def prompt(n: int) -> list[int]:
        return torch.randint(100, vocab - 1, (n,), generator=g).tolist()

    medians = {}
    for n in lengths:
        engine.generate([prompt(n)], params)  # warm-up at this length
        times = []
        for _ in range(repeats):
            ids = prompt(n)
            started = time.perf_counter()
            engine.generate([ids], params)
            times.append(time.perf_counter() - started)
        medians[n] = statistics.median(times) * 1e3
    engine.release()
    return medians


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    parser.add_argument("--backend", default="cuda")
    parser.add_argument("--lengths", type=lambda t: [int(x) for x in t.split(",")],
                        default=[13, 50, 100, 200, 250, 400])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.cuda.get_device_name(0) if args.backend.startswith("cuda") else "cpu"
    served = first_token_ms(args.model, args.backend, args.lengths, args.repeats)
    eager = first_token_ms(args.model, args.backend, args.lengths, args.repeats, enforce_eager=True)
    print(f"{device}; medians of {args.repeats}, ms to the first token\n")
    print("| prompt tokens | as served | enforce_eager | eager / served |\n| --- | --- | --- | --- |")
    rows = []
    for n in args.lengths:
        rows.append(dict(prompt_tokens=n, served_ms=round(served[n], 2), eager_ms=round(eager[n], 2)))
        print(f"| {n} | {served[n]:.2f} | {eager[n]:.2f} | {eager[n] / served[n]:.2f}x |")
    if args.out:
        args.out.write_text(json.dumps(dict(device=device, repeats=args.repeats, rows=rows), indent=1))


if __name__ == "__main__":
    main()
