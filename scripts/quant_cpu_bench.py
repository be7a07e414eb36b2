"""The demo model on the CPU, each way of serving it in one run: float32, bf16, int8, int4 (group
128) and fp8, through `ferrum bench offline`; prints the CPU (model and flags) and a table of output
tokens/s, the weights as stored and the peak resident memory while loading.

    python scripts/quant_cpu_bench.py [--model models/SmolLM2-135M-Instruct] [--num-prompts 32]
        [--input-len 64:256] [--output-len 64] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = [("float32", "float32", None), ("bf16", "bfloat16", None), ("int8", "float32", "int8"),
            ("int4", "float32", "int4"), ("fp8", "float32", "fp8"), ("int8 bf16", "bfloat16", "int8"),
            ("int4 bf16", "bfloat16", "int4")]


def cpu_description() -> str:
    model, flags = platform.processor(), ""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            model = line.split(":", 1)[1].strip()
        if line.startswith("flags"):
            wanted = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "avx_vnni")
            flags = " ".join(f for f in line.split(":", 1)[1].split() if f in wanted)
            break
    return f"{model}; {flags}"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=str(ROOT / "models" / "SmolLM2-135M-Instruct"))
    p.add_argument("--num-prompts", default="32")
    p.add_argument("--input-len", default="64:256")
    p.add_argument("--output-len", default="64")
    p.add_argument("--out", type=Path, default=Path("/tmp/quant-cpu-bench"))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"CPU: {cpu_description()}", flush=True)
    rows: list[tuple[str, str, str]] = []
    for label, dtype, method in VARIANTS:
        out = args.out / f"offline-{label.replace(' ', '-')}.json"
        cmd = [sys.executable, "-m", "ferrum.cli", "bench", "offline", "--model", args.model, "--backend", "cpu",
               "--dtype", dtype, "--num-prompts", args.num_prompts, "--input-len", args.input_len,
               "--output-len", args.output_len, "--output-json", str(out)]
        if method:
            cmd += ["--quantization", method]
        done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if done.returncode:
            rows.append((label, "failed", " ".join(done.stderr.strip().splitlines()[-1:])))
            continue
        res = json.loads(out.read_text())
        rows.append((label, f"{res['output_tokens_per_s']:.1f}",
                     f"{res['weight_bytes'] / 1e6:.0f} MB weights, peak RSS while loading "
                     f"{res['peak_load_host_bytes'] / 1e6:.0f} MB"))
        print(rows[-1], flush=True)
    print("\n| variant | output tok/s | memory |\n| --- | --- | --- |")
    for label, rate, note in rows:
        print(f"| {label} | {rate} | {note} |")


if __name__ == "__main__":
    main()
