"""Tests for ferrum.backends: capabilities vs requirements, the registry's ranking, the real CPU
backend, backend selection, the CUDA and MPS backends built from stub facts, and release hooks."""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from ferrum.backends import cpu as cpu_module
from ferrum.backends import cuda as cuda_module
from ferrum.backends import mps as mps_module
from ferrum.backends import registry as registry_module
from ferrum.backends.base import BackendReleaseError, BackendStatus, ComputeBackend
from ferrum.backends.capabilities import (
    BackendCapabilities,
    BackendRequirements,
    device_is_served,
    parse_device,
    parse_dtype,
)
from ferrum.backends.cpu import CPUBackend, SystemMemory, limits_from_memory
from ferrum.backends.cuda import CUDABackend, CudaDeviceFacts
from ferrum.backends.device import Device
from ferrum.backends.mps import MPSBackend, MpsDeviceFacts
from ferrum.backends.registry import BackendRegistry, create_default_registry
from ferrum.backends.selection import BackendSelectionError, parse_backend_spec, select_backend

GIB = 1024**3

# ---------------------------------------------------------------------------------------------
# Fixed capability profiles, for the registry and selection rules apart from any real backend.
# ---------------------------------------------------------------------------------------------


def cuda_profile(
    devices: tuple[str, ...] = ("cuda:0", "cuda:1"), free_memory_bytes: int = 70 * GIB
) -> BackendCapabilities:
    return BackendCapabilities(
        supported_dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16, torch.int8}),
        devices=devices,
        max_batch_size=256,
        max_sequence_length=131_072,
        supports_fp16=True,
        supports_bf16=True,
        supports_int8=True,
        flash_attention=True,
        paged_attention=True,
        cuda_graphs=True,
        memory_alignment=256,
        total_memory_bytes=80 * GIB,
        free_memory_bytes=free_memory_bytes,
        extras={"compute_capability": (9, 0)},
    )


def mps_profile(free_memory_bytes: int = 100 * GIB) -> BackendCapabilities:
    return BackendCapabilities(
        supported_dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16}),
        devices=("mps",),
        max_batch_size=64,
        max_sequence_length=32_768,
        supports_fp16=True,
        supports_bf16=True,
        supports_int8=False,
        flash_attention=False,
        paged_attention=True,
        cuda_graphs=False,
        memory_alignment=16_384,
        total_memory_bytes=128 * GIB,
        free_memory_bytes=free_memory_bytes,
    )


def cpu_profile(free_memory_bytes: int = 200 * GIB) -> BackendCapabilities:
    return BackendCapabilities(
        supported_dtypes=frozenset({torch.float32}),
        devices=("cpu",),
        max_batch_size=16,
        max_sequence_length=8_192,
        supports_fp16=False,
        supports_bf16=False,
        supports_int8=False,
        flash_attention=False,
        paged_attention=False,
        cuda_graphs=False,
        memory_alignment=64,
        total_memory_bytes=256 * GIB,
        free_memory_bytes=free_memory_bytes,
    )


class FixedProfileBackend(ComputeBackend):
    """A backend that reports a fixed capability profile and records what it was asked to do."""

    def __init__(
        self, name: str, kind: str, profile: BackendCapabilities, fail_prepare: bool = False
    ) -> None:
        super().__init__()
        self._name = name
        self._kind = kind
        self._profile = profile
        self._fail_prepare = fail_prepare
        self.prepared_devices: list[str] = []

    @property
    def name(self) -> str:
        return self._name

    @property
    def kind(self) -> str:
        return self._kind

    def capabilities(self) -> BackendCapabilities:
        return self._profile

    def version(self) -> str:
        return f"fixed-profile {self._kind}"

    def memory_in_use_bytes(self) -> int:
        return 0

    async def _prepare_device(self, device: str) -> None:
        if self._fail_prepare:
            raise RuntimeError(f"{device} is on fire")
        self.prepared_devices.append(device)

    async def synchronize(self, device: str) -> None:
        return None

    def _make_device(self, device: str) -> Device:
        profile = self._profile
        return Device(name=device, kind=device.partition(":")[0], description=f"fixed {self._kind}",  # type: ignore[arg-type]
                      dtypes=profile.supported_dtypes, preferred_dtype=torch.float32,
                      total_memory_bytes=profile.total_memory_bytes)


async def registry_of(*backends: ComputeBackend) -> BackendRegistry:
    registry = BackendRegistry()
    for backend in backends:
        await registry.register(backend)
    return registry


# ---------------------------------------------------------------------------------------------
# Capabilities against requirements
# ---------------------------------------------------------------------------------------------

TWO_GPU = cuda_profile()
ONE_GPU = cuda_profile(devices=("cuda:0",))


@pytest.mark.parametrize(
    ("profile", "requirements", "expected_unmet"),
    [
        pytest.param(TWO_GPU, BackendRequirements(), None, id="nothing-required"),
        pytest.param(TWO_GPU, BackendRequirements(devices=("cuda",)), None, id="cuda-matches-any-gpu"),
        pytest.param(TWO_GPU, BackendRequirements(devices=("cuda:1",)), None, id="cuda:1-exact-match"),
        pytest.param(
            TWO_GPU, BackendRequirements(devices=("cuda:0", "cuda:1")), None, id="every-device-served"
        ),
        pytest.param(ONE_GPU, BackendRequirements(devices=("cuda",)), None, id="cuda-matches-cuda:0"),
        pytest.param(
            ONE_GPU,
            BackendRequirements(devices=("cuda:1",)),
            "requires device cuda:1, has cuda:0",
            id="cuda:1-missing",
        ),
        pytest.param(
            TWO_GPU,
            BackendRequirements(devices=("cuda:0", "cuda:2")),
            "requires device cuda:2, has cuda:0, cuda:1",
            id="one-of-two-devices-missing",
        ),
        pytest.param(
            TWO_GPU, BackendRequirements(devices=("cpu",)), "requires device cpu", id="cpu-not-on-gpu"
        ),
        pytest.param(
            cpu_profile(),
            BackendRequirements(devices=("cuda",)),
            "requires device cuda, has cpu",
            id="cuda-not-on-cpu",
        ),
        pytest.param(
            TWO_GPU, BackendRequirements(dtypes=(torch.bfloat16, torch.int8)), None, id="dtypes-met"
        ),
        pytest.param(
            cpu_profile(),
            BackendRequirements(dtypes=(torch.bfloat16,)),
            "requires dtype bfloat16, supports float32",
            id="dtype-bf16-missing",
        ),
        pytest.param(
            mps_profile(),
            BackendRequirements(dtypes=(torch.int8,)),
            "requires dtype int8, supports bfloat16, float16, float32",
            id="dtype-int8-missing",
        ),
        pytest.param(cpu_profile(), BackendRequirements(min_batch_size=16), None, id="batch-size-at-limit"),
        pytest.param(
            cpu_profile(),
            BackendRequirements(min_batch_size=17),
            "requires batch size 17, max batch size is 16",
            id="batch-size-over-limit",
        ),
        pytest.param(
            cpu_profile(), BackendRequirements(min_sequence_length=8_192), None, id="sequence-at-limit"
        ),
        pytest.param(
            cpu_profile(),
            BackendRequirements(min_sequence_length=8_193),
            "requires sequence length 8193, max sequence length is 8192",
            id="sequence-over-limit",
        ),
        pytest.param(TWO_GPU, BackendRequirements(requires_flash_attention=True), None, id="flash-met"),
        pytest.param(
            mps_profile(),
            BackendRequirements(requires_flash_attention=True),
            "requires flash attention, not supported",
            id="flash-missing",
        ),
        pytest.param(mps_profile(), BackendRequirements(requires_paged_attention=True), None, id="paged-met"),
        pytest.param(
            cpu_profile(),
            BackendRequirements(requires_paged_attention=True),
            "requires paged attention, not supported",
            id="paged-missing",
        ),
    ],
)
def test_each_requirement_is_checked(
    profile: BackendCapabilities, requirements: BackendRequirements, expected_unmet: str | None
) -> None:
    unmet = profile.unmet_requirements(requirements)
    if expected_unmet is None:
        assert unmet == []
        assert profile.meets_requirements(requirements)
    else:
        assert len(unmet) == 1, unmet
        assert unmet[0].startswith(expected_unmet), unmet
        assert not profile.meets_requirements(requirements)


