"""Time to the first token in process, by prompt length: the engine as it serves (on a GPU, prompt chunks
that fit the largest decode graph's rows replay it while they attend to at most kernels.graph_prompt_keys
keys: DecodeGraphs.run_rows), the same with every fitting chunk through the graph (no bound), and with
`enforce_eager` (every prefill an eager forward), in one run.

    python scripts/first_token_bench.py --backend cuda --model <folder> [--lengths 13,50,100,200,250,400]
        [--prefix 2000]

Random prompt ids, max_tokens 1, one request at a time; medians of --repeats after one warm-up each. With
--prefix N every prompt starts with the same N ids, cached by a request before the timed ones (a long
conversation's next turn), and the lengths are the new tokens after it. Prints a markdown table; --out
writes the rows as JSON.
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
from ferrum.kernels.config import KernelConfig  # noqa: E402


def first_token_ms(model: str, backend: str, lengths: list[int], repeats: int, prefix_len: int,
                   **settings) -> dict[int, float]:
    engine = create_engine(model, backend=backend, max_model_len=max(2048, prefix_len + max(lengths) + 8),
                           **settings)
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    vocab = engine.tokenizer.vocab_size
    prefix = torch.randint(100, vocab - 1, (prefix_len,), generator=g).tolist()
    if prefix:
        engine.generate([prefix], params)  # now in the prefix cache

    def prompt(n: int) -> list[int]:
        return prefix + torch.randint(100, vocab - 1, (n,), generator=g).tolist()

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
    parser.add_argument("--prefix", type=int, default=0, help="ids every prompt starts with, cached first")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.cuda.get_device_name(0) if args.backend.startswith("cuda") else "cpu"
    run = (args.model, args.backend, args.lengths, args.repeats, args.prefix)
    served = first_token_ms(*run)
    graph = first_token_ms(*run, kernels=KernelConfig(graph_prompt_keys=2**62))
    eager = first_token_ms(*run, enforce_eager=True)
    print(f"{device}; prefix {args.prefix} cached; medians of {args.repeats}, ms to the first token\n")
    print("| new tokens | attended keys | as served | graph, no bound | enforce_eager | eager / served |\n"
          "| --- | --- | --- | --- | --- | --- |")
    rows = []
    for n in args.lengths:
        keys = n * args.prefix + n * (n + 1) // 2
        rows.append(dict(new_tokens=n, prefix=args.prefix, keys=keys, served_ms=round(served[n], 2),
                         graph_ms=round(graph[n], 2), eager_ms=round(eager[n], 2)))
        print(f"| {n} | {keys} | {served[n]:.2f} | {graph[n]:.2f} | {eager[n]:.2f} | {eager[n] / served[n]:.2f}x |")
    if args.out:
        args.out.write_text(json.dumps(dict(device=device, repeats=args.repeats, rows=rows), indent=1))


if __name__ == "__main__":
    main()
