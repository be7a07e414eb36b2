"""How many of each AVX2 instruction this CPU issues a cycle, alone and beside vpmaddwd.

The CPU attention kernels' speed on AVX2 comes down to which execution pipes their instructions share
(the int8 products are vpmaddwd and vpaddd, the widening of bytes vpmovzxbw or masks and shifts, the
softmax float arithmetic). Vendor tables are not at hand for every CPU a session lands on, so this
measures: each instruction in a loop of 8 independent copies, and 4 copies interleaved with 4 vpmaddwd.
Cycles are counted against vfmadd231ps, taken to issue 2 a cycle (every x86 CPU with FMA since Haswell
and Zen 1 has two FMA pipes), timed right before each loop, so the clock need not be known and a VM's
drifting speed cancels; the median over the trials is reported.

    python scripts/cpu_simd_throughput.py [--trials 15] [--iterations 2000000]

Prints the CPU model and flags, then per instruction: its throughput alone (a cycle) and the cycles of
4 of it + 4 vpmaddwd (2.0: they issue side by side on separate pipes; 4.0: they share vpmaddwd's).
Needs a C++ compiler ($CXX, g++ or c++, as the kernels' build finds it) and an x86-64 CPU with AVX2 and FMA. Not a test.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_kernels_bench import cpu_header  # noqa: E402

from ferrum.kernels.cpu.build import compiler  # noqa: E402

# name -> the instruction writing ymm register {0} (sources ymm8, ymm9; memory at %1)
INSTRUCTIONS = {
    "vfmadd231ps": "vfmadd231ps %%ymm8, %%ymm9, %%ymm{0}",
    "vpmaddwd": "vpmaddwd %%ymm8, %%ymm9, %%ymm{0}",
    "vpmaddubsw": "vpmaddubsw %%ymm8, %%ymm9, %%ymm{0}",
    "vpaddd": "vpaddd %%ymm8, %%ymm9, %%ymm{0}",
    "vpand": "vpand %%ymm8, %%ymm9, %%ymm{0}",
    "vpsrlw": "vpsrlw $8, %%ymm8, %%ymm{0}",
    "vpsrad": "vpsrad $16, %%ymm8, %%ymm{0}",
    "vpsignb": "vpsignb %%ymm8, %%ymm9, %%ymm{0}",
    "vpmovzxbw (load)": "vpmovzxbw 16*{0}(%1), %%ymm{0}",
    "vpmovsxbd (load)": "vpmovsxbd 8*{0}(%1), %%ymm{0}",
    "vpbroadcastq (load)": "vpbroadcastq 8*{0}(%1), %%ymm{0}",
    "vcvtdq2ps": "vcvtdq2ps %%ymm8, %%ymm{0}",
    "vcvtps2dq": "vcvtps2dq %%ymm8, %%ymm{0}",
    "vmulps": "vmulps %%ymm8, %%ymm9, %%ymm{0}",
    "vaddps": "vaddps %%ymm8, %%ymm9, %%ymm{0}",
    "vmaxps": "vmaxps %%ymm8, %%ymm9, %%ymm{0}",
    "vphaddd": "vphaddd %%ymm8, %%ymm9, %%ymm{0}",
    "vpermd": "vpermd %%ymm8, %%ymm9, %%ymm{0}",
    "vpackssdw": "vpackssdw %%ymm8, %%ymm9, %%ymm{0}",
}
PARTNER = "vpmaddwd %%ymm8, %%ymm9, %%ymm{0}"


def loops() -> dict[str, list[str]]:
    """Each measured loop body: 8 independent instructions (registers 0-7, 10-15 for the partner)."""
    bodies = {f"{name} x8": [text.format(i) for i in range(8)] for name, text in INSTRUCTIONS.items()}
    for name, text in INSTRUCTIONS.items():
        if name != "vpmaddwd":
            bodies[f"{name} x4 + vpmaddwd x4"] = [
                line for i in range(4) for line in (text.format(i), PARTNER.format(10 + i))]
    return bodies


def program(bodies: dict[str, list[str]], iterations: int, trials: int) -> str:
    """C++ timing every loop right after the FMA loop, trial after trial: each prints the loop's time in
    cycles (the FMA loop's time / 4) per trial, so that a VM's drift, slow against one pair, cancels."""
    loops_cpp = []
    for name, lines in bodies.items():
        asm = "\\n".join(lines)
        loops_cpp.append(f'  {{"{name}", [](long long n) {{ asm volatile("1:\\n{asm}\\n dec %0\\n jnz 1b" '
                         ': "+r"(n) : "r"(buffer) : "memory", "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", '
                         '"xmm6", "xmm7", "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "xmm15"); }},')
    return f"""
#include <chrono>
#include <cstdio>
alignas(64) static signed char buffer[4096];
struct Loop {{ const char* name; void (*body)(long long); }};
static const Loop loops[] = {{
{chr(10).join(loops_cpp)}
}};
static double seconds(void (*body)(long long)) {{
  const auto start = std::chrono::steady_clock::now();
  body({iterations}LL);
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}}
int main() {{
  asm volatile("vpxor %%ymm8, %%ymm8, %%ymm8\\n vpcmpeqd %%ymm9, %%ymm9, %%ymm9" ::: "xmm8", "xmm9");
  for (int t = 0; t < {trials}; ++t)
    for (const Loop& loop : loops) {{
      const double cycle = seconds(loops[0].body) / 4;
      std::printf("%s\\t%.6f\\t%.6f\\n", loop.name, seconds(loop.body) / cycle, cycle * 1e9 / {iterations});
    }}
}}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=15)
    parser.add_argument("--iterations", type=int, default=2_000_000)
    args = parser.parse_args()
    cxx = compiler()
    if cxx is None:
        raise SystemExit("no C++ compiler: neither $CXX nor g++ / c++ is on the PATH")
    print(cpu_header(), flush=True)
    bodies = loops()
    with tempfile.TemporaryDirectory() as tmp:
        source, binary = Path(tmp) / "simd.cpp", Path(tmp) / "simd"
        source.write_text(program(bodies, args.iterations, args.trials))
        subprocess.run([cxx, "-O2", "-mavx2", "-mfma", str(source), "-o", str(binary)], check=True)
        out = subprocess.run(["taskset", "-c", "0", str(binary)], capture_output=True, text=True, check=True).stdout
    cycles: dict[str, list[float]] = {}
    clock: list[float] = []
    for line in out.splitlines():
        name, value, cycle = line.split("\t")
        cycles.setdefault(name, []).append(float(value))
        clock.append(float(cycle))
    print(f"\none cycle = {statistics.median(clock):.4f} ns (median; {1 / max(clock):.2f}-{1 / min(clock):.2f} GHz "
          f"over the run), from vfmadd231ps at 2 a cycle; medians of {args.trials} trials")
    print("| instruction | a cycle alone | cycles of 4 + 4 vpmaddwd |")
    print("|---|---|---|")
    for name in INSTRUCTIONS:
        alone = 8 / statistics.median(cycles[f"{name} x8"])
        paired = cycles.get(f"{name} x4 + vpmaddwd x4")
        beside = f"{statistics.median(paired):.2f}" if paired else "-"
        print(f"| {name} | {alone:.2f} | {beside} |")


if __name__ == "__main__":
    main()
