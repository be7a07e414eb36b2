"""A model on its device: built from config.json, its weights filled through the WeightLoader.

The model says which checkpoint tensor fills which parameter rows (`weight_bindings`); here that
becomes one `TensorSpec` per checkpoint tensor (cast to the serving dtype where the checkpoint
differs, and quantized, tensor by tensor, for a quantized layer: the full-precision model is never
allocated, a quantized layer holds only its storage), checked against the checkpoint's header
(read alone, locally or by two ranged reads of a remote file), and `WeightLoader.load` fills the
parameters (and quantized storage) in place on the `Device` from whatever source the weights are
in: a local file (read straight into the device's staging), or an S3 object or URL streamed as its
bytes arrive while the verified cache is written alongside. Quantized layers are prepared for their
kernels once the weights are in (the CPU's int4 repack).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch

from ferrum.backends.device import Device
from ferrum.kernels.config import KernelConfig
from ferrum.models.config import ModelConfig
from ferrum.models.layers import LayerOps, RotaryEmbedding
from ferrum.models.layers.linear import LinearFactory
from ferrum.models.layers.parallel import TensorParallel
from ferrum.models.llama import LlamaForCausalLM, WeightBinding, checkpoint_modules, ignored_checkpoint_tensor
from ferrum.models.load_memory import PeakHostMemory
from ferrum.models.published_loader import PublishedLayer, plan_published, repack_published
from ferrum.weights.errors import WeightError
from ferrum.weights.loader import WeightLoader
from ferrum.weights.quantization.arith import QuantizeKernel
from ferrum.weights.quantization.published.base import DenseTensor, PublishedLayers
from ferrum.weights.quantization.published.detect import check_requested
from ferrum.weights.quantization.scheme import QuantizationConfig
from ferrum.weights.quantization.tensor import QuantizedTensor
from ferrum.weights.spec.sources import WeightSource
from ferrum.weights.spec.tensors import TensorSpec, WeightMetadata
from ferrum.weights.spec.transforms import (
    Cast,
    Dequantize,
    Quantize,
    Reshape,
    Slice,
    TensorTransformation,
    Transpose,
)

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class WeightsError(WeightError, ValueError):
    """Weights missing or not matching the model's config; names the file."""


@dataclass(frozen=True)
class WeightLoadReport:
    """The model's weights: where they came from (a source kind: file, url, s3, hf), how many bytes
    as stored (quantized layers quantized), how long from the first read to the last byte on the
    device (for the server's readiness answer and its metrics), and the memory loading took."""

    source: str
    nbytes: int
    seconds: float
    bytes_read: int = 0  # of the checkpoint: a tensor-parallel rank reads only its shards where it can
    peak_host_bytes: int = 0  # the process's resident set at its highest while building and loading
    peak_device_bytes: int = 0  # a device with memory of its own: its allocator's peak (reserved) while loading
    quantization: str | None = None  # the quantization the weights were loaded in, described; None: unquantized
    published: str | None = None  # the published format the checkpoint was stored in (gptq, awq, ...), if any
    chosen: str | None = None  # what `quantization: auto` picked for the device, and why
    on_load: QuantizationConfig | None = None  # the quantization on load the layers got (auto's pick included)