def test_every_failed_requirement_gets_its_own_line() -> None:
    requirements = BackendRequirements(
        devices=("cuda",),
        dtypes=(torch.bfloat16, torch.float16),
        min_batch_size=1_000,
        min_sequence_length=1_000_000,
        requires_flash_attention=True,
        requires_paged_attention=True,
    )
    unmet = cpu_profile().unmet_requirements(requirements)
    assert unmet == [
        "requires device cuda, has cpu",
        "requires dtype bfloat16, supports float32",
        "requires dtype float16, supports float32",
        "requires batch size 1000, max batch size is 16",
        "requires sequence length 1000000, max sequence length is 8192",
        "requires flash attention, not supported",
        "requires paged attention, not supported",
    ]


@pytest.mark.parametrize(
    ("requested", "offered", "served"),
    [
        ("cuda", ("cuda:0", "cuda:3"), True),
        ("cuda:3", ("cuda:0", "cuda:3"), True),
        ("cuda:1", ("cuda:0", "cuda:3"), False),
        ("cuda", ("cpu",), False),
        ("cpu", ("cpu",), True),
        ("mps", ("mps",), True),
        ("mps", (), False),
    ],
)
def test_device_matching(requested: str, offered: tuple[str, ...], served: bool) -> None:
    assert device_is_served(requested, offered) is served


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cuda:", "cuda:-1", "cpu:0", "mps:0", "", "CUDA"])
def test_malformed_devices_are_rejected(device: str) -> None:
    with pytest.raises(ValueError, match="valid forms"):
        parse_device(device)


def test_capabilities_reject_contradictory_dtype_flags() -> None:
    with pytest.raises(ValueError, match="supports_bf16"):
        dataclasses.replace(cpu_profile(), supports_bf16=True)


@pytest.mark.parametrize(
    ("field_name", "value", "message"),
    [
        ("memory_alignment", 48, "power of two"),
        ("max_batch_size", 0, "max_batch_size"),
        ("free_memory_bytes", 300 * GIB, "free_memory_bytes"),
        ("devices", ("gpu0",), "unknown device"),
    ],
)
def test_capabilities_reject_impossible_values(field_name: str, value: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(cpu_profile(), **{field_name: value})


def test_capabilities_are_immutable_values() -> None:
    profile = cuda_profile()
    with pytest.raises(dataclasses.FrozenInstanceError):
        profile.max_batch_size = 1  # type: ignore[misc]
    with pytest.raises(TypeError):
        profile.extras["compute_capability"] = (8, 0)  # type: ignore[index]
    assert profile == cuda_profile()
    assert hash(profile) == hash(cuda_profile())


# ---------------------------------------------------------------------------------------------
# BackendRequirements.from_mapping
# ---------------------------------------------------------------------------------------------


def test_from_mapping_parses_every_key() -> None:
    requirements = BackendRequirements.from_mapping(
        {
            "devices": ["cuda:0", "cuda"],
            "dtypes": ["bf16", "float32"],
            "min_batch_size": 8,
            "min_sequence_length": 4096,
            "requires_flash_attention": True,
            "requires_paged_attention": False,
        }
    )
    assert requirements == BackendRequirements(
        devices=("cuda:0", "cuda"),
        dtypes=(torch.bfloat16, torch.float32),
        min_batch_size=8,
        min_sequence_length=4096,
        requires_flash_attention=True,
        requires_paged_attention=False,
    )


def test_from_mapping_of_nothing_requires_nothing() -> None:
    assert BackendRequirements.from_mapping({}) == BackendRequirements()


def test_from_mapping_accepts_a_single_string() -> None:
    requirements = BackendRequirements.from_mapping({"devices": "cpu", "dtypes": "fp16"})
    assert requirements.devices == ("cpu",)
    assert requirements.dtypes == (torch.float16,)


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("bfloat16", torch.bfloat16),
        ("bf16", torch.bfloat16),
        ("float16", torch.float16),
        ("fp16", torch.float16),
        ("float32", torch.float32),
        ("fp32", torch.float32),
        ("int8", torch.int8),
        ("BF16", torch.bfloat16),
    ],
)
def test_dtype_names(name: str, dtype: torch.dtype) -> None:
    assert parse_dtype(name) is dtype
    assert BackendRequirements.from_mapping({"dtypes": [name]}).dtypes == (dtype,)


@pytest.mark.parametrize(
    ("mapping", "named_key"),
    [
        ({"dtype": ["bf16"]}, "'dtype'"),
        ({"max_batch_size": 4}, "'max_batch_size'"),
        ({"dtypes": ["float8"]}, "'dtypes'"),
        ({"dtypes": "bf16, fp16"}, "'dtypes'"),
        ({"dtypes": [16]}, "'dtypes'"),
        ({"devices": ["tpu"]}, "'devices'"),
        ({"devices": ["cuda:one"]}, "'devices'"),
        ({"devices": 0}, "'devices'"),
        ({"min_batch_size": 0}, "'min_batch_size'"),
        ({"min_batch_size": "8"}, "'min_batch_size'"),
        ({"min_batch_size": True}, "'min_batch_size'"),
        ({"min_sequence_length": -5}, "'min_sequence_length'"),
        ({"min_sequence_length": 2.5}, "'min_sequence_length'"),
        ({"requires_flash_attention": "yes"}, "'requires_flash_attention'"),
        ({"requires_paged_attention": 1}, "'requires_paged_attention'"),
    ],
)
def test_from_mapping_errors_name_the_key(mapping: dict[str, object], named_key: str) -> None:
    with pytest.raises(ValueError) as caught:
        BackendRequirements.from_mapping(mapping)
    assert named_key in str(caught.value)


def test_from_mapping_rejects_a_non_mapping() -> None:
    with pytest.raises(ValueError, match="must be a mapping"):
        BackendRequirements.from_mapping(["cuda"])  # type: ignore[arg-type]


def test_requirements_validate_when_built_directly() -> None:
    with pytest.raises(ValueError, match="min_batch_size"):
        BackendRequirements(min_batch_size=0)
    with pytest.raises(ValueError, match="unknown device"):
        BackendRequirements(devices=("tpu",))


# ---------------------------------------------------------------------------------------------
# Registry: membership and ranking
# ---------------------------------------------------------------------------------------------


def profile_backends() -> tuple[FixedProfileBackend, FixedProfileBackend, FixedProfileBackend]:
    return (
        FixedProfileBackend("cuda", "cuda", cuda_profile()),
        FixedProfileBackend("mps", "mps", mps_profile()),
        FixedProfileBackend("cpu", "cpu", cpu_profile()),
    )


async def test_register_get_list_unregister() -> None:
    cuda, mps, cpu = profile_backends()
    registry = await registry_of(cpu, cuda, mps)
    assert registry.list() == [cpu, cuda, mps]
    assert registry.get("mps") is mps
    assert "cuda" in registry and len(registry) == 3
    assert await registry.unregister("cuda") is cuda
    assert registry.names() == ["cpu", "mps"]


