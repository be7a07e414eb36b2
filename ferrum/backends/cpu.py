"""The torch CPU backend, with capabilities probed from the machine it runs on.

Limits are derived from total memory (the machine's, or the cgroup's if lower) with one simple
formula, so they stay the same from call to call:

    kv_token_budget     = (total_memory_bytes * KV_CACHE_MEMORY_FRACTION) // ASSUMED_KV_BYTES_PER_TOKEN
    max_sequence_length = clamp(kv_token_budget, 1, MAX_SEQUENCE_LENGTH_CAP)
    max_batch_size      = clamp(kv_token_budget // TOKENS_PER_BATCH_SLOT, 1, MAX_BATCH_SIZE_CAP)

i.e. a quarter of RAM is set aside for the paged KV cache at a nominal 128 KiB per token (a
small model's fp32 KV entries), and every slot of a full batch gets at least 1024 tokens of it.

Quantized weights: int8 and int4 through torch's CPU ops; fp8 emulated (its weights dequantized for
the matmul: correct, slow).
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

import torch

from ferrum.backends.base import ComputeBackend
from ferrum.backends.capabilities import BackendCapabilities
from ferrum.backends.device import Device

KV_CACHE_MEMORY_FRACTION = 0.25
ASSUMED_KV_BYTES_PER_TOKEN = 128 * 1024
TOKENS_PER_BATCH_SLOT = 1024
MAX_SEQUENCE_LENGTH_CAP = 131_072
MAX_BATCH_SIZE_CAP = 256
CPU_MEMORY_ALIGNMENT = 64  # one cache line

PROBED_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16, torch.int8)
REPORTED_CPU_FLAGS: tuple[str, ...] = (
    "avx2",
    "avx512f",
    "avx512_vnni",
    "avx512_bf16",
    "avx512_fp16",
    "avx_vnni",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
    "amx_fp16",
)

BF16_MATMUL_FLAGS = ("avx512_bf16", "amx_bf16")  # CPU features of native bf16 matrix products
CPU_QUANTIZATION: frozenset[str] = frozenset({"int8", "int4", "fp8"})

MEMINFO_PATH = Path("/proc/meminfo")
CPUINFO_PATH = Path("/proc/cpuinfo")
STATM_PATH = Path("/proc/self/statm")
CGROUP_DIR = Path("/sys/fs/cgroup")


@dataclass(frozen=True)
class SystemMemory:
    total_bytes: int
    available_bytes: int


def read_meminfo(path: Path = MEMINFO_PATH) -> SystemMemory | None:
    """Total and available memory from /proc/meminfo; None if it is missing or unreadable."""
    try:
        text = path.read_text()
    except OSError:
        return None
    kibibytes: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            kibibytes[key.strip()] = int(parts[0])
    if "MemTotal" not in kibibytes:
        return None
    available = kibibytes.get("MemAvailable", kibibytes.get("MemFree", 0))
    return SystemMemory(total_bytes=kibibytes["MemTotal"] * 1024, available_bytes=available * 1024)


def read_sysconf_memory() -> SystemMemory | None:
    """Total and available memory from os.sysconf; None where the platform lacks those names."""
    try:
        page_size = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page_size
        available = os.sysconf("SC_AVPHYS_PAGES") * page_size
    except (ValueError, OSError, AttributeError):
        return None
    return SystemMemory(total_bytes=total, available_bytes=available) if total > 0 else None


CPU_CACHE_DIR = Path("/sys/devices/system/cpu/cpu0/cache")


# The most last-level cache a core of any x86 part has (AMD's 3D V-Cache: 96 MiB for 8 cores; Xeons and
# other EPYCs hold 1.5-5 MiB a core).
MAX_CACHE_PER_CORE = 12 * 2**20


def read_last_level_cache(cache_dir: Path = CPU_CACHE_DIR) -> tuple[int, int]:
    """(bytes, CPUs sharing it) of the highest-level cache of the first CPU (sysfs' index*/level, size
    "32768K" and shared_cpu_list "0-7,16"); (0, 0) where sysfs does not say, 0 CPUs where no list does."""
    best = (0, 0, 0)
    for index in cache_dir.glob("index*"):
        try:
            level = int((index / "level").read_text())
            size = (index / "size").read_text().strip().upper()
        except (OSError, ValueError):
            continue
        scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(size[-1:], 1)
        digits = size.rstrip("KMG")
        if digits.isdigit():
            best = max(best, (level, int(digits) * scale, count_cpu_list(index / "shared_cpu_list")))
    return best[1], best[2]


def count_cpu_list(path: Path) -> int:
    """CPUs in a sysfs CPU list ("0-7,16-23"); 0 where it cannot be read."""
    try:
        ranges = [part.partition("-") for part in path.read_text().strip().split(",") if part]
        return sum(int(hi or lo) - int(lo) + 1 for lo, _, hi in ranges)
    except (OSError, ValueError):
        return 0


def cache_share(llc_bytes: int, sharing_cpus: int, cores: int) -> int:
    """The last-level cache this process's `cores` can count on to keep weights between decode steps: their
    share of it among the CPUs that share it, and at most MAX_CACHE_PER_CORE a core. A VM's guest sees its
    host's whole cache shared only by the guest's own CPUs (2 vCPUs of an Intel Xeon report 480 MiB), where
    the rest of the host evicts it: there the bf16 demo model (256 MiB) decoded at 9.5 GB/s, memory's speed,
    2.2x slower than int4. 0 where the cache is not known."""
    if llc_bytes <= 0:
        return 0
    share = llc_bytes * min(cores, sharing_cpus) // sharing_cpus if sharing_cpus > 0 else llc_bytes
    return min(share, cores * MAX_CACHE_PER_CORE)


def apply_cgroup_limit(memory: SystemMemory, cgroup_dir: Path = CGROUP_DIR) -> SystemMemory:
    """Lower `memory` to a cgroup v2 memory limit (memory.max, memory.current) when one is set."""
    try:
        limit_text = (cgroup_dir / "memory.max").read_text().strip()
    except OSError:
        return memory
    if not limit_text.isdigit():  # "max": no limit
        return memory
    limit = int(limit_text)
    try:
        in_use = int((cgroup_dir / "memory.current").read_text().strip())
    except (OSError, ValueError):
        in_use = 0
    total = min(memory.total_bytes, limit)
    available = max(0, min(memory.available_bytes, limit - in_use, total))
    return SystemMemory(total_bytes=total, available_bytes=available)


def probe_system_memory() -> SystemMemory:
    """This machine's memory: /proc/meminfo, else os.sysconf, lowered to any cgroup limit."""
    memory = read_meminfo() or read_sysconf_memory()
    if memory is None:
        raise RuntimeError("cannot determine system memory: no /proc/meminfo and no os.sysconf page counts")
    memory = apply_cgroup_limit(memory)
    return SystemMemory(memory.total_bytes, min(memory.available_bytes, memory.total_bytes))


