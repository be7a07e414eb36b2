"""The CUDA backend on a real GPU: the probe, what status() reports, synchronize, and release hooks
that give the memory back. Skipped where torch sees no GPU; tests/backends/test_backends.py covers the same
backend from stub facts on any machine."""

from __future__ import annotations

import gc
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from ferrum.backends.cuda import CUDABackend, probe_cuda_device
from ferrum.backends.registry import create_default_registry
from ferrum.backends.selection import select_backend

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

MIB = 1024**2
DEVICE = "cuda:0"


@pytest.fixture
def gpu() -> CUDABackend:
    """A CUDABackend for GPU 0, its allocator's cache emptied so memory figures start clean."""
    torch.cuda.synchronize(0)
    torch.cuda.empty_cache()
    return CUDABackend(probe_cuda_device(0))


def test_the_probe_reads_the_real_gpu(gpu: CUDABackend) -> None:
    facts = gpu.facts
    properties = torch.cuda.get_device_properties(0)
    assert facts.name == torch.cuda.get_device_name(0) and facts.name
    assert facts.compute_capability == torch.cuda.get_device_capability(0)
    assert facts.total_memory_bytes == properties.total_memory > 0
    assert facts.multi_processor_count == properties.multi_processor_count > 0
    assert facts.cuda_version == torch.version.cuda

    capabilities = gpu.capabilities()
    free_bytes, total_bytes = torch.cuda.mem_get_info(0)
    assert capabilities.devices == (DEVICE,) and gpu.name == DEVICE and gpu.kind == "cuda"
    assert capabilities.total_memory_bytes == total_bytes
    assert 0 < capabilities.free_memory_bytes <= total_bytes
    assert abs(capabilities.free_memory_bytes - free_bytes) < 512 * MIB  # other processes may allocate
    assert capabilities.cuda_graphs and capabilities.paged_attention
    assert capabilities.supports_fp16 and torch.float32 in capabilities.supported_dtypes
    assert capabilities.supports_bf16 == torch.cuda.is_bf16_supported(including_emulation=False)
    assert (torch.float8_e4m3fn in capabilities.supported_dtypes) == (facts.compute_capability >= (8, 9))
    assert capabilities.extras["device_name"] == facts.name
    assert gpu.version() == f"torch {torch.__version__}, CUDA {torch.version.cuda}"


def test_every_claimed_dtype_computes_on_the_gpu(gpu: CUDABackend) -> None:
    dtypes = gpu.capabilities().supported_dtypes
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        if dtype in dtypes:
            matrix = torch.full((16, 16), 2, dtype=dtype, device=DEVICE)
            assert bool(((matrix @ matrix).float() == 64).all()), dtype
    if torch.float8_e4m3fn in dtypes:
        left = torch.ones(16, 32, device=DEVICE).to(torch.float8_e4m3fn)
        right = torch.ones(16, 32, device=DEVICE).to(torch.float8_e4m3fn).t()  # column-major, as required
        scale = torch.tensor(1.0, device=DEVICE)
        product = torch._scaled_mm(left, right, scale_a=scale, scale_b=scale, out_dtype=torch.bfloat16)
        assert bool((product.float() == 32).all())
    if torch.float8_e5m2 in dtypes:
        values = torch.tensor([0.5, 1.0, 2.0, -4.0], device=DEVICE)
        assert torch.equal(values.to(torch.float8_e5m2).float(), values)


def test_claimed_attention_kernels_run(gpu: CUDABackend) -> None:
    capabilities = gpu.capabilities()
    kernels = capabilities.extras["attention_kernels"]
    assert isinstance(kernels, tuple) and kernels[0] == "sdpa"
    assert capabilities.flash_attention == ("flash" in kernels)
    if "flash" in kernels:
        query = torch.randn(1, 2, 16, 64, dtype=torch.float16, device=DEVICE)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):  # only the flash kernel may run
            output = F.scaled_dot_product_attention(query, query, query, is_causal=True)
        assert output.shape == query.shape and bool(torch.isfinite(output).all())
    if "triton_paged" in kernels:
        assert importlib.util.find_spec("triton") is not None


async def test_status_reports_the_memory_a_hook_then_frees(gpu: CUDABackend) -> None:
    await gpu.initialize(DEVICE)
    gc.collect()  # tensors earlier tests dropped, and the blocks torch still caches, are not this test's
    torch.cuda.empty_cache()
    allocated_before = torch.cuda.memory_allocated(0)
    in_use_before = gpu.status().memory_in_use_bytes
    assert in_use_before == torch.cuda.memory_reserved(0)

    held = {"kv_cache": torch.ones(128 * MIB, dtype=torch.float16, device=DEVICE)}  # 256 MiB
    assert gpu.status().memory_in_use_bytes >= in_use_before + 256 * MIB
    gpu.add_release_hook(DEVICE, held.clear)

    await gpu.shutdown()
    assert held == {}
    assert torch.cuda.memory_allocated(0) <= allocated_before  # the held 256 MiB are gone
    assert gpu.status().memory_in_use_bytes <= in_use_before  # and handed back to the driver
    assert not gpu.status().ready and gpu.status().last_error is None