async def test_duplicate_names_are_refused() -> None:
    registry = await registry_of(FixedProfileBackend("cpu", "cpu", cpu_profile()))
    with pytest.raises(ValueError, match="already registered"):
        await registry.register(FixedProfileBackend("cpu", "cpu", cpu_profile()))
    assert len(registry) == 1


async def test_unknown_names_list_the_registered_ones() -> None:
    registry = await registry_of(*profile_backends())
    with pytest.raises(KeyError, match=r"no backend named 'rocm'; registered: cuda, mps, cpu"):
        registry.get("rocm")
    with pytest.raises(KeyError, match="registered: cuda, mps, cpu"):
        await registry.unregister("rocm")


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 1, 0), (1, 2, 0)])
async def test_cuda_beats_mps_beats_cpu_whatever_the_registration_order(order: tuple[int, int, int]) -> None:
    backends = profile_backends()
    registry = await registry_of(*(backends[index] for index in order))
    # The CPU profile has the most free memory and MPS more than CUDA: kind still comes first.
    assert (await registry.find_best(None)).name == "cuda"  # type: ignore[union-attr]
    await registry.unregister("cuda")
    assert (await registry.find_best(None)).name == "mps"  # type: ignore[union-attr]
    await registry.unregister("mps")
    assert (await registry.find_best(None)).name == "cpu"  # type: ignore[union-attr]
    await registry.unregister("cpu")
    assert await registry.find_best(None) is None


async def test_more_free_memory_breaks_ties_within_a_kind() -> None:
    roomy = FixedProfileBackend("cuda-b", "cuda", cuda_profile(free_memory_bytes=60 * GIB))
    busy = FixedProfileBackend("cuda-a", "cuda", cuda_profile(free_memory_bytes=10 * GIB))
    registry = await registry_of(busy, roomy)
    assert await registry.find_best(BackendRequirements()) is roomy


async def test_name_breaks_ties_of_kind_and_memory() -> None:
    second = FixedProfileBackend("gpu-b", "cuda", cuda_profile())
    first = FixedProfileBackend("gpu-a", "cuda", cuda_profile())
    registry = await registry_of(second, first)
    assert await registry.find_best(BackendRequirements()) is first


@pytest.mark.parametrize(
    ("requirements", "expected_name"),
    [
        (BackendRequirements(requires_flash_attention=True), "cuda"),
        (BackendRequirements(devices=("mps",)), "mps"),
        (BackendRequirements(devices=("cpu",)), "cpu"),
        (BackendRequirements(requires_paged_attention=True, devices=("mps",)), "mps"),
        (BackendRequirements(min_sequence_length=100_000), "cuda"),
        (BackendRequirements(dtypes=(torch.int8,), requires_flash_attention=False), "cuda"),
        (BackendRequirements(devices=("cuda:2",)), None),
        (BackendRequirements(min_batch_size=1_000), None),
    ],
)
async def test_find_best_only_considers_backends_that_qualify(
    requirements: BackendRequirements, expected_name: str | None
) -> None:
    registry = await registry_of(*profile_backends())
    best = await registry.find_best(requirements)
    assert (best.name if best else None) == expected_name


async def test_filtering_falls_back_to_a_lower_ranked_backend() -> None:
    cuda, mps, cpu = profile_backends()
    registry = await registry_of(cuda, mps, cpu)
    # Only CUDA offers int8 with flash attention; without it, nothing qualifies.
    assert await registry.find_best(BackendRequirements(dtypes=(torch.int8,))) is cuda
    await registry.unregister("cuda")
    assert await registry.find_best(BackendRequirements(dtypes=(torch.int8,))) is None
    # The CPU profile lacks bf16 and tops out at batch size 16, so MPS wins despite less free memory.
    assert await registry.find_best(BackendRequirements(dtypes=(torch.bfloat16,))) is mps
    assert await registry.find_best(BackendRequirements(min_batch_size=32)) is mps
    # Once MPS is gone, the CPU is picked for what it can do, and nothing for what it cannot.
    await registry.unregister("mps")
    assert await registry.find_best(BackendRequirements(dtypes=(torch.float32,))) is cpu
    assert await registry.find_best(BackendRequirements(min_batch_size=32)) is None


async def test_explain_lists_each_backend_and_its_failures() -> None:
    registry = await registry_of(*profile_backends())
    explanation = registry.explain(BackendRequirements(requires_flash_attention=True, dtypes=(torch.int8,)))
    lines = explanation.splitlines()
    assert len(lines) == 3
    assert lines[0].startswith(
        "- cuda (kind cuda): devices cuda:0, cuda:1; dtypes bfloat16, float16, float32, int8"
    )
    assert lines[0].endswith("meets all requirements")
    assert "- mps" in lines[1] and "requires flash attention, not supported" in lines[1]
    assert "requires dtype int8" in lines[1]
    assert "- cpu" in lines[2] and "requires flash attention" in lines[2]
    assert "requires dtype int8" in lines[2]
    assert BackendRegistry().explain(None) == "no backends are registered"


# ---------------------------------------------------------------------------------------------
# The real CPU backend
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cpu_backend_probe() -> CPUBackend:
    return CPUBackend()


@pytest.fixture
def restore_torch_threads() -> Iterator[None]:
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def independent_matmul_works(dtype: torch.dtype) -> bool:
    try:
        matrix = torch.full((3, 3), 2, dtype=dtype)
        return bool(((matrix @ matrix).to(torch.float64) == 12).all())
    except RuntimeError:
        return False