def process_resident_bytes(statm_path: Path = STATM_PATH) -> int:
    """This process's resident set size; falls back to the peak RSS where /proc is missing."""
    try:
        resident_pages = int(statm_path.read_text().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kibibytes on Linux


def usable_core_count(cgroup_dir: Path = CGROUP_DIR) -> int:
    """Cores this process may run on: its affinity mask, lowered to a cgroup v2 CPU quota (cpu.max
    "quota period", rounded up) where one is set; not all cores of the machine."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    try:
        quota, period = (cgroup_dir / "cpu.max").read_text().split()[:2]
        if quota != "max":
            cores = min(cores, max(1, -(-int(quota) // int(period))))
    except (OSError, ValueError):
        pass
    return cores


def read_cpu_flags(path: Path = CPUINFO_PATH) -> frozenset[str]:
    """The feature flags of the first processor in /proc/cpuinfo; empty if unavailable."""
    try:
        text = path.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def read_cpu_model(path: Path = CPUINFO_PATH) -> str:
    """The CPU's model name ("AMD EPYC 9B14"), from /proc/cpuinfo, else what the platform says."""
    try:
        for line in path.read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                return value.strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "cpu"


def has_native_bf16(cpu_flags: frozenset[str]) -> bool:
    """True when the CPU computes bf16 matmuls in hardware (AVX512-BF16 or AMX) and torch reaches
    them through oneDNN."""
    return torch.backends.mkldnn.is_available() and any(flag in cpu_flags for flag in BF16_MATMUL_FLAGS)


class HostRuntime:
    """The live calls for the CPU (a DeviceRuntime): memory is the machine's (or the cgroup's);
    what this process holds is its resident set; there is nothing to wait for or to empty."""

    def __init__(self) -> None:
        self._peak = 0

    def memory_info(self) -> tuple[int, int]:
        memory = probe_system_memory()
        return memory.available_bytes, memory.total_bytes

    def memory_held(self) -> int:
        held = process_resident_bytes()
        self._peak = max(self._peak, held)
        return held

    def memory_allocated(self) -> int:
        return self.memory_held()

    def peak_memory_held(self) -> int:
        return max(self._peak, self.memory_held())

    def reset_peak_memory(self) -> None:
        self._peak = 0

    def synchronize(self) -> None:
        """CPU work is synchronous."""

    def empty_cache(self) -> None:
        """torch's CPU allocator keeps no cache to empty."""

    def make_current(self) -> None:
        pass


def gloo_available() -> bool:
    """Whether this torch has torch.distributed with gloo (the CPU's tensor-parallel ranks sum through it)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


def matmul_works(dtype: torch.dtype) -> bool:
    """Whether a tiny matmul in `dtype` runs on this CPU and gives the right answer."""
    try:
        ones = torch.ones(4, 4, dtype=dtype)
        product = ones @ ones
        return bool((product.to(torch.float32) == 4.0).all())
    except (RuntimeError, TypeError, NotImplementedError):
        return False


def limits_from_memory(total_memory_bytes: int) -> tuple[int, int]:
    """(max_batch_size, max_sequence_length) by the formula in this module's docstring."""
    kv_token_budget = int(total_memory_bytes * KV_CACHE_MEMORY_FRACTION) // ASSUMED_KV_BYTES_PER_TOKEN
    max_sequence_length = min(max(kv_token_budget, 1), MAX_SEQUENCE_LENGTH_CAP)
    max_batch_size = min(max(kv_token_budget // TOKENS_PER_BATCH_SLOT, 1), MAX_BATCH_SIZE_CAP)
    return max_batch_size, max_sequence_length


class CPUBackend(ComputeBackend):
    """Runs on the host CPU through torch. Dtypes and CPU features are probed once, at construction;
    memory is read again on every `capabilities()` call."""

    def __init__(self) -> None:
        super().__init__()
        self._supported_dtypes = frozenset(dtype for dtype in PROBED_DTYPES if matmul_works(dtype))
        self._core_count = usable_core_count()
        self._cpu_capability = torch.backends.cpu.get_cpu_capability()
        cpu_flags = read_cpu_flags()
        self._reported_cpu_flags = tuple(flag for flag in REPORTED_CPU_FLAGS if flag in cpu_flags)
        self._native_bf16 = has_native_bf16(cpu_flags) and torch.bfloat16 in self._supported_dtypes
        self._model = read_cpu_model()
        self._cache_bytes = cache_share(*read_last_level_cache(), self._core_count)
        self._runtime = HostRuntime()

    @property
    def name(self) -> str:
        return "cpu"

    @property
    def kind(self) -> str:
        return "cpu"

    @property
    def core_count(self) -> int:
        return self._core_count

    def capabilities(self) -> BackendCapabilities:
        memory = probe_system_memory()
        max_batch_size, max_sequence_length = limits_from_memory(memory.total_bytes)
        return BackendCapabilities(
            supported_dtypes=self._supported_dtypes,
            devices=("cpu",),
            max_batch_size=max_batch_size,
            max_sequence_length=max_sequence_length,
            supports_fp16=torch.float16 in self._supported_dtypes,
            supports_bf16=torch.bfloat16 in self._supported_dtypes,
            supports_int8=torch.int8 in self._supported_dtypes,
            flash_attention=False,
            paged_attention=True,  # the engine pages its KV cache on every backend
            cuda_graphs=False,
            memory_alignment=CPU_MEMORY_ALIGNMENT,
            total_memory_bytes=memory.total_bytes,
            free_memory_bytes=memory.available_bytes,
            supports_tensor_parallelism=True,  # ranks in processes of their own, gloo between them
            max_tensor_parallel_size=max(1, self._core_count),  # at least a core per rank
            quantization=CPU_QUANTIZATION,
            extras={
                "cores": self._core_count,
                "cpu_capability": self._cpu_capability,
                "cpu_flags": self._reported_cpu_flags,
            },
        )

    def version(self) -> str:
        return f"torch {torch.__version__}"

    def memory_in_use_bytes(self) -> int:
        return process_resident_bytes()

    def _make_device(self, device: str) -> Device:
        """bf16 is preferred where the CPU has bf16 matmul units (AMX / AVX512-BF16), float32
        elsewhere (bf16 without them is emulated: slower than float32)."""
        return Device(
            name="cpu",
            kind="cpu",
            description=f"{self._model} ({self._core_count} cores)",
            dtypes=self._supported_dtypes,
            preferred_dtype=torch.bfloat16 if self._native_bf16 else torch.float32,
            total_memory_bytes=probe_system_memory().total_bytes,
            multi_processor_count=self._core_count,
            cpu_flags=self._reported_cpu_flags,
            packed_bf16_linears=self._native_bf16,
            cache_bytes=self._cache_bytes,
            collective="gloo" if gloo_available() else None,
            threads=self._core_count,  # torch's intra-op threads, set by initialize
            runtime=self._runtime,
        )

    async def _prepare_device(self, device: str) -> None:
        torch.set_num_threads(self._core_count)

    async def synchronize(self, device: str) -> None:
        """CPU work is synchronous, so there is nothing to wait for; only the device is checked."""
        if not self.supports_device(device):
            raise ValueError(f"backend cpu does not serve device {device!r}")
