"""The `Device` each backend hands out (the one source of hardware facts), and probing GPUs through
NVML without a CUDA context: a stand-in `pynvml` module here, the real one on a GPU machine."""

from __future__ import annotations

import dataclasses
import os
from types import ModuleType, SimpleNamespace
from typing import cast

import pytest
import torch

from ferrum.backends import cuda as cuda_module
from ferrum.backends.cpu import CPUBackend, has_native_bf16, read_cpu_flags
from ferrum.backends.cuda import CUDABackend, CudaDeviceFacts, create_backends, nvml_facts
from ferrum.backends.device import Device
from ferrum.backends.mps import MPSBackend, MpsDeviceFacts
from ferrum.backends.nvml import Nvml
from ferrum.engine.config import EngineConfig
from tests.backends.test_backends import GIB, StubRuntime, gpu_facts

# -- the CPU -------------------------------------------------------------------------------------


def test_cpu_device_is_probed_once_with_the_facts_the_engine_uses() -> None:
    backend = CPUBackend()
    device = backend.device()
    assert device is backend.device("cpu")  # probed once
    assert (device.name, device.kind, device.torch_device) == ("cpu", "cpu", torch.device("cpu"))
    assert device.total_memory_bytes > 0 and 0 < device.free_memory_bytes() <= device.total_memory_bytes
    assert device.multi_processor_count == backend.core_count
    assert not (device.triton or device.cuda_graphs or device.pdl or device.fp8)
    native = has_native_bf16(read_cpu_flags())
    assert device.packed_bf16_linears == native
    assert device.preferred_dtype == (torch.bfloat16 if native else torch.float32)
    assert torch.float32 in device.dtypes
    assert device.description.endswith(f"({backend.core_count} cores)")
    with pytest.raises(ValueError, match="does not serve"):
        backend.device("cuda:0")


def test_auto_dtype_follows_the_device() -> None:
    cpu = CPUBackend().device()
    fp32_cpu = dataclasses.replace(cpu, preferred_dtype=torch.float32, packed_bf16_linears=False)
    bf16_cpu = dataclasses.replace(cpu, dtypes=cpu.dtypes | {torch.bfloat16}, preferred_dtype=torch.bfloat16)
    config = EngineConfig()
    assert config.serving_dtype(torch.bfloat16, fp32_cpu) == torch.float32  # no bf16 units: float32
    assert config.serving_dtype(torch.float32, bf16_cpu) == torch.bfloat16
    gpu = stub_cuda_device((9, 0))
    assert config.serving_dtype(torch.float16, gpu) == torch.float16  # the checkpoint's half precision
    assert config.serving_dtype(torch.float32, gpu) == torch.bfloat16
    assert config.serving_dtype(torch.bfloat16, stub_cuda_device((7, 5))) == torch.float16  # no bf16 there
    assert EngineConfig(dtype="fp32").serving_dtype(torch.bfloat16, gpu) == torch.float32
    with pytest.raises(ValueError, match="dtype must be auto"):
        EngineConfig(dtype="int8")


def test_batch_defaults_follow_the_device() -> None:
    cpu = CPUBackend().device()
    on_cpu = EngineConfig().for_device(cpu)
    assert (on_cpu.max_num_seqs, on_cpu.max_num_batched_tokens) == (64, 1024)
    gpu = EngineConfig().for_device(stub_cuda_device((9, 0)))
    assert (gpu.max_num_seqs, gpu.max_num_batched_tokens) == (256, 8192)


# -- CUDA, from stub facts ------------------------------------------------------------------------------


def stub_cuda_device(cc: tuple[int, int], triton: bool = True) -> Device:
    facts = dataclasses.replace(gpu_facts(cc), triton_available=triton)
    return CUDABackend(facts, StubRuntime()).device()


