"""Batch-1 decode of one random-weight checkpoint under several engine settings, alternating, on a CUDA GPU.

    python scripts/engine_ab.py --shape llama-3.1-8b \
        --base '{"quantization": {"method": "int4", "skip": ["lm_head"]}}' \
        --variant default={} --variant splits8='{"kernels": {"max_decode_splits": 8}}' [--rounds 2] [--out FILE]

Each variant's settings (JSON) are merged over --base, and each gets its own engine (built through
create_engine, as a served model is), timed by scripts/gpu_suite.py's batch1_per_token (a 128-token prompt,
256 greedy tokens, whole engine steps). The variants run in turn, --rounds times, the first variant again
at the end, so drift of the machine shows as a difference between its first and last figure. The greedy
tokens of each variant are compared with the first variant's. Prints a table; --out keeps the figures as
JSON. Uses only public surfaces (the engine's settings, requests and steps).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gemv_bench import read_bandwidth  # noqa: E402 - a 2 GiB sum, as the GEMV benches measure it
from gpu_suite import batch1_per_token, gpu_engine  # noqa: E402 - shared GPU timing
from moe_bench import checkpoint  # noqa: E402 - random checkpoints written tiled into a tmpfs


def merged(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`extra` over `base`, nested mappings merged key by key."""
    out = dict(base)
    for key, value in extra.items():
        out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def greedy_tokens(engine, count: int = 32) -> list[int]:
    """`count` greedy tokens of one fixed prompt."""
    from ferrum.engine.sampling_params import SamplingParams

    rng = random.Random(7)
    prompt = [rng.randrange(engine.model_config.vocab_size - 2) for _ in range(64)]
    out = engine.generate([prompt], SamplingParams(max_tokens=count, temperature=0, ignore_eos=True))
    return out[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--ckpt", type=Path, default=Path("/dev/shm/ckpt"))
    ap.add_argument("--base", default="{}", help="engine settings (JSON) every variant starts from")
    ap.add_argument("--variant", action="append", required=True, help="NAME=JSON, merged over --base")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    base = json.loads(args.base)
    variants = {name: merged(base, json.loads(raw)) for name, _, raw in (v.partition("=") for v in args.variant)}
    folder = checkpoint(args.ckpt, args.shape)
    print(f"{torch.cuda.get_device_name()}, read bandwidth {read_bandwidth() / 1e9:.0f} GB/s, {args.shape}",
          flush=True)
    order = [name for _ in range(args.rounds) for name in variants] + [next(iter(variants))]
    times: dict[str, list[float]] = {name: [] for name in variants}
    tokens: dict[str, list[int]] = {}
    for name in order:
        engine = gpu_engine(folder, max_num_seqs=8, max_model_len=2048, **variants[name])
        if name not in tokens:
            tokens[name] = greedy_tokens(engine)
        times[name].append(batch1_per_token(engine) * 1e3)
        print(f"{name}: {times[name][-1]:.4f} ms/token", flush=True)
    first = next(iter(variants))
    reference = min(times[first])
    print(f"\n| variant | settings | ms/token (each run) | best vs {first} | greedy tokens as {first} |")
    print("|---|---|---|---|---|")
    for name, runs in times.items():
        same = sum(a == b for a, b in zip(tokens[name], tokens[first], strict=True))
        print(f"| {name} | `{json.dumps(variants[name])}` | {' / '.join(f'{t:.3f}' for t in runs)} "
              f"| {reference / min(runs):.3f}x | {same}/{len(tokens[first])} |")
    if args.out is not None:
        args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(), "shape": args.shape,
                                        "variants": variants, "ms_per_token": times}, indent=1))


if __name__ == "__main__":
    main()
