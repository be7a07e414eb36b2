"""A model on its device: built from config.json, its weights filled through the WeightLoader.

The model says which checkpoint tensor fills which parameter rows (`weight_bindings`); here that
becomes one `TensorSpec` per checkpoint tensor (cast to the serving dtype where the checkpoint
differs), checked against the checkpoint's header (read alone, locally or by two ranged reads of
a remote file), and `WeightLoader.load_tensors` fills the parameters in place on the `Device` from
whatever source the weights are in: a local file (read straight into the device's staging), or an
S3 object or URL streamed as its bytes arrive while the verified cache is written alongside.
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
from ferrum.models.config import ModelConfig
from ferrum.models.layers import LayerOps, RotaryEmbedding
from ferrum.models.layers.parallel import TensorParallel
from ferrum.models.llama import LlamaForCausalLM, WeightBinding, ignored_checkpoint_tensor
from ferrum.weights.errors import WeightError
from ferrum.weights.loader import WeightLoader
from ferrum.weights.spec.sources import WeightSource
from ferrum.weights.spec.tensors import TensorSpec, WeightMetadata
from ferrum.weights.spec.transforms import Cast, Slice

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class WeightsError(WeightError, ValueError):
    """Weights missing or not matching the model's config; names the file."""


@dataclass(frozen=True)
class WeightLoadReport:
    """The model's weights: where they came from (a source kind: file, url, s3, hf), how many bytes,
    how long from the first read to the last byte on the device (for the server's readiness answer
    and its metrics)."""

    source: str
    nbytes: int
    seconds: float
    bytes_read: int = 0  # of the checkpoint: a tensor-parallel rank reads only its shards where it can


def build_model(config: ModelConfig, device: Device, dtype: torch.dtype, ops: LayerOps,
                tp: TensorParallel | None = None) -> LlamaForCausalLM:
    """The model's parameters (one rank's shard of them under `tp`) allocated on `device` in `dtype`
    (uninitialised), its rotary tables computed there in float32."""
    with torch.device("meta"):
        model = LlamaForCausalLM(config, ops, tp)
    model = model.to(dtype).to_empty(device=device.torch_device)  # allocated once, in the target dtype
    if config.tie_word_embeddings:  # to_empty gives every module a parameter of its own
        model.lm_head.weight = model.embed_tokens.weight
    if model.shard.sharded:  # the last rank's vocabulary rows past the end: never filled, never read
        with torch.no_grad():
            model.embed_tokens.weight.zero_()
            if not config.tie_word_embeddings:
                model.lm_head.weight.zero_()
    model.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings).to(device.torch_device)
    return model.eval()


def weight_plan(
    model: LlamaForCausalLM, metadata: WeightMetadata, weights: WeightSource, dtype: torch.dtype
) -> tuple[list[TensorSpec], dict[str, torch.Tensor]]:
    """One TensorSpec per checkpoint tensor the model needs and the parameter rows it fills.
    WeightsError (naming `weights`) for a tensor the model does not have, one whose shape is not
    what config.json implies, or tensors missing from the checkpoint."""
    where = weights.display
    bindings = {b.checkpoint_name: b for b in model.weight_bindings()}
    for name in metadata.tensors:
        if name not in bindings and not ignored_checkpoint_tensor(name, model.config):
            raise WeightsError(where, f"tensor {name!r} does not belong to {model.config.architecture}")
    missing = [name for name in bindings if name not in metadata.tensors]
    if missing:
        raise WeightsError(where, f"{len(missing)} weights missing from the checkpoint, e.g. {', '.join(missing[:5])}")
    params = dict(model.named_parameters())
    specs: list[TensorSpec] = []
    into: dict[str, torch.Tensor] = {}
    for name, binding in bindings.items():
        target = _target(params[binding.parameter], binding)
        shape, stored = metadata.tensors[name]
        shard = binding.shard
        read_shape = list(shape)
        if shard is not None and 0 <= shard.dim < len(read_shape) and shard.end <= read_shape[shard.dim]:
            read_shape[shard.dim] = shard.end - shard.start
        if tuple(read_shape) != tuple(target.shape):
            implied = tuple(target.shape) if shard is None else f"{tuple(target.shape)} for this rank's shard"
            raise WeightsError(where, f"tensor {name!r} has shape {tuple(shape)}, config.json implies {implied}")
        slices = (Slice(shard.dim, shard.start, shard.end),) if shard is not None else ()
        specs.append(TensorSpec(
            name, tuple(target.shape), dtype,
            source=_with_tensor(weights, name),
            transformations=slices + ((Cast(dtype),) if stored != dtype else ()),
        ))
        into[name] = target
    return specs, into


def _target(param: torch.Tensor, binding: WeightBinding) -> torch.Tensor:
    data = param.data
    return data if binding.rows is None else data[binding.rows[0] : binding.rows[1]]


def _with_tensor(source: WeightSource, tensor: str) -> WeightSource:
    return replace(source, tensor_name=tensor)


async def load_weights(
    model: LlamaForCausalLM,
    weights: WeightSource,
    device: Device,
    loader: WeightLoader,
    progress: Callable[[int, int], None] | None = None,
) -> int:
    """Fills every parameter of `model` (on `device`) from `weights` (a file, or a sharded
    checkpoint's index, local or remote); returns the bytes loaded. `progress(done, total)` is
    called (from worker threads) as tensors land."""
    metadata = await loader.get_metadata(weights)
    dtype = model.embed_tokens.weight.dtype
    specs, into = weight_plan(model, metadata, weights, dtype)
    await loader.load_tensors(specs, into=into, device=device, progress=progress)
    return sum(t.numel() * t.element_size() for t in into.values())


def load_model(
    config: ModelConfig,
    weights: WeightSource,
    device: Device,
    dtype: torch.dtype,
    ops: LayerOps,
    loader: WeightLoader,
    progress: Callable[[int, int], None] | None = None,
    tp: TensorParallel | None = None,
) -> tuple[LlamaForCausalLM, WeightLoadReport]:
    """build_model, then load_weights, from synchronous code (the engine's constructor). A remote
    checkpoint starts downloading first (`WeightLoader.fetching`), so its bytes arrive while the
    model is built on this thread. Returns the model and how its weights were loaded."""
    started = time.perf_counter()
    built: concurrent.futures.Future[LlamaForCausalLM] = concurrent.futures.Future()
    reading = started

    async def fill() -> int:
        nonlocal reading
        async with loader.fetching(weights):
            model = await asyncio.wrap_future(built)
            reading = time.perf_counter()
            return await load_weights(model, weights, device, loader, progress)

    def build() -> LlamaForCausalLM:
        try:
            model = build_model(config, device, dtype, ops, tp)
            device.runtime.synchronize()
        except BaseException as exc:
            built.set_exception(exc)
            raise
        built.set_result(model)
        return model

    model, nbytes = run_beside(fill(), build)
    device.runtime.synchronize()
    done = time.perf_counter()
    log.info("loaded %.2f GB of weights from %s to %s in %.2fs (%.2f GB/s; model set-up before them %.2fs)",
             nbytes / 1e9, weights.display, device.name, done - reading, nbytes / 1e9 / max(done - reading, 1e-9),
             reading - started)
    return model, WeightLoadReport(weights.kind, nbytes, done - reading, loader.bytes_read)


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