@pytest.mark.parametrize(
    ("cc", "triton", "pdl", "fp8", "preferred"),
    [
        ((9, 0), True, True, True, torch.bfloat16),
        ((9, 0), False, False, True, torch.bfloat16),  # PDL is used by the Triton kernels only
        ((8, 9), True, False, True, torch.bfloat16),
        ((8, 0), True, False, False, torch.bfloat16),
        ((7, 5), True, False, False, torch.float16),
    ],
)
def test_cuda_device_facts_follow_the_compute_capability(
    cc: tuple[int, int], triton: bool, pdl: bool, fp8: bool, preferred: torch.dtype
) -> None:
    device = stub_cuda_device(cc, triton)
    assert (device.kind, device.name, device.compute_capability) == ("cuda", "cuda:0", cc)
    assert (device.pdl, device.fp8, device.triton, device.cuda_graphs) == (pdl, fp8, triton, True)
    assert device.preferred_dtype == preferred and device.multi_processor_count == 132
    assert device.total_memory_bytes == 80 * GIB and device.is_accelerator
    assert "SMs" in device.summary()


def test_a_gpu_probed_through_nvml_is_probed_by_torch_only_when_its_device_is_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NVML gives no multiprocessor count: the Device's probe (where the engine runs) asks torch."""
    facts = dataclasses.replace(gpu_facts(), multi_processor_count=None)
    probes: list[int] = []

    def probe(index: int) -> CudaDeviceFacts:
        probes.append(index)
        return dataclasses.replace(gpu_facts(), multi_processor_count=114, name="probed")

    monkeypatch.setattr(cuda_module, "probe_cuda_device", probe)
    backend = CUDABackend(facts, StubRuntime())
    assert backend.capabilities().devices == ("cuda:0",) and probes == []  # selection needs no probe
    device = backend.device()
    assert probes == [0] and device.multi_processor_count == 114 and device.description == "probed"
    assert backend.device() is device and probes == [0]


def test_the_facts_tensor_parallelism_and_the_memory_plan_read(monkeypatch: pytest.MonkeyPatch) -> None:
    """Peer access, the collective backend, the host threads and whether memory is the device's own
    are probed by the backends: the engine reads them off the Device."""
    cpu_backend = CPUBackend()
    cpu = cpu_backend.device()
    assert (cpu.collective, cpu.threads, cpu.dedicated_memory, cpu.peers) == ("gloo", cpu_backend.core_count,
                                                                              False, ())
    facts = dataclasses.replace(gpu_facts(), nccl_available=True, peers=(1, 3))
    gpu = CUDABackend(facts, StubRuntime()).device()
    assert (gpu.collective, gpu.threads, gpu.dedicated_memory) == ("nccl", 0, True)
    assert gpu.peers == ("cuda:1", "cuda:3")
    assert "peers cuda:1, cuda:3" in gpu.summary()
    jetson = CUDABackend(dataclasses.replace(gpu_facts(), integrated=True), StubRuntime()).device()
    assert (jetson.collective, jetson.dedicated_memory) == (None, False)  # no NCCL in that torch: no ranks
    # a GPU probed through NVML has its peers and memory kind probed by torch with the rest
    probed = dataclasses.replace(gpu_facts(), peers=(2,), integrated=True)
    monkeypatch.setattr(cuda_module, "probe_cuda_device", lambda index: probed)
    late = CUDABackend(dataclasses.replace(gpu_facts(), multi_processor_count=None), StubRuntime()).device()
    assert (late.peers, late.dedicated_memory) == (("cuda:2",), False)


async def test_initialising_a_gpu_turns_nvlink_multicast_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", raising=False)
    await CUDABackend(gpu_facts(), StubRuntime()).initialize("cuda:0")
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "1"
    monkeypatch.setenv("TORCH_SYMM_MEM_DISABLE_MULTICAST", "0")  # a setting of the user's is kept
    await CUDABackend(gpu_facts(), StubRuntime()).initialize("cuda:0")
    assert os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] == "0"


def test_mps_device() -> None:
    backend = MPSBackend(MpsDeviceFacts(bf16_supported=False, macos_version="15.1"), StubRuntime(total_bytes=96 * GIB))
    device = backend.device()
    assert (device.kind, device.name, device.preferred_dtype) == ("mps", "mps", torch.float16)
    assert device.total_memory_bytes == 96 * GIB and not device.triton and not device.cuda_graphs
    assert (device.collective, device.threads, device.dedicated_memory) == (None, 0, False)


# -- NVML, without a CUDA context ----------------------------------------------------------------------