def build_model(config: ModelConfig, device: Device, dtype: torch.dtype, ops: LayerOps,
                tp: TensorParallel | None = None, quantization: QuantizationConfig | None = None,
                integer_gemv: bool = False, kernels: KernelConfig | None = None) -> LlamaForCausalLM:
    """`integer_gemv`: quantized layers compute through the CPU kernels' integer GEMV (activations
    quantized to int8 per 32 inputs: quantization auto's choice) where the CPU kernels are loaded; else
    through torch's CPU ops, whose products equal the dequantized weights'. The model's parameters
    (one rank's shard of them under `tp`) allocated on `device` in `dtype`
    (uninitialised; a quantized layer's storage in its own dtypes), its rotary tables computed there
    in float32. A checkpoint stored quantized (config.published) is served in its own format, which
    `quantization` may name (vLLM's --quantization gptq etc.). QuantizationConfigError for a
    quantization the model, the checkpoint or the device cannot take. `kernels`: the engine's kernel
    settings (how the quantized layers multiply many rows on a GPU)."""
    published = None
    if config.published is not None or (quantization is not None and quantization.published):
        check_requested(quantization.method if quantization is not None else None, config.published,
                        "config.json")
        assert config.published is not None
        published, quantization = PublishedLayers(config.published, checkpoint_modules), None
    linears = LinearFactory.for_device(device, dtype, quantization, published,
                                       cpu_kernels=integer_gemv and ops.name == "cpu", kernels=kernels)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, ops, tp, linears)
    model = model.to(dtype).to_empty(device=device.torch_device)  # allocated once, in the target dtype
    if config.tie_word_embeddings:  # to_empty gives every module a parameter of its own
        model.tie_embeddings()
    if model.shard.sharded:  # the last rank's vocabulary rows past the end: never filled, never read
        with torch.no_grad():
            model.embed_tokens.weight.zero_()
            if not config.tie_word_embeddings:
                head = model.weight_destinations()["lm_head.weight"]
                for part in head.parts.values() if isinstance(head, QuantizedTensor) else (head,):
                    part.zero_()
    model.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings).to(device.torch_device)
    return model.eval()


@dataclass
class WeightPlan:
    """What fills the model: `specs` into `into` (parameters, and storage quantized on load), and the
    layers of a published quantized checkpoint, read and repacked after them."""

    specs: list[TensorSpec]
    into: dict[str, torch.Tensor | QuantizedTensor]
    published: list[PublishedLayer]


def weight_plan(
    model: LlamaForCausalLM, metadata: WeightMetadata, weights: WeightSource, dtype: torch.dtype,
    quantize_on: str = "cpu", kernel: QuantizeKernel | None = None,
) -> WeightPlan:
    """One TensorSpec per checkpoint tensor the model needs and the parameter rows it fills (for a
    layer quantized on load: the rows of its storage, the spec ending in Quantize, computed on
    `quantize_on`, by `kernel` where it takes the scheme; a layer of a published quantized checkpoint:
    its tensors, repacked on `quantize_on`).
    WeightsError (naming `weights`) for a tensor the model does not have, one whose shape is not
    what config.json implies, or tensors missing from the checkpoint."""
    where = weights.display
    fmt = model.config.published
    destinations = model.weight_destinations()
    bindings = {b.checkpoint_name: b for b in model.weight_bindings()}
    published: list[PublishedLayer] = []
    if fmt is not None:
        for name, binding in list(bindings.items()):
            target = _target(destinations[binding.parameter], binding)
            if isinstance(target, QuantizedTensor):
                published.append(plan_published(model, fmt, binding, target, metadata, weights, quantize_on))
                del bindings[name]
    read = {spec.name for layer in published for spec in layer.specs}
    for stored_name in metadata.tensors:
        hf_name = fmt.checkpoint_name(stored_name) if fmt is not None else stored_name
        if stored_name in read or (fmt is not None and fmt.unused(stored_name)):
            continue
        if hf_name is None or (hf_name not in bindings and not ignored_checkpoint_tensor(hf_name, model.config)):
            raise WeightsError(where, f"tensor {stored_name!r} does not belong to {model.config.architecture}"
                               + (f" ({fmt.describe()})" if fmt is not None else ""))
    stored = {name: fmt.stored_name(name) if fmt is not None else name for name in bindings}
    missing = [stored[name] for name in bindings if stored[name] not in metadata.tensors]
    if missing:
        raise WeightsError(where, f"{len(missing)} weights missing from the checkpoint, e.g. {', '.join(missing[:5])}")
    specs: list[TensorSpec] = []
    into: dict[str, torch.Tensor | QuantizedTensor] = {}
    for name, binding in bindings.items():
        target = _target(destinations[binding.parameter], binding)
        shape, stored_dtype = metadata.tensors[stored[name]]
        dense = fmt.dense(name, (shape, stored_dtype)) if fmt is not None else None
        if dense is not None:
            shape = dense.shape
        shard = binding.shard
        read_shape = list(shape)
        if shard is not None and 0 <= shard.dim < len(read_shape) and shard.end <= read_shape[shard.dim]:
            read_shape[shard.dim] = shard.end - shard.start
        if tuple(read_shape) != tuple(target.shape):
            implied = tuple(target.shape) if shard is None else f"{tuple(target.shape)} for this rank's shard"
            raise WeightsError(where, f"tensor {name!r} has shape {tuple(shape)}, config.json implies {implied}")
        steps = _published_steps(dense) if dense is not None else ()
        steps += () if shard is None else (Slice(shard.dim, shard.start, shard.end),)
        steps += (Cast(dtype),) if stored_dtype != dtype or (dense is not None and dense.dequantize) else ()
        if isinstance(target, QuantizedTensor):
            steps += (Quantize(target.scheme, compute_device=quantize_on, kernel=kernel),)
        specs.append(TensorSpec(name, tuple(target.shape), dtype, source=_with_tensor(weights, stored[name]),
                                transformations=steps))
        into[name] = target
    return WeightPlan(specs, into, published)



