"""One rank's model on its device: the model (or its tensor-parallel shard) built and filled
through the WeightLoader, its KV cache planned, and the runner around both.

The engine builds one `ModelRank` for itself; under tensor parallelism every rank builds one the
same way, step for step (ferrum.engine.parallel.rank), so that the collectives of the profile and of
CUDA graph capture meet in the same order on every rank. `agree_blocks` makes the ranks settle on
one KV cache size (the smallest any rank can hold).

`runner_for` picks the runner by the attention backend's type: TorchModelRunner over torch_paged,
GPUModelRunner over triton_paged. Where the device has memory of its own (`Device.dedicated_memory`)
the KV cache is sized by profiling the GPU runner; elsewhere from the host's available memory.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ferrum.backends.device import Device
from ferrum.backends.host_memory import gather_into_huge_pages, huge_pages_offered
from ferrum.engine.auto_quantization import resolve_quantization
from ferrum.engine.block_manager import peak_tokens
from ferrum.engine.config import EngineConfig
from ferrum.engine.kv_calibration import (
    CALIBRATION_TEXT,
    calibration_ids,
    measure_scales,
    reset_scales,
    scales_from_checkpoint,
)
from ferrum.engine.memory_plan import MemoryPlan, in_use_bytes, plan_gpu, plan_host
from ferrum.engine.runner import ModelRunner
from ferrum.engine.sampler import sample
from ferrum.engine.sampling_params import SamplingParams
from ferrum.engine.scheduler import ScheduledSequence
from ferrum.engine.sequence import Sequence
from ferrum.engine.startup import StartupProgress
from ferrum.engine.torch_runner import TorchModelRunner
from ferrum.kernels.config import KernelConfig
from ferrum.models.attention import AttentionBackend, select_attention
from ferrum.models.attention.cpu_paged import CpuPagedAttention
from ferrum.models.attention.layout import KVCacheLayout
from ferrum.models.attention.torch_paged import TorchPagedAttention
from ferrum.models.config import ModelConfig
from ferrum.models.layers import layer_ops
from ferrum.models.layers.int8_head import Int8Head, int8_head_fits
from ferrum.models.layers.parallel import ShardPlan, TensorParallel
from ferrum.models.llama import LlamaForCausalLM
from ferrum.models.loader import WeightLoadReport, load_model, run_sync
from ferrum.tokenizer import Tokenizer
from ferrum.weights.loader import WeightLoader
from ferrum.weights.locations.model_files import ModelFiles
from ferrum.weights.spec.loader_config import WeightLoaderConfig

if TYPE_CHECKING:
    from ferrum.engine.gpu_runner import GPUModelRunner

log = logging.getLogger(__name__)


class ModelRank:
    def __init__(
        self,
        config: EngineConfig,
        device: Device,
        model_config: ModelConfig,
        files: ModelFiles,
        weights: WeightLoaderConfig,
        dtype: torch.dtype,
        max_model_len: int,
        tp: TensorParallel | None = None,
        report: Callable[[StartupProgress], None] = lambda _: None,
        agree_blocks: Callable[[int], int] = lambda n: n,
    ) -> None:
        """`config` has its device defaults filled in."""
        device.runtime.make_current()  # this thread's kernels launch there (Triton's take no device)
        self.tp = tp or TensorParallel.single()
        self.config, self.device, self.dtype, self.max_model_len = config, device, dtype, max_model_len
        self.shard = ShardPlan(model_config, self.tp.rank, self.tp.size)
        self.model_config = model_config
        self.cpu_kernels = device.kind == "cpu" and config.kernels.cpu and load_cpu_kernels(config.kernels)
        self.quantization = resolve_quantization(config.quantization, device, model_config, self.cpu_kernels, dtype)
        if self.quantization.reason and self.tp.rank == 0:
            log.info("%s", self.quantization.reason)
        auto_kv = self.quantization.kv_dtype if config.kv_cache_dtype == "auto" else None
        kv_dtype = auto_kv or config.kv_dtype(dtype)
        self.layout = KVCacheLayout.of(self.shard.rank_config(), kv_dtype, config.block_size)
        self.attention = select_attention(device, self.layout, config.kernels, self.cpu_kernels, dtype)
        self._report = report
        plan = plan_host(device, self.layout, config) if not device.dedicated_memory else None
        if plan is not None:  # sized before loading, so that a cache too small fails fast
            self.check_fits(plan.num_blocks)
        self.model, self.weight_load = self._load(files, weights)
        if self.quantization.int8_head and self.tp.size == 1 and int8_head_fits(self.model.lm_head):
            self.model.lm_head = Int8Head(self.model.lm_head)
        if self.cpu_kernels and config.kernels.cpu_huge_pages and huge_pages_offered():
            moved = gather_into_huge_pages(self.model.buffers())  # before any runner takes views of them
            log.info("CPU: %.0f MB of quantized weights and tables in transparent huge pages", moved / 1e6)
        report(StartupProgress("warming"))
        reset_scales(self.model)  # (built empty: its buffers hold whatever the memory held)
        if self.layout.fp8:
            self._fp8_kv_scales(files)
        if plan is None:
            plan = plan_gpu(device, self.layout, config, self._profile)
        self.memory_plan: MemoryPlan = plan
        self.num_blocks = agree_blocks(plan.num_blocks)
        self.check_fits(self.num_blocks)
        self.runner: ModelRunner = self.make_runner(self.num_blocks)
        if device.dedicated_memory:
            used, held = in_use_bytes(device)
            log.info("GPU memory after start-up: %.2f GiB in use on the device (this process's allocator %.2f GiB), "
                     "budget %.2f GiB", used / 2**30, held / 2**30, plan.budget_bytes / 2**30)

    def _load(self, files: ModelFiles, weights: WeightLoaderConfig) -> tuple[LlamaForCausalLM, WeightLoadReport]:
        loader = WeightLoader(weights)
        self._report(StartupProgress("loading"))
        last = [0.0]

        def progress(done: int, total: int) -> None:  # at most a few reports a second
            now = time.monotonic()
            if done >= total or now - last[0] >= 0.25:
                last[0] = now
                self._report(StartupProgress("loading", done, total))

        try:
            return load_model(self.model_config, files.weights, self.device, self.dtype,
                              layer_ops(self.device, self.cpu_kernels), loader, progress, tp=self.tp,
                              quantization=self.quantization.quantization, chosen=self.quantization.reason or None,
                              kernels=self.config.kernels)
        finally:
            run_sync(loader.aclose())

    def _fp8_kv_scales(self, files: ModelFiles) -> None:
        """Each attention layer's fp8 KV-cache scales: the checkpoint's, else measured on a fixed prompt
        run through a scratch runner (every rank runs it: their collectives meet)."""
        if scales_from_checkpoint(self.model):
            log.info("fp8 KV cache: the checkpoint's k and v scales")
            return
        ids = calibration_ids(Tokenizer.from_folder(files.folder).encode(CALIBRATION_TEXT),
                              self.model_config.vocab_size)[: min(self.max_model_len, self.config.tokens_per_step)]
        blocks = self.layout.blocks_for(len(ids))
        scratch = runner_for(self.model, self.device, self.layout, blocks, self.attention,
                             replace(self.config, enforce_eager=True), self.max_model_len)  # one eager prefill

        def run(token_ids: list[int]) -> None:
            probe = Sequence("kv-calibration", token_ids, SamplingParams(max_tokens=1), 0.0)
            probe.block_table = list(range(blocks))
            scratch.execute([ScheduledSequence(probe, len(token_ids))])
            self.device.runtime.synchronize()

        try:
            measure_scales(self.model, run, ids)
        finally:
            scratch.release()

    def make_runner(self, num_blocks: int, graph_sizes: list[int] | None = None) -> ModelRunner:
        return runner_for(self.model, self.device, self.layout, num_blocks, self.attention, self.config,
                          self.max_model_len, graph_sizes)

    def _profile(self) -> int:
        """The memory planner's profile (ferrum.engine.memory_plan): a scratch GPU runner with a KV
        cache of two blocks runs every eager step size up to max_num_batched_tokens (compiling every
        kernel before serving; the rows past the probe's two tokens pad the step), the sampler at
        its widest, and captures the largest decode graph. Returns its KV cache's bytes."""
        from ferrum.engine.gpu_runner import GPUModelRunner

        config = self.config
        blocks = 2
        graphs = [config.seqs_per_step] if self.device.cuda_graphs and not config.enforce_eager else []
        scratch = self.make_runner(blocks, graph_sizes=graphs)
        if not isinstance(scratch, GPUModelRunner):
            raise TypeError(f"profiling {self.device.name}'s memory takes the GPU runner (triton_paged "
                            f"attention), not {type(scratch).__name__}")
        scratch.warm_up(config.tokens_per_step)
        _widest_sample(config.seqs_per_step, self.model_config.vocab_size, self.device)
        scratch.release()
        return self.layout.bytes_per_block * (blocks + 1)

    def check_fits(self, num_blocks: int) -> None:
        """One sequence's peak fits the cache: max_model_len tokens, or with a sliding window on every layer
        its window and one step's chunk (the blocks behind the window are given back as it advances)."""
        window = self.model_config.uniform_window
        need = peak_tokens(self.max_model_len, self.config.tokens_per_step, self.config.block_size, window)
        if num_blocks * self.config.block_size < need:
            memory = "gpu_memory_utilization" if self.device.dedicated_memory else "kv_cache_memory_gb"
            what = (f"sequence of max_model_len={self.max_model_len} tokens" if need == self.max_model_len else
                    f"sequence's sliding window ({window} tokens) and a step's {self.config.tokens_per_step} new "
                    f"tokens ({need} slots)")
            raise ValueError(
                f"the KV cache ({num_blocks} blocks of {self.config.block_size} tokens) cannot hold one {what}; "
                f"raise {memory} or lower max_model_len"
            )

    def release(self) -> None:
        self.runner.release()
        self.model = None  # type: ignore[assignment]


def runner_for(
    model: LlamaForCausalLM,
    device: Device,
    layout: KVCacheLayout,
    num_blocks: int,
    attention: AttentionBackend,
    config: EngineConfig,
    max_model_len: int,
    graph_sizes: list[int] | None = None,
) -> TorchModelRunner | GPUModelRunner:
    """The runner for `attention`, by its type: TorchModelRunner over torch_paged, GPUModelRunner
    over triton_paged (its module, and Triton, imported only then). `config` has its device defaults
    filled in; `graph_sizes`: the GPU runner's decode graphs (default: every bucket)."""
    if isinstance(attention, (TorchPagedAttention, CpuPagedAttention)):
        return TorchModelRunner(model, device, layout, num_blocks, attention)
    from ferrum.engine.gpu_runner import GPUModelRunner
    from ferrum.models.attention.triton_paged import TritonPagedAttention

    if isinstance(attention, TritonPagedAttention):
        return GPUModelRunner(model, device, layout, num_blocks, attention, config, max_model_len,
                              graph_sizes=graph_sizes)
    raise TypeError(f"no model runner for {type(attention).__name__} attention")


def load_cpu_kernels(kernels: KernelConfig) -> bool:
    """Builds (once per machine) and loads the CPU kernels; False, with the reason logged, where they
    cannot be built: the plain PyTorch path then serves."""
    from ferrum.kernels.cpu.build import CpuKernelBuildError
    from ferrum.kernels.cpu.build import load_cpu_kernels as load

    try:
        load(Path(kernels.cpu_cache_dir))
    except CpuKernelBuildError as exc:
        log.warning("CPU kernels unavailable, serving with plain PyTorch ops (slower): %s", exc)
        return False
    return True


def _widest_sample(rows: int, vocab: int, device: Device) -> None:
    """The sampler over `rows` rows with every filter and penalty on: its widest temporaries."""
    params = SamplingParams(max_tokens=1, temperature=0.8, top_p=0.9, top_k=50, min_p=0.05, repetition_penalty=1.1,
                            presence_penalty=0.1, frequency_penalty=0.1, logprobs=20)
    seqs = [Sequence(f"profile-{i}", [1, 2, 3], params, 0.0) for i in range(rows)]
    for seq in seqs:
        seq.output_token_ids = [4, 5]
    logits = torch.randn(rows, vocab, dtype=torch.float32, device=device.torch_device)
    sample(logits, seqs)