class FakeNvml:
    """pynvml as NVML answers for three GPUs (their memory, names, compute capabilities)."""

    def __init__(self, uuids: list[str], fail_init: bool = False) -> None:
        self.uuids = uuids
        self.fail_init = fail_init
        self.calls: list[str] = []

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.fail_init:
            raise RuntimeError("NVML Shared Library Not Found")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        return self.uuids[handle].encode()

    def nvmlDeviceGetName(self, handle: int) -> str:
        return f"GPU {handle}"

    def nvmlDeviceGetCudaComputeCapability(self, handle: int) -> tuple[int, int]:
        return (9, 0) if handle else (8, 0)

    def nvmlDeviceGetMemoryInfo(self, handle: int) -> SimpleNamespace:
        return SimpleNamespace(total=(handle + 1) * 10 * GIB, free=(handle + 1) * 4 * GIB)

    def nvmlDeviceGetComputeRunningProcesses(self, handle: int) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=42, usedGpuMemory=GIB)]


UUIDS = ["GPU-aaaa-1111", "GPU-bbbb-2222", "GPU-cccc-3333"]


@pytest.mark.parametrize(
    ("visible", "physical"),
    [
        (None, [0, 1, 2]),
        ("2,0", [2, 0]),
        ("GPU-cccc,1", [2, 1]),
        ("1,7,0", [1]),  # CUDA stops at the first entry that names no GPU
        ("1,1", [1]),  # ... or one named twice
        ("", []),
        ("GPU-zzzz", []),
        ("MIG-1234", []),
    ],
)
def test_nvml_honours_cuda_visible_devices(visible: str | None, physical: list[int]) -> None:
    nvml = Nvml(FakeNvml(UUIDS))  # type: ignore[arg-type]
    environ = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    gpus = nvml.visible_gpus(environ)
    assert [gpu.uuid for gpu in gpus] == [UUIDS[i] for i in physical]
    assert [gpu.ordinal for gpu in gpus] == list(range(len(physical)))  # CUDA renumbers them
    for gpu, index in zip(gpus, physical, strict=True):
        assert gpu.name == f"GPU {index}" and gpu.total_memory_bytes == (index + 1) * 10 * GIB
    if gpus:
        assert nvml.memory_info(gpus[0].handle) == ((physical[0] + 1) * 4 * GIB, (physical[0] + 1) * 10 * GIB)
        assert nvml.process_memory(gpus[0].handle) == {42: GIB}


def test_registry_probes_gpus_through_nvml_and_never_through_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """With NVML, building the CUDA backends and selecting one touches no torch.cuda call that
    would create a CUDA context; capabilities carry NVML's memory figures."""
    fake = FakeNvml(UUIDS)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(cuda_module.Nvml, "load", classmethod(lambda cls: Nvml(fake)))  # type: ignore[arg-type]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,2")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)

    def forbidden(*args: object, **kwargs: object) -> None:
        raise AssertionError("a torch.cuda probe was made")

    for name in ("get_device_properties", "mem_get_info", "device_count", "is_available", "synchronize"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    backends = create_backends()
    assert [b.name for b in backends] == ["cuda:0", "cuda:1"]
    caps = backends[0].capabilities()
    assert (caps.total_memory_bytes, caps.free_memory_bytes) == (20 * GIB, 8 * GIB)
    assert caps.extras["compute_capability"] == (9, 0) and caps.extras["device_name"] == "GPU 1"
    assert backends[1].capabilities().extras["device_name"] == "GPU 2"
    gpu = Nvml(cast(ModuleType, fake)).visible_gpus({"CUDA_VISIBLE_DEVICES": "0"})[0]
    assert nvml_facts(gpu).multi_processor_count is None


def test_without_nvml_the_registry_probes_through_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(cuda_module.Nvml, "load", classmethod(lambda cls: None))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(cuda_module, "probe_cuda_device", lambda index: gpu_facts(index=index))
    monkeypatch.setattr(cuda_module, "TorchCudaRuntime", lambda index, *a: StubRuntime())
    assert [b.name for b in create_backends()] == ["cuda:0"]


def test_a_cpu_build_of_torch_has_no_cuda_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(cuda_module.Nvml, "load", classmethod(lambda cls: pytest.fail("NVML was loaded")))
    assert create_backends() == []


def test_nvml_that_fails_to_start_is_not_used() -> None:
    fake = FakeNvml(UUIDS, fail_init=True)
    nvml = Nvml(fake)  # type: ignore[arg-type]
    assert not nvml._init() and fake.calls == ["init"]