def _published_steps(dense: DenseTensor) -> tuple[TensorTransformation, ...]:
    """A published checkpoint's tensor served unquantized: dequantized from its blocks, its rows put in
    HF order (GGUF's llama attn_q / attn_k: each head's two rotary halves were interleaved)."""
    steps: tuple[TensorTransformation, ...] = (Dequantize(dense.dequantize),) if dense.dequantize else ()
    heads = dense.interleaved_heads
    if heads:
        rows, rest = dense.shape[0], dense.shape[1:]
        steps += (Reshape((heads, rows // heads // 2, 2, *rest)), Transpose((0, 2, 1, *range(3, 3 + len(rest)))),
                  Reshape(dense.shape))
    return steps


def _target(destination: torch.Tensor | QuantizedTensor, binding: WeightBinding) -> torch.Tensor | QuantizedTensor:
    if binding.rows is None:
        return destination
    start, end = binding.rows
    return destination.rows(start, end) if isinstance(destination, QuantizedTensor) else destination[start:end]


def quantize_on(device: Device) -> str:
    """Where quantized layers' weights are quantized as they load: on a CUDA device itself, else the CPU."""
    return device.name if device.kind == "cuda" else "cpu"


def prepare_weights(model: LlamaForCausalLM) -> None:
    """Once the weights are in: every quantized layer into its kernels' layout (the CPU's int4 repack)."""
    with torch.no_grad():
        for layer in model.quantized_layers().values():
            layer.prepare()


def _with_tensor(source: WeightSource, tensor: str) -> WeightSource:
    return replace(source, tensor_name=tensor)


async def load_weights(
    model: LlamaForCausalLM,
    weights: WeightSource,
    device: Device,
    loader: WeightLoader,
    progress: Callable[[int, int], None] | None = None,
    quantize_kernel: QuantizeKernel | None = None,
) -> int:
    """Fills every parameter of `model` (on `device`) from `weights` (a file, or a sharded
    checkpoint's index, local or remote); returns the bytes loaded. `progress(done, total)` is
    called (from worker threads) as tensors land. Layers quantized on load are quantized by
    `quantize_kernel` where it takes their scheme (LayerOps.quantize)."""
    metadata = await loader.get_metadata(weights)
    dtype = model.embed_tokens.weight.dtype
    plan = weight_plan(model, metadata, weights, dtype, quantize_on(device), quantize_kernel)
    await loader.load(plan.specs, into=plan.into, device=device, progress=progress)
    loaded = sum(t.nbytes if isinstance(t, QuantizedTensor) else t.numel() * t.element_size()
                 for t in plan.into.values())
    if plan.published:
        assert model.config.published is not None
        await repack_published(plan.published, model.config.published, loader, device, weights.display)
        loaded += sum(layer.target.nbytes for layer in plan.published)
    return loaded


def load_model(
    config: ModelConfig,
    weights: WeightSource,
    device: Device,
    dtype: torch.dtype,
    ops: LayerOps,
    loader: WeightLoader,
    progress: Callable[[int, int], None] | None = None,
    tp: TensorParallel | None = None,
    quantization: QuantizationConfig | None = None,
    chosen: str | None = None,
    kernels: KernelConfig | None = None,
) -> tuple[LlamaForCausalLM, WeightLoadReport]:
    """build_model, then load_weights, from synchronous code (the engine's constructor), then the
    quantized layers prepared (`chosen`: what quantization auto picked and why, for the report; its
    layers take the CPU kernels' integer GEMV). A
    remote checkpoint starts downloading first (`WeightLoader.fetching`),
    so its bytes arrive while the model is built on this thread. Returns the model and how its
    weights were loaded (bytes as stored, the peak host and device memory while loading)."""
    started = time.perf_counter()
    built: concurrent.futures.Future[LlamaForCausalLM] = concurrent.futures.Future()
    reading = started

    async def fill() -> int:
        nonlocal reading
        async with loader.fetching(weights):
            model = await asyncio.wrap_future(built)
            reading = time.perf_counter()
            return await load_weights(model, weights, device, loader, progress, ops.quantize)

    def build() -> LlamaForCausalLM:
        try:
            model = build_model(config, device, dtype, ops, tp, quantization, integer_gemv=chosen is not None,
                                kernels=kernels)
            device.runtime.synchronize()
        except BaseException as exc:
            built.set_exception(exc)
            raise
        built.set_result(model)
        return model

    if device.dedicated_memory:
        device.runtime.reset_peak_memory()
    with PeakHostMemory() as host:
        model, nbytes = run_beside(fill(), build)
        prepare_weights(model)
        device.runtime.synchronize()
    done = time.perf_counter()
    peak_device = device.runtime.peak_memory_held() if device.dedicated_memory else 0
    described = (config.published.describe() if config.published is not None
                 else quantization.describe() if quantization is not None else None)
    log.info("loaded %.2f GB of weights%s from %s to %s in %.2fs (%.2f GB/s; model set-up before them %.2fs); "
             "peak memory while loading: host %.2f GB%s",
             nbytes / 1e9, f" ({described})" if described else "", weights.display, device.name, done - reading,
             nbytes / 1e9 / max(done - reading, 1e-9), reading - started, host.peak / 1e9,
             f", {device.name} {peak_device / 1e9:.2f} GB" if device.dedicated_memory else "")
    return model, WeightLoadReport(weights.kind, nbytes, done - reading, loader.bytes_read, host.peak, peak_device,
                                   described, config.published.name if config.published is not None else None,
                                   chosen, quantization)


def run_beside(coroutine: Coroutine[Any, Any, T], work: Callable[[], R]) -> tuple[R, T]:
    """`work()` on this thread while `coroutine` runs on an event loop of its own thread; both
    results. An error of either is raised once both have ended (work's first)."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(asyncio.run(coroutine))
        except BaseException as exc:  # noqa: BLE001 - handed back to the caller
            error.append(exc)

    thread = threading.Thread(target=run, name="ferrum-load")
    thread.start()
    try:
        done = work()
    finally:
        thread.join()
    if error:
        raise error[0]
    return done, result[0]


def run_sync(coroutine: Coroutine[Any, Any, T]) -> T:
    """Runs `coroutine` to completion from synchronous code: on this thread's own event loop, or on
    a thread of its own when this thread already runs one."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coroutine)
    return run_beside(coroutine, lambda: None)[1]
