"""Builds the CPU kernels (the .cpp files beside this module) into one shared library and loads it
as `torch.ops.ferrum_cpu`.

The library is compiled for the machine it runs on (`-march=native`), so its cache key covers what
the code depends on: the sources, the torch build, the compiler and the target it resolves `native`
to. It lives at `<cache_dir>/cpu-<key>/ferrum_cpu.so`, written under a temporary name and renamed
into place, so that an interrupted build leaves nothing a later start would load. A first build takes
about 30-60 s on 2 cores; later starts load the cached file in milliseconds.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sysconfig
import tempfile
import threading
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SOURCES = ("attention.cpp", "layer_ops.cpp", "quant_gemv.cpp", "float_gemv.cpp", "decode_chain.cpp",
           "int4_fit.cpp", "library.cpp")
HEADERS = ("common.h", "simd.h")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fopenmp-simd", "-std=c++17", "-shared", "-fPIC",
         "-fvisibility=hidden", "-w")

_lock = threading.Lock()
_loaded: dict[Path, Path] = {}


class CpuKernelBuildError(RuntimeError):
    """The CPU kernels could not be compiled or loaded (the message says which command failed and why)."""


def compiler() -> str | None:
    """The C++ compiler the kernels are built with: $CXX, else g++ or c++ on the PATH."""
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["g++", "c++"]
    for name in candidates:
        found = shutil.which(name)
        if found:
            return found
    return None


def load_cpu_kernels(cache_dir: Path) -> Path:
    """Builds the kernels if `cache_dir` holds no build for this machine, loads them (once per
    process) and returns the library's path. Raises CpuKernelBuildError."""
    cache_dir = Path(cache_dir).expanduser()
    with _lock:
        if cache_dir in _loaded:
            return _loaded[cache_dir]
        library = build_kernels(Path(__file__).parent, cache_dir)
        if not _loaded:  # one library per process registers the ops
            try:
                torch.ops.load_library(str(library))
            except (OSError, RuntimeError) as exc:
                raise CpuKernelBuildError(f"loading {library} failed: {exc}") from exc
        _loaded[cache_dir] = library
        return library


def _key(cxx: str, here: Path) -> str:
    digest = hashlib.sha256()
    for name in (*SOURCES, *HEADERS):
        digest.update(name.encode() + b"\0" + (here / name).read_bytes())
    digest.update(f"{torch.__version__}|{torch.__file__}|{' '.join(FLAGS)}".encode())
    digest.update(_run([cxx, "--version"]).encode())
    # what -march=native means on this machine (the CPU's instruction sets)
    digest.update(_run([cxx, "-march=native", "-Q", "--help=target"]).encode())
    return digest.hexdigest()[:16]


def build_kernels(source_dir: Path, cache_dir: Path, namespace: str = "ferrum_cpu") -> Path:
    """The library of the kernels' SOURCES and HEADERS as `source_dir` holds them (this module's folder, or
    another version of them), their ops registered as torch.ops.<namespace>, compiled for this machine into
    `<cache_dir>/cpu-<key>/<namespace>.so` unless it is there already; returns its path, not loaded. A
    library under another namespace loads beside this module's. Raises CpuKernelBuildError."""
    cxx = compiler()
    if cxx is None:
        raise CpuKernelBuildError("no C++ compiler: neither $CXX nor g++ / c++ is on the PATH")
    library = Path(cache_dir).expanduser() / f"cpu-{_key(cxx, Path(source_dir))}" / f"{namespace}.so"
    if not library.exists():
        _compile(cxx, Path(source_dir), library, namespace)
    return library


def _compile(cxx: str, here: Path, library: Path, namespace: str = "ferrum_cpu") -> None:
    from torch.utils.cpp_extension import include_paths, library_paths

    library.parent.mkdir(parents=True, exist_ok=True)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    fd, partial = tempfile.mkstemp(prefix=".ferrum_cpu-", suffix=".so", dir=library.parent)
    os.close(fd)
    command = [cxx, *FLAGS, f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-DTORCH_EXTENSION_NAME={namespace}",
               f"-DFERRUM_CPU_OPS={namespace}",
               *[f"-I{p}" for p in include_paths()], f"-I{sysconfig.get_paths()['include']}",
               *[str(here / s) for s in SOURCES], *[f"-L{p}" for p in library_paths()],
               *[f"-Wl,-rpath,{p}" for p in library_paths()], "-lc10", "-ltorch_cpu", "-ltorch", "-o", partial]
    log.info("building the CPU kernels into %s (once per machine and torch build; about a minute)", library.parent)
    started = time.monotonic()
    try:
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise CpuKernelBuildError(f"{Path(cxx).name} failed ({done.returncode}) building the CPU kernels: "
                                      f"{done.stderr.strip()[-2000:]}")
        os.replace(partial, library)
    finally:
        Path(partial).unlink(missing_ok=True)
    log.info("built the CPU kernels in %.1f s", time.monotonic() - started)


def _run(command: list[str]) -> str:
    try:
        return subprocess.run(command, capture_output=True, text=True, check=False).stdout
    except OSError as exc:
        raise CpuKernelBuildError(f"{command[0]} did not run: {exc}") from exc