def test_cpu_backend_probes_sane_capabilities(cpu_backend_probe: CPUBackend) -> None:
    capabilities = cpu_backend_probe.capabilities()
    assert capabilities.devices == ("cpu",)
    assert torch.float32 in capabilities.supported_dtypes
    assert (torch.bfloat16 in capabilities.supported_dtypes) == independent_matmul_works(torch.bfloat16)
    assert (torch.float16 in capabilities.supported_dtypes) == independent_matmul_works(torch.float16)
    assert capabilities.supports_bf16 == (torch.bfloat16 in capabilities.supported_dtypes)
    assert capabilities.total_memory_bytes > 0
    assert 0 < capabilities.free_memory_bytes <= capabilities.total_memory_bytes
    assert not capabilities.flash_attention
    assert capabilities.paged_attention
    assert not capabilities.cuda_graphs
    assert capabilities.memory_alignment == 64
    assert (capabilities.max_batch_size, capabilities.max_sequence_length) == limits_from_memory(
        capabilities.total_memory_bytes
    )
    assert capabilities.extras["cores"] == len(os.sched_getaffinity(0))
    assert capabilities.extras["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert cpu_backend_probe.kind == "cpu" and cpu_backend_probe.name == "cpu"
    assert cpu_backend_probe.version() == f"torch {torch.__version__}"
    assert cpu_backend_probe.default_device() == "cpu"
    assert cpu_backend_probe.supports_device("cpu") and not cpu_backend_probe.supports_device("cuda")


def test_cpu_total_memory_matches_proc_meminfo(cpu_backend_probe: CPUBackend) -> None:
    meminfo_path = Path("/proc/meminfo")
    if not meminfo_path.exists():
        pytest.skip("no /proc/meminfo on this platform")
    meminfo_lines = meminfo_path.read_text().splitlines()
    total_kib = next(int(line.split()[1]) for line in meminfo_lines if line.startswith("MemTotal:"))
    total = cpu_backend_probe.capabilities().total_memory_bytes
    assert 0 < total <= total_kib * 1024  # equal unless a cgroup limit is lower


def test_cpu_flags_reported_match_cpuinfo(cpu_backend_probe: CPUBackend) -> None:
    reported = cast("tuple[str, ...]", cpu_backend_probe.capabilities().extras["cpu_flags"])
    flags = cpu_module.read_cpu_flags()
    assert set(reported) == {flag for flag in cpu_module.REPORTED_CPU_FLAGS if flag in flags}


def test_limits_follow_the_documented_formula() -> None:
    # 16 GiB: a quarter (4 GiB) at 128 KiB per token is 32768 tokens; 32 slots of 1024 tokens.
    assert limits_from_memory(16 * GIB) == (32, 32_768)
    assert limits_from_memory(1024 * GIB) == (256, 131_072)  # capped
    assert limits_from_memory(1024) == (1, 1)  # never below one


def test_meminfo_parsing(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       2048 kB\nMemFree:         512 kB\nMemAvailable:   1024 kB\n")
    assert cpu_module.read_meminfo(meminfo) == SystemMemory(
        total_bytes=2048 * 1024, available_bytes=1024 * 1024
    )
    meminfo.write_text("MemTotal:       2048 kB\nMemFree:         512 kB\n")
    assert cpu_module.read_meminfo(meminfo) == SystemMemory(2048 * 1024, 512 * 1024)
    assert cpu_module.read_meminfo(tmp_path / "missing") is None


def test_sysconf_fallback_reports_memory() -> None:
    memory = cpu_module.read_sysconf_memory()
    if memory is None:
        pytest.skip("os.sysconf has no page counts here")
    assert memory.total_bytes > 0 and 0 <= memory.available_bytes <= memory.total_bytes


def test_cgroup_limit_lowers_memory(tmp_path: Path) -> None:
    machine = SystemMemory(total_bytes=64 * GIB, available_bytes=60 * GIB)
    (tmp_path / "memory.max").write_text(f"{8 * GIB}\n")
    (tmp_path / "memory.current").write_text(f"{3 * GIB}\n")
    assert cpu_module.apply_cgroup_limit(machine, tmp_path) == SystemMemory(8 * GIB, 5 * GIB)
    (tmp_path / "memory.max").write_text("max\n")
    assert cpu_module.apply_cgroup_limit(machine, tmp_path) == machine
    assert cpu_module.apply_cgroup_limit(machine, tmp_path / "absent") == machine


def test_cgroup_cpu_quota_lowers_the_usable_cores(tmp_path: Path) -> None:
    affinity = cpu_module.usable_core_count(tmp_path / "absent")
    (tmp_path / "cpu.max").write_text("150000 100000\n")  # 1.5 CPUs: 2 threads can use them
    assert cpu_module.usable_core_count(tmp_path) == min(affinity, 2)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cpu_module.usable_core_count(tmp_path) == affinity


def test_the_cache_auto_counts_on_is_the_cores_share_at_most_12_mib_a_core(tmp_path: Path) -> None:
    """sysfs' last-level cache and the CPUs sharing it; a VM's 2 vCPUs that report their host's 480 MiB
    count on 24 MiB (there the bf16 demo model decoded at memory's speed, 2.2x slower than int4)."""
    for index, (level, size, shared) in enumerate([(1, "48K", "0"), (2, "2048K", "0"), (3, "32768K", "0-7,16-23")]):
        folder = tmp_path / f"index{index}"
        folder.mkdir()
        (folder / "level").write_text(f"{level}\n")
        (folder / "size").write_text(f"{size}\n")
        (folder / "shared_cpu_list").write_text(f"{shared}\n")
    assert cpu_module.read_last_level_cache(tmp_path) == (32 * 2**20, 16)
    assert cpu_module.read_last_level_cache(tmp_path / "absent") == (0, 0)
    assert cpu_module.cache_share(32 * 2**20, 16, 4) == 8 * 2**20  # 4 of the 16 CPUs sharing it
    assert cpu_module.cache_share(480 * 2**20, 2, 2) == 24 * 2**20  # a VM guest's view of its host
    assert cpu_module.cache_share(32 * 2**20, 0, 8) == 32 * 2**20  # no list: the whole cache, under the cap
    assert cpu_module.cache_share(0, 0, 2) == 0


async def test_cpu_backend_lifecycle(restore_torch_threads: None) -> None:
    backend = CPUBackend()
    before = backend.status()
    assert before == BackendStatus(
        initialized=False,
        ready=False,
        active_devices=(),
        memory_in_use_bytes=before.memory_in_use_bytes,
        operations_completed=0,
        last_error=None,
    )
    assert before.memory_in_use_bytes > 0  # this process's RSS

    torch.set_num_threads(1)
    await backend.initialize("cpu")
    assert torch.get_num_threads() == backend.core_count == len(os.sched_getaffinity(0))
    ready = backend.status()
    assert ready.initialized and ready.ready and ready.active_devices == ("cpu",)

    await backend.synchronize("cpu")
    backend.record_operation()
    backend.record_operation(4)
    assert backend.status().operations_completed == 5
    backend.record_error(RuntimeError("matmul exploded"))
    assert backend.status().last_error == "RuntimeError: matmul exploded"

    await backend.shutdown()
    after = backend.status()
    assert after.initialized and not after.ready and after.active_devices == ()
    assert after.operations_completed == 5

    await backend.initialize("cpu")
    assert backend.status().ready


async def test_cpu_backend_refuses_devices_it_lacks() -> None:
    backend = CPUBackend()
    with pytest.raises(ValueError, match="does not serve device 'cuda:0'"):
        await backend.initialize("cuda:0")
    status = backend.status()
    assert not status.ready and status.last_error is not None and "cuda:0" in status.last_error
    with pytest.raises(ValueError, match="does not serve"):
        await backend.synchronize("mps")


# ---------------------------------------------------------------------------------------------
# Default registry
# ---------------------------------------------------------------------------------------------


async def test_default_registry_holds_the_cpu_backend() -> None:
    registry = await create_default_registry()
    assert isinstance(registry.get("cpu"), CPUBackend)
    if not torch.cuda.is_available() and not torch.backends.mps.is_available():
        assert registry.names() == ["cpu"]


async def test_default_registry_logs_and_skips_an_accelerator_module_that_cannot_be_imported(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "ferrum.backends.cuda", None)  # makes the import fail
    with caplog.at_level(logging.INFO, logger=registry_module.__name__):
        registry = await create_default_registry()
    assert registry.names() == ["cpu"]
    errors = [record for record in caplog.records if record.levelno == logging.ERROR]
    assert len(errors) == 1 and "could not set up the cuda backend" in errors[0].getMessage()
    assert isinstance(errors[0].exc_info[1], ImportError)  # type: ignore[index]


async def test_default_registry_registers_every_backend_a_module_creates(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake_cuda_module = types.ModuleType("ferrum.backends.cuda")
    fake_cuda_module.create_backends = lambda: [  # type: ignore[attr-defined]
        FixedProfileBackend("cuda:0", "cuda", cuda_profile(devices=("cuda:0",), free_memory_bytes=10 * GIB)),
        FixedProfileBackend("cuda:1", "cuda", cuda_profile(devices=("cuda:1",), free_memory_bytes=50 * GIB)),
    ]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "ferrum.backends.cuda", fake_cuda_module)
    registry = await create_default_registry()
    assert registry.names() == ["cpu", "cuda:0", "cuda:1"]
    assert (await registry.find_best()).name == "cuda:1"  # type: ignore[union-attr]  # more free memory


async def test_default_registry_survives_a_broken_accelerator_module(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken_backends() -> list[ComputeBackend]:
        raise RuntimeError("driver mismatch")

    fake_cuda_module = types.ModuleType("ferrum.backends.cuda")
    fake_cuda_module.create_backends = broken_backends  # type: ignore[attr-defined]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "ferrum.backends.cuda", fake_cuda_module)
    assert registry_module.ACCELERATOR_MODULES[0] == ("cuda", "ferrum.backends.cuda")
    with caplog.at_level(logging.INFO, logger=registry_module.__name__):
        registry = await create_default_registry()
    assert registry.names() == ["cpu"]
    errors = [record for record in caplog.records if record.levelno == logging.ERROR]
    assert len(errors) == 1 and "could not set up the cuda backend" in errors[0].getMessage()
    assert errors[0].exc_info is not None and "driver mismatch" in str(errors[0].exc_info[1])


# ---------------------------------------------------------------------------------------------
# select_backend
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "device"),
    [("auto", None), ("cpu", "cpu"), ("cuda", "cuda"), ("cuda:7", "cuda:7"), ("mps", "mps")],
)
def test_valid_specs_parse(spec: str, device: str | None) -> None:
    assert parse_backend_spec(spec) == device


@pytest.mark.parametrize("spec", ["tpu", "cuda:x", "cuda:", "cuda:-1", "cpu:0", "mps:1", "", "AUTO", " cpu"])
async def test_invalid_specs_name_the_valid_forms(spec: str) -> None:
    registry = await registry_of(FixedProfileBackend("cpu", "cpu", cpu_profile()))
    with pytest.raises(BackendSelectionError) as caught:
        await select_backend(registry, spec, None)
    message = str(caught.value)
    assert repr(spec) in message
    assert "auto, cpu, cuda, cuda:N" in message and "mps" in message


async def test_selecting_cpu_initializes_the_real_backend(restore_torch_threads: None) -> None:
    registry = await create_default_registry()
    backend, device = await select_backend(registry, "cpu", None)
    assert (backend.name, device) == ("cpu", "cpu")
    assert backend.status().ready and backend.status().active_devices == ("cpu",)


async def test_auto_on_this_machine_picks_the_best_registered_backend(restore_torch_threads: None) -> None:
    registry = await create_default_registry()
    backend, device = await select_backend(registry, "auto", None)
    assert backend is await registry.find_best()
    assert device == backend.default_device() and backend.status().ready


@pytest.mark.parametrize("spec", ["cuda", "cuda:1"])
async def test_asking_for_cuda_without_a_gpu_lists_what_exists(spec: str) -> None:
    registry = await registry_of(CPUBackend())
    with pytest.raises(BackendSelectionError) as caught:
        await select_backend(registry, spec, None)
    message = str(caught.value)
    assert f"backend {spec!r} was requested, but no cuda backend is registered" in message
    assert "Available backends:\n- cpu (kind cpu): devices cpu; dtypes " in message
    assert "float32" in message


async def test_requirements_nobody_meets_name_the_failed_requirement() -> None:
    registry = await registry_of(CPUBackend())
    requirements = BackendRequirements(requires_flash_attention=True)
    with pytest.raises(BackendSelectionError) as caught:
        await select_backend(registry, "auto", requirements)
    message = str(caught.value)
    assert message.startswith("no registered backend meets the requirements (flash attention)")
    assert "- cpu (kind cpu): devices cpu;" in message
    assert "unmet: requires flash attention, not supported" in message
    assert not registry.get("cpu").status().initialized  # nothing was initialized


async def test_explicit_backend_that_misses_a_requirement_explains_why() -> None:
    registry = await registry_of(*profile_backends())
    requirements = BackendRequirements(dtypes=(torch.bfloat16,), min_batch_size=32)
    with pytest.raises(BackendSelectionError) as caught:
        await select_backend(registry, "cpu", requirements)
    message = str(caught.value)
    assert message.startswith(
        "backend 'cpu' was requested, but it does not meet the requirements "
        "(dtypes bfloat16; min batch size 32)"
    )
    assert (
        "- cpu (kind cpu): devices cpu; dtypes float32; unmet: requires dtype bfloat16, supports float32; "
        in message
    )
    assert "requires batch size 32, max batch size is 16" in message
    assert (
        "- cuda (kind cuda): devices cuda:0, cuda:1; dtypes bfloat16, float16, float32, int8; meets all"
        in message
    )


async def test_gpu_index_selection_uses_that_gpu() -> None:
    cuda, mps, cpu = profile_backends()
    registry = await registry_of(cpu, mps, cuda)
    backend, device = await select_backend(registry, "cuda:1", None)
    assert backend is cuda and device == "cuda:1"
    assert cuda.prepared_devices == ["cuda:1"] and cuda.status().active_devices == ("cuda:1",)

    backend, device = await select_backend(registry, "cuda", None)
    assert backend is cuda and device == "cuda:0"

    backend, device = await select_backend(registry, "mps", None)
    assert backend is mps and device == "mps"


async def test_gpu_index_that_does_not_exist_is_an_error() -> None:
    registry = await registry_of(*profile_backends())
    with pytest.raises(BackendSelectionError) as caught:
        await select_backend(registry, "cuda:3", None)
    message = str(caught.value)
    assert "backend 'cuda:3' was requested, but no cuda backend serves it" in message
    assert "devices cuda:0, cuda:1" in message


async def test_auto_honours_a_required_device() -> None:
    cuda, mps, cpu = profile_backends()
    registry = await registry_of(cuda, mps, cpu)
    backend, device = await select_backend(registry, "auto", BackendRequirements(devices=("cuda:1",)))
    assert (backend, device) == (cuda, "cuda:1")
    backend, device = await select_backend(registry, "auto", BackendRequirements(devices=("cpu",)))
    assert (backend, device) == (cpu, "cpu")
    backend, device = await select_backend(registry, "auto", None)
    assert (backend, device) == (cuda, "cuda:0")


async def test_failed_initialization_becomes_a_selection_error() -> None:
    failing = FixedProfileBackend("cuda", "cuda", cuda_profile(), fail_prepare=True)
    registry = await registry_of(failing)
    expected = "backend cuda failed to initialize cuda:0: cuda:0 is on fire"
    with pytest.raises(BackendSelectionError, match=expected) as caught:
        await select_backend(registry, "auto", None)
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert failing.status().last_error == "RuntimeError: cuda:0 is on fire"
    assert not failing.status().ready


async def test_selection_on_an_empty_registry_says_so() -> None:
    with pytest.raises(BackendSelectionError, match="no backends are registered"):
        await select_backend(BackendRegistry(), "auto", None)


# ---------------------------------------------------------------------------------------------
# CUDA and MPS backends from stub facts and a stub device runtime (no GPU needed)
# ---------------------------------------------------------------------------------------------


class StubRuntime:
    """Stands in for torch.cuda / torch.mps on one device: an allocator with live and cached bytes,
    and a log of the device calls made, shared with the test's own events."""

    def __init__(
        self, total_bytes: int = 80 * GIB, used_by_others_bytes: int = 0, log: list[str] | None = None
    ) -> None:
        self.total_bytes = total_bytes
        self.used_by_others_bytes = used_by_others_bytes
        self.live_bytes = 0
        self.cached_bytes = 0
        self.fail_synchronize = False
        self.log: list[str] = [] if log is None else log

    def allocate(self, size: int) -> None:
        self.live_bytes += size

    def free(self, size: int) -> None:  # like torch: freed blocks stay cached until empty_cache()
        self.live_bytes -= size
        self.cached_bytes += size

    def memory_info(self) -> tuple[int, int]:
        held = self.live_bytes + self.cached_bytes
        return self.total_bytes - self.used_by_others_bytes - held, self.total_bytes

    def memory_held(self) -> int:
        return self.live_bytes + self.cached_bytes

    def memory_allocated(self) -> int:
        return self.live_bytes

    def peak_memory_held(self) -> int:
        return self.memory_held()

    def reset_peak_memory(self) -> None:
        self.log.append("reset_peak_memory")

    def synchronize(self) -> None:
        self.log.append("synchronize")
        if self.fail_synchronize:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def empty_cache(self) -> None:
        self.log.append("empty_cache")
        self.cached_bytes = 0

    def make_current(self) -> None:
        pass


def gpu_facts(
    compute_capability: tuple[int, int] = (9, 0),
    index: int = 0,
    flash_attention_built: bool = True,
    flash_sdp_enabled: bool = True,
    triton_available: bool = True,
    flex_attention_available: bool = True,
) -> CudaDeviceFacts:
    return CudaDeviceFacts(
        index=index,
        name=f"Stub GPU sm{compute_capability[0]}{compute_capability[1]}",
        compute_capability=compute_capability,
        total_memory_bytes=80 * GIB,
        multi_processor_count=132,
        flash_attention_built=flash_attention_built,
        flash_sdp_enabled=flash_sdp_enabled,
        triton_available=triton_available,
        flex_attention_available=flex_attention_available,
        cuda_version="12.8",
    )


def stub_gpu(
    compute_capability: tuple[int, int] = (9, 0), index: int = 0, used_by_others_bytes: int = 0
) -> tuple[CUDABackend, StubRuntime]:
    runtime = StubRuntime(used_by_others_bytes=used_by_others_bytes)
    return CUDABackend(gpu_facts(compute_capability, index), runtime), runtime


def stub_mps(bf16_supported: bool = True) -> tuple[MPSBackend, StubRuntime]:
    runtime = StubRuntime(total_bytes=96 * GIB)
    return MPSBackend(MpsDeviceFacts(bf16_supported=bf16_supported, macos_version="15.1"), runtime), runtime


FP8 = {torch.float8_e4m3fn, torch.float8_e5m2}


@pytest.mark.parametrize(
    ("compute_capability", "expected_dtypes", "flash"),
    [
        pytest.param((7, 5), {torch.float32, torch.float16}, False, id="turing-7.5"),
        pytest.param((8, 0), {torch.float32, torch.float16, torch.bfloat16}, True, id="ampere-8.0"),
        pytest.param((8, 6), {torch.float32, torch.float16, torch.bfloat16}, True, id="ampere-8.6"),
        pytest.param((8, 9), {torch.float32, torch.float16, torch.bfloat16} | FP8, True, id="ada-8.9"),
        pytest.param((9, 0), {torch.float32, torch.float16, torch.bfloat16} | FP8, True, id="hopper-9.0"),
    ],
)
def test_cuda_capabilities_follow_the_compute_capability(
    compute_capability: tuple[int, int], expected_dtypes: set[torch.dtype], flash: bool
) -> None:
    backend, _ = stub_gpu(compute_capability, index=2, used_by_others_bytes=30 * GIB)
    capabilities = backend.capabilities()
    assert capabilities.supported_dtypes == expected_dtypes
    assert capabilities.supports_fp16 and not capabilities.supports_int8
    assert capabilities.supports_bf16 == (torch.bfloat16 in expected_dtypes)
    assert capabilities.flash_attention is flash
    assert capabilities.extras["fp8"] == (torch.float8_e4m3fn in expected_dtypes)
    assert capabilities.extras["attention_kernels"] == (
        ("sdpa", "flash", "triton_paged", "flex") if flash else ("sdpa", "triton_paged", "flex")
    )
    assert capabilities.extras["compute_capability"] == compute_capability
    assert capabilities.paged_attention and capabilities.cuda_graphs
    assert capabilities.devices == ("cuda:2",)
    assert (capabilities.total_memory_bytes, capabilities.free_memory_bytes) == (80 * GIB, 50 * GIB)
    assert (capabilities.max_batch_size, capabilities.max_sequence_length) == limits_from_memory(80 * GIB)
    assert capabilities.memory_alignment == 256
    assert (backend.name, backend.kind) == ("cuda:2", "cuda")
    assert backend.version() == f"torch {torch.__version__}, CUDA 12.8"


@pytest.mark.parametrize(
    ("facts", "expected_kernels"),
    [
        pytest.param(
            gpu_facts(flash_sdp_enabled=False), ("sdpa", "triton_paged", "flex"), id="flash-sdp-off"
        ),
        pytest.param(
            gpu_facts(flash_attention_built=False), ("sdpa", "triton_paged", "flex"), id="flash-not-built"
        ),
        pytest.param(gpu_facts(triton_available=False), ("sdpa", "flash"), id="no-triton-no-flex"),
        pytest.param(
            gpu_facts(flex_attention_available=False), ("sdpa", "flash", "triton_paged"), id="no-flex"
        ),
    ],
)
def test_cuda_attention_kernels_need_their_software_too(
    facts: CudaDeviceFacts, expected_kernels: tuple[str, ...]
) -> None:
    capabilities = CUDABackend(facts, StubRuntime()).capabilities()
    assert capabilities.extras["attention_kernels"] == expected_kernels
    assert capabilities.flash_attention == ("flash" in expected_kernels)


@pytest.mark.parametrize(
    ("compute_capability", "requirements", "expected_unmet"),
    [
        pytest.param(
            (7, 5),
            {"dtypes": ["bf16"]},
            ["requires dtype bfloat16, supports float16, float32"],
            id="7.5-refuses-bf16",
        ),
        pytest.param(
            (7, 5),
            {"requires_flash_attention": True},
            ["requires flash attention, not supported"],
            id="7.5-refuses-flash",
        ),
        pytest.param((8, 0), {"dtypes": ["bf16"], "requires_flash_attention": True}, [], id="8.0-bf16-flash"),
        pytest.param(
            (8, 0),
            {"dtypes": ["fp8"]},
            ["requires dtype float8_e4m3fn, supports bfloat16, float16, float32"],
            id="8.0-refuses-fp8",
        ),
        pytest.param((8, 9), {"dtypes": ["fp8", "float8_e5m2"]}, [], id="8.9-fp8"),
        pytest.param(
            (9, 0),
            {"devices": ["cuda:0"]},
            ["requires device cuda:0, has cuda:1"],
            id="other-gpu-refused",
        ),
        pytest.param(
            (9, 0),
            {"devices": ["cuda"], "dtypes": ["bf16", "fp16", "fp8"], "requires_paged_attention": True},
            [],
            id="9.0-everything",
        ),
    ],
)
def test_cuda_backend_requirements_matched_or_refused(
    compute_capability: tuple[int, int], requirements: dict[str, object], expected_unmet: list[str]
) -> None:
    backend, _ = stub_gpu(compute_capability, index=1)
    assert (
        backend.capabilities().unmet_requirements(BackendRequirements.from_mapping(requirements))
        == expected_unmet
    )


def test_mps_capabilities_from_stub_facts() -> None:
    backend, runtime = stub_mps(bf16_supported=True)
    runtime.allocate(6 * GIB)
    capabilities = backend.capabilities()
    assert capabilities.supported_dtypes == {torch.float32, torch.float16, torch.bfloat16}
    assert capabilities.devices == ("mps",)
    assert not capabilities.flash_attention and not capabilities.cuda_graphs and capabilities.paged_attention
    assert capabilities.extras["attention_kernels"] == ("sdpa",)
    assert (capabilities.total_memory_bytes, capabilities.free_memory_bytes) == (96 * GIB, 90 * GIB)
    assert capabilities.memory_alignment == 16_384
    assert backend.status().memory_in_use_bytes == 6 * GIB
    assert (backend.name, backend.kind) == ("mps", "mps")
    assert backend.version() == f"torch {torch.__version__}, MPS, macOS 15.1"

    without_bf16, _ = stub_mps(bf16_supported=False)
    assert without_bf16.capabilities().supported_dtypes == {torch.float32, torch.float16}
    assert without_bf16.capabilities().unmet_requirements(BackendRequirements(dtypes=(torch.bfloat16,))) == [
        "requires dtype bfloat16, supports float16, float32"
    ]


async def test_auto_picks_cuda_then_mps_then_cpu() -> None:
    cpu = FixedProfileBackend("cpu", "cpu", cpu_profile(free_memory_bytes=250 * GIB))
    mps, _ = stub_mps()
    busy_gpu, _ = stub_gpu(index=0, used_by_others_bytes=70 * GIB)
    idle_gpu, idle_runtime = stub_gpu(index=1)
    registry = await registry_of(cpu, mps, busy_gpu, idle_gpu)

    backend, device = await select_backend(registry, "auto", None)
    assert (backend, device) == (idle_gpu, "cuda:1")  # a GPU, and the one with more free memory
    assert idle_runtime.log == []  # initialize read the GPU's memory: no synchronize, no CUDA context
    backend, device = await select_backend(registry, "cuda", None)
    assert (backend, device) == (idle_gpu, "cuda:1")
    backend, device = await select_backend(registry, "cuda:0", None)
    assert (backend, device) == (busy_gpu, "cuda:0")
    backend, _ = await select_backend(registry, "auto", BackendRequirements(dtypes=(torch.float8_e4m3fn,)))
    assert backend is idle_gpu

    await registry.unregister("cuda:0")
    await registry.unregister("cuda:1")
    backend, device = await select_backend(registry, "auto", None)
    assert (backend, device) == (mps, "mps") and mps.status().ready
    await registry.unregister("mps")
    backend, device = await select_backend(registry, "auto", None)
    assert (backend, device) == (cpu, "cpu")


async def test_mps_selection_and_refusal_from_stub() -> None:
    mps, runtime = stub_mps(bf16_supported=False)
    registry = await registry_of(FixedProfileBackend("cpu", "cpu", cpu_profile()), mps)
    backend, device = await select_backend(registry, "mps", None)
    assert (backend, device) == (mps, "mps") and runtime.log == []
    with pytest.raises(BackendSelectionError) as caught:
        await select_backend(registry, "mps", BackendRequirements(requires_flash_attention=True))
    message = str(caught.value)
    assert "backend 'mps' was requested, but it does not meet the requirements (flash attention)" in message
    assert (
        "- mps (kind mps): devices mps; dtypes float16, float32; unmet: requires flash attention" in message
    )


def stub_cuda_module_facts(
    monkeypatch: pytest.MonkeyPatch, device_count: int, broken: int | None = None
) -> None:
    """Makes ferrum.backends.cuda see `device_count` stub GPUs (cuda:N with N * 10 GiB in use by
    others); probing GPU `broken` raises as a lost device would."""

    def probe(index: int) -> CudaDeviceFacts:
        if index == broken:
            raise RuntimeError("CUDA error: unknown error")
        return gpu_facts((8, 0), index)

    monkeypatch.setattr(torch.version, "cuda", "12.8")  # a CUDA build of torch
    monkeypatch.setattr(cuda_module.Nvml, "load", classmethod(lambda cls: None))  # NVML absent: torch probes
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: device_count)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    monkeypatch.setattr(cuda_module, "probe_cuda_device", probe)
    monkeypatch.setattr(
        cuda_module, "TorchCudaRuntime", lambda index: StubRuntime(used_by_others_bytes=index * 10 * GIB)
    )


