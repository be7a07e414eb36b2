#!/usr/bin/env python
"""llama.cpp's `llama-server` and `llama-perplexity`, built once with cmake from the llama.cpp source
vendored in the `llama-cpp-python` sdist, cached under a folder (issue 25's race).

    python scripts/llama_cpp_build.py --cache ~/.cache/ferrum-llama-cpp      # prints the two paths

Layout under the cache folder (kept between runs; nothing is built when both binaries are there):
  llama_cpp_python-VERSION.tar.gz                      pip download --no-binary :all: --no-deps
  llama_cpp_python-VERSION/vendor/llama.cpp/           the extracted sdist's llama.cpp
  llama_cpp_python-VERSION/vendor/llama.cpp/build-noamx/bin/
                                                       cmake -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF, the
                                                       two targets only, for this CPU's instruction sets
                                                       (GGML_NATIVE off, each of AVX2 ... AVX512-BF16 that
                                                       /proc/cpuinfo lists on) less AMX: -march=native turned
                                                       ggml's AMX code on, and on a VM guest whose CPU lists
                                                       amx_tile (an Intel Xeon, 2026-11-28) both binaries
                                                       died on its first tile instruction (invalid opcode)
About 10 minutes on 2 cores the first time; cmake's output goes to build.log beside the tarball.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

SDIST_VERSION = "0.3.36"
TARGETS = ("llama-server", "llama-perplexity")


class BuildError(RuntimeError):
    pass


@dataclass(frozen=True)
class LlamaCppBuild:
    """Where one llama-cpp-python sdist's llama.cpp lives and builds under `cache`."""

    cache: Path
    version: str = SDIST_VERSION

    @property
    def sdist(self) -> Path:
        return self.cache / f"llama_cpp_python-{self.version}.tar.gz"

    @property
    def source(self) -> Path:
        return self.cache / f"llama_cpp_python-{self.version}" / "vendor" / "llama.cpp"

    @property
    def build_dir(self) -> Path:
        return self.source / "build-noamx"

    @property
    def log(self) -> Path:
        return self.cache / "build.log"

    def binary(self, target: str) -> Path:
        return self.build_dir / "bin" / target

    def missing(self) -> list[str]:
        return [t for t in TARGETS if not os.access(self.binary(t), os.X_OK)]


# ggml's cmake switches for the instruction sets /proc/cpuinfo names (AMX left off: see the docstring)
ISA_SWITCHES = (("avx", "GGML_AVX"), ("avx2", "GGML_AVX2"), ("fma", "GGML_FMA"), ("f16c", "GGML_F16C"),
                ("bmi2", "GGML_BMI2"), ("avx_vnni", "GGML_AVX_VNNI"), ("avx512f", "GGML_AVX512"),
                ("avx512vbmi", "GGML_AVX512_VBMI"), ("avx512_vnni", "GGML_AVX512_VNNI"),
                ("avx512_bf16", "GGML_AVX512_BF16"))


def isa_cmake_args(cpuinfo: Path = Path("/proc/cpuinfo")) -> list[str]:
    """-DGGML_NATIVE=OFF and each switch of ISA_SWITCHES ON or OFF by the first CPU's flags (x86); no
    arguments where /proc/cpuinfo has no x86 flags (cmake's native default)."""
    try:
        line = next(ln for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags"))
    except (OSError, StopIteration):
        return []
    flags = set(line.partition(":")[2].split())
    return ["-DGGML_NATIVE=OFF", *(f"-D{switch}={'ON' if flag in flags else 'OFF'}" for flag, switch in ISA_SWITCHES),
            "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]


def _run(cmd: list[str], log: Path, what: str) -> None:
    print(f"llama.cpp: {what}: {' '.join(cmd)} (output in {log})", flush=True)
    with log.open("ab") as out:
        done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, check=False)
    if done.returncode:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise BuildError(f"{what} failed with {done.returncode}; the end of {log}:\n{tail}")


def download_sdist(build: LlamaCppBuild) -> None:
    """The sdist from PyPI through pip (source only, no dependencies)."""
    _run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
          "-d", str(build.cache), f"llama-cpp-python=={build.version}"], build.log, "download the sdist")
    if not build.sdist.is_file():
        raise BuildError(f"pip download left no {build.sdist.name} in {build.cache}")


def extract_sdist(build: LlamaCppBuild) -> None:
    print(f"llama.cpp: extracting {build.sdist.name}", flush=True)
    with tarfile.open(build.sdist) as tar:
        tar.extractall(build.cache, filter="data")
    if not (build.source / "CMakeLists.txt").is_file():
        raise BuildError(f"{build.sdist.name} has no vendor/llama.cpp/CMakeLists.txt")


def ensure_built(build: LlamaCppBuild, jobs: int | None = None) -> dict[str, Path]:
    """Each target's executable, downloading, extracting, configuring and building only what is missing."""
    missing = build.missing()
    if missing:
        build.cache.mkdir(parents=True, exist_ok=True)
        if not (build.source / "CMakeLists.txt").is_file():
            if not build.sdist.is_file():
                download_sdist(build)
            extract_sdist(build)
        if not (build.build_dir / "CMakeCache.txt").is_file():
            _run(["cmake", "-S", str(build.source), "-B", str(build.build_dir), "-DCMAKE_BUILD_TYPE=Release",
                  "-DLLAMA_CURL=OFF", *isa_cmake_args()], build.log, "configure")
        _run(["cmake", "--build", str(build.build_dir), "--config", "Release", "-j", str(jobs or os.cpu_count() or 1),
              "--target", *missing], build.log, f"build {', '.join(missing)}")
        still = build.missing()
        if still:
            raise BuildError(f"the build made no {', '.join(still)} under {build.build_dir / 'bin'}")
    return {t: build.binary(t) for t in TARGETS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cache", required=True, type=Path, help="the folder the sdist is kept and built in")
    ap.add_argument("--version", default=SDIST_VERSION, help="llama-cpp-python's version")
    ap.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: the CPUs)")
    args = ap.parse_args(argv)
    try:
        paths = ensure_built(LlamaCppBuild(args.cache.resolve(), args.version), args.jobs)
    except BuildError as exc:
        print(f"llama_cpp_build: {exc}", file=sys.stderr)
        return 1
    for target, path in paths.items():
        print(f"{target}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