async def test_release_device_frees_a_captured_cuda_graph(gpu: CUDABackend) -> None:
    await gpu.initialize(DEVICE)
    gc.collect()  # tensors earlier tests dropped, and the blocks torch still caches, are not this test's
    torch.cuda.empty_cache()
    allocated_before = torch.cuda.memory_allocated(0)
    reserved_before = torch.cuda.memory_reserved(0)

    with torch.cuda.device(0):
        static_input = torch.zeros(16 * MIB, device=DEVICE)  # 64 MiB
        side_stream = torch.cuda.Stream()
        side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side_stream):  # warm up off the default stream, as capture requires
            static_output = static_input * 2 + 1
        torch.cuda.current_stream().wait_stream(side_stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_output = static_input * 2 + 1
        static_input.fill_(1.0)
        graph.replay()
    torch.cuda.synchronize(0)
    assert static_output[0].item() == 3.0
    held = {"graph": graph, "input": static_input, "output": static_output}
    del graph, static_input, static_output, side_stream
    assert torch.cuda.memory_reserved(0) > reserved_before
    gpu.add_release_hook(DEVICE, held.clear)

    await gpu.release_device(DEVICE)
    assert held == {}
    assert torch.cuda.memory_allocated(0) <= allocated_before  # the held 256 MiB are gone
    assert torch.cuda.memory_reserved(0) == reserved_before
    assert gpu.status().active_devices == ()


async def test_synchronize_waits_for_queued_work(gpu: CUDABackend) -> None:
    await gpu.initialize(DEVICE)
    stream = torch.cuda.current_stream(0)
    with torch.cuda.device(0):
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU time, queued asynchronously
    assert not stream.query()
    await gpu.synchronize(DEVICE)
    assert stream.query()
    with pytest.raises(ValueError, match="does not serve device"):
        await gpu.synchronize(f"cuda:{torch.cuda.device_count()}")


async def test_default_registry_holds_every_gpu_and_auto_picks_one() -> None:
    registry = await create_default_registry()
    gpu_names = [f"cuda:{index}" for index in range(torch.cuda.device_count())]
    assert registry.names()[0] == "cpu"
    assert [name for name in registry.names() if name.startswith("cuda")] == gpu_names
    try:
        backend, device = await select_backend(registry, "auto", None)
        assert backend.kind == "cuda" and device == backend.name and backend.status().ready
        backend, device = await select_backend(registry, "cuda:0", None)
        assert (backend, device) == (registry.get("cuda:0"), "cuda:0")
        assert backend.status().memory_in_use_bytes == torch.cuda.memory_reserved(0)
    finally:
        for name in gpu_names:
            await registry.get(name).shutdown()


SELECT_WITHOUT_A_CONTEXT = """
import asyncio, os, torch
from ferrum.backends.registry import create_default_registry
from ferrum.backends.selection import select_backend
from ferrum.backends.nvml import Nvml

async def main():
    registry = await create_default_registry()
    backend, device = await select_backend(registry, "cuda")
    caps = backend.capabilities()
    await backend.shutdown()
    nvml = Nvml.load()
    gpu = nvml.visible_gpus()[0]
    held = os.getpid() in nvml.process_memory(gpu.handle)
    print(device, caps.free_memory_bytes > 0, torch.cuda.is_initialized(), held)

asyncio.run(main())
"""


def test_selecting_a_gpu_opens_no_cuda_context() -> None:
    """The API server selects and shuts down its backend through NVML: no CUDA context in its
    process (the engine process opens the only one)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", SELECT_WITHOUT_A_CONTEXT], cwd=root, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["cuda:0", "True", "False", "False"]


def test_nvml_facts_agree_with_torch() -> None:
    from ferrum.backends.cuda import nvml_facts
    from ferrum.backends.nvml import Nvml

    nvml = Nvml.load()
    assert nvml is not None, "nvidia-ml-py and the driver's NVML are there on a GPU machine"
    facts = nvml_facts(nvml.visible_gpus()[0])
    probed = probe_cuda_device(0)
    assert (facts.name, facts.compute_capability) == (probed.name, probed.compute_capability)
    assert abs(facts.total_memory_bytes - probed.total_memory_bytes) < 1024 * MIB  # NVML counts reserved memory
    device = CUDABackend(facts).device()  # the multiprocessor count from torch, where the engine runs
    assert device.multi_processor_count == probed.multi_processor_count and device.name == DEVICE