async def test_one_cuda_backend_per_visible_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    stub_cuda_module_facts(monkeypatch, device_count=3)
    registry = await create_default_registry()
    assert registry.names() == ["cpu", "cuda:0", "cuda:1", "cuda:2"]
    for index in range(3):
        backend = registry.get(f"cuda:{index}")
        assert isinstance(backend, CUDABackend) and backend.capabilities().devices == (f"cuda:{index}",)
    backend, device = await select_backend(registry, "cuda:2", None)
    assert (backend.name, device) == ("cuda:2", "cuda:2")
    backend, device = await select_backend(registry, "auto", None)
    assert (backend.name, device) == ("cuda:0", "cuda:0")  # the most free memory
    with pytest.raises(BackendSelectionError, match="no cuda backend serves it"):
        await select_backend(registry, "cuda:3", None)


async def test_a_gpu_that_fails_its_probe_is_left_out(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    stub_cuda_module_facts(monkeypatch, device_count=3, broken=1)
    with caplog.at_level(logging.ERROR, logger=cuda_module.__name__):
        registry = await create_default_registry()
    assert registry.names() == ["cpu", "cuda:0", "cuda:2"]
    assert [record.getMessage() for record in caplog.records] == ["could not probe cuda:1; leaving it out"]


async def test_default_registry_registers_mps_when_present(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(mps_module, "probe_mps_device", lambda: MpsDeviceFacts(True, "15.1"))
    monkeypatch.setattr(mps_module, "TorchMpsRuntime", StubRuntime)
    registry = await create_default_registry()
    assert registry.names() == ["cpu", "mps"]
    assert await registry.find_best() is registry.get("mps")


def test_module_imports_probe() -> None:
    assert cuda_module.module_imports("json")
    assert not cuda_module.module_imports("ferrum_no_such_module")


# ---------------------------------------------------------------------------------------------
# Release hooks: shutdown and release_device free what an engine holds on a device
# ---------------------------------------------------------------------------------------------


class DeviceState:
    """What an engine keeps on a device (weights, KV cache, graphs), with a hook that frees it."""

    def __init__(self, runtime: StubRuntime, label: str, size: int) -> None:
        self.runtime, self.label, self.size = runtime, label, size
        self.held = True
        runtime.allocate(size)

    def release(self) -> None:
        self.runtime.log.append(f"release {self.label}")
        self.runtime.free(self.size)
        self.held = False


async def test_shutdown_runs_the_hooks_then_empties_the_cache() -> None:
    backend, runtime = stub_gpu()
    await backend.initialize("cuda")
    runtime.log.clear()
    assert backend.status().memory_in_use_bytes == 0
    weights = DeviceState(runtime, "weights", 2 * GIB)
    kv_cache = DeviceState(runtime, "kv cache", 6 * GIB)
    backend.add_release_hook("cuda", weights.release)  # "cuda" means this backend's GPU, cuda:0
    backend.add_release_hook("cuda:0", kv_cache.release)
    assert backend.release_hook_count("cuda:0") == backend.release_hook_count() == 2
    assert backend.status().memory_in_use_bytes == 8 * GIB
    assert backend.capabilities().free_memory_bytes == 72 * GIB

    await backend.shutdown()
    assert runtime.log == ["synchronize", "release kv cache", "release weights", "empty_cache"]
    assert not weights.held and not kv_cache.held
    status = backend.status()
    assert status.memory_in_use_bytes == 0 and not status.ready and status.active_devices == ()
    assert status.last_error is None
    assert backend.release_hook_count() == 0

    runtime.log.clear()
    await backend.shutdown()  # hooks run once: a second shutdown only empties the cache
    assert runtime.log == ["empty_cache"]


async def test_a_failing_hook_is_reported_and_the_rest_still_run() -> None:
    backend, runtime = stub_gpu()
    await backend.initialize("cuda:0")
    runtime.log.clear()
    kv_cache = DeviceState(runtime, "kv cache", GIB)

    def broken_graphs() -> None:
        raise RuntimeError("graph pool still in use")

    backend.add_release_hook("cuda:0", kv_cache.release)
    backend.add_release_hook("cuda:0", broken_graphs)
    with pytest.raises(BackendReleaseError) as caught:
        await backend.shutdown()
    assert str(caught.value) == (
        "backend cuda:0 did not release cleanly: cuda:0: hook "
        "test_a_failing_hook_is_reported_and_the_rest_still_run.<locals>.broken_graphs raised "
        "RuntimeError: graph pool still in use"
    )
    assert isinstance(caught.value.__cause__, RuntimeError)
    assert [failure.step.split(".")[-1] for failure in caught.value.failures] == ["broken_graphs"]
    assert runtime.log == ["synchronize", "release kv cache", "empty_cache"]
    status = backend.status()
    assert status.last_error == "RuntimeError: graph pool still in use"
    assert status.memory_in_use_bytes == 0 and not status.ready


async def test_a_failing_synchronize_is_reported_and_the_hooks_still_run() -> None:
    backend, runtime = stub_gpu()
    await backend.initialize("cuda:0")
    kv_cache = DeviceState(runtime, "kv cache", GIB)
    backend.add_release_hook("cuda:0", kv_cache.release)
    runtime.fail_synchronize = True
    with pytest.raises(BackendReleaseError, match="cuda:0: synchronize raised RuntimeError: CUDA error"):
        await backend.shutdown()
    assert not kv_cache.held and backend.status().memory_in_use_bytes == 0


async def test_a_removed_hook_is_not_called() -> None:
    backend, runtime = stub_gpu()
    kept = DeviceState(runtime, "kept", GIB)
    dropped = DeviceState(runtime, "dropped", GIB)
    backend.add_release_hook("cuda:0", kept.release)
    remove = backend.add_release_hook("cuda:0", dropped.release)
    remove()
    remove()  # a second call changes nothing
    assert backend.release_hook_count() == 1
    await backend.shutdown()
    assert not kept.held and dropped.held


async def test_hooks_only_for_devices_the_backend_serves() -> None:
    backend, _ = stub_gpu(index=1)
    for device in ("cuda:0", "mps", "cpu"):
        with pytest.raises(ValueError, match=f"does not serve device '{device}'"):
            backend.add_release_hook(device, lambda: None)
    with pytest.raises(ValueError, match="does not serve device 'cuda:0'"):
        await backend.release_device("cuda:0")
    with pytest.raises(ValueError, match="does not serve device 'cuda:0'"):
        await backend.synchronize("cuda:0")


async def test_release_device_frees_one_device_only() -> None:
    backend = FixedProfileBackend("two-gpus", "cuda", cuda_profile())
    await backend.initialize("cuda:0")
    await backend.initialize("cuda:1")
    released: list[str] = []
    backend.add_release_hook("cuda:0", lambda: released.append("cuda:0"))
    backend.add_release_hook("cuda:1", lambda: released.append("cuda:1"))
    await backend.release_device("cuda:1")
    assert released == ["cuda:1"]
    assert backend.status().active_devices == ("cuda:0",) and backend.status().ready
    await backend.shutdown()
    assert released == ["cuda:1", "cuda:0"] and not backend.status().ready


async def test_mps_shutdown_frees_through_its_runtime() -> None:
    backend, runtime = stub_mps()
    await backend.initialize("mps")
    runtime.log.clear()
    kv_cache = DeviceState(runtime, "kv cache", 4 * GIB)
    backend.add_release_hook("mps", kv_cache.release)
    assert backend.status().memory_in_use_bytes == 4 * GIB
    await backend.shutdown()
    assert runtime.log == ["synchronize", "release kv cache", "empty_cache"]
    assert backend.status().memory_in_use_bytes == 0


async def test_cpu_backend_runs_release_hooks_too(restore_torch_threads: None) -> None:
    backend = CPUBackend()
    await backend.initialize("cpu")
    released: list[str] = []
    backend.add_release_hook("cpu", lambda: released.append("model"))
    await backend.shutdown()
    assert released == ["model"] and not backend.status().ready


# ---------------------------------------------------------------------------------------------
# Quantization: the methods each backend runs, requirements that narrow the choice, and the
# served model's method checked against the device picked
# ---------------------------------------------------------------------------------------------


def test_each_backend_reports_the_quantization_methods_it_runs() -> None:
    assert CPUBackend().capabilities().quantization == {"int8", "int4", "fp8"}
    mps, _ = stub_mps()
    assert mps.capabilities().quantization == frozenset()
    ampere, _ = stub_gpu((8, 0), index=1)
    capabilities = ampere.capabilities()
    assert capabilities.quantization == {"int8", "int4"}
    assert capabilities.quantization_needs == {
        "fp8": "fp8 needs compute capability 8.9; cuda:1 (Stub GPU sm80) has 8.0"
    }
    for cc in ((8, 9), (9, 0)):
        gpu, _ = stub_gpu(cc)
        assert gpu.capabilities().quantization == {"int8", "int4", "fp8"} and not gpu.capabilities().quantization_needs


def test_quantization_requirements_parse_and_name_the_shortfall() -> None:
    assert BackendRequirements.from_mapping({"quantization": "INT4"}).quantization == ("int4",)
    assert BackendRequirements.from_mapping({"quantization": ["int8", "fp8", "int8"]}).quantization == ("int8", "fp8")
    with pytest.raises(ValueError, match="'quantization'"):
        BackendRequirements.from_mapping({"quantization": [4]})
    ampere, _ = stub_gpu((8, 0))
    assert ampere.capabilities().unmet_requirements(BackendRequirements(quantization=("int4", "fp8"))) == [
        "requires quantization fp8: fp8 needs compute capability 8.9; cuda:0 (Stub GPU sm80) has 8.0"
    ]
    only_int8 = dataclasses.replace(cpu_profile(), quantization=frozenset({"int8"}))
    assert only_int8.unmet_requirements(BackendRequirements(quantization=("int4",))) == [
        "requires quantization int4, runs int8"
    ]


async def test_a_quantization_requirement_narrows_the_choice() -> None:
    ampere, _ = stub_gpu((8, 0))
    cpu = FixedProfileBackend("cpu", "cpu", dataclasses.replace(cpu_profile(), quantization=frozenset({"int8"})))
    registry = await registry_of(cpu, ampere)
    assert await registry.find_best(BackendRequirements(quantization=("int4",))) is ampere
    assert await registry.find_best(BackendRequirements(quantization=("fp8",))) is None
    with pytest.raises(BackendSelectionError) as caught:
        await select_backend(registry, "auto", BackendRequirements(quantization=("fp8",)))
    message = str(caught.value)
    assert message.startswith("no registered backend meets the requirements (quantization fp8)")
    assert "unmet: requires quantization fp8: fp8 needs compute capability 8.9; cuda:0 (Stub GPU sm80)" in message
    assert "unmet: requires quantization fp8, runs int8" in message


async def test_the_served_method_must_run_on_the_device_picked() -> None:
    ampere, runtime = stub_gpu((8, 0))
    cpu = CPUBackend()  # runs fp8 (emulated), but auto does not fall back to it for the GPU's sake
    registry = await registry_of(cpu, ampere)
    with pytest.raises(BackendSelectionError) as caught:
        await select_backend(registry, "auto", None, quantization="fp8")
    assert str(caught.value).startswith(
        "quantization fp8 cannot run on cuda:0: fp8 needs compute capability 8.9; cuda:0 (Stub GPU sm80) has 8.0. "
        "Quantization methods cuda:0 runs: int4, int8"
    )
    assert not ampere.status().initialized
    backend, device = await select_backend(registry, "auto", None, quantization="int4")
    assert (backend, device) == (ampere, "cuda:0")
    mps, _ = stub_mps()
    registry = await registry_of(mps)
    with pytest.raises(BackendSelectionError, match="quantization int8 cannot run on mps: quantized weights are not"):
        await select_backend(registry, "mps", None, quantization="int8")
