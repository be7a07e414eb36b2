"""A published quantized checkpoint (GPTQ, AWQ, FP8, compressed-tensors) into the model's quantized
storage: each quantized layer's checkpoint tensors (packed values, scales, zero points, group indices)
are read through the WeightLoader onto the repack device, checked against the format and the
model's shapes from the header before any data is read, repacked exactly into the seam's layout
(ferrum.weights.quantization.published), and copied into the layer's storage rows; one decoder
layer's tensors at a time, so the staged checkpoint tensors never exceed one layer's.

Under tensor parallelism a rank reads a quantized layer's whole tensors and keeps its shard of the
repacked storage (output rows, or whole input groups of a row-parallel layer; act-order storage
cannot be split along its inputs: a clear error).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ferrum.backends.device import Device
from ferrum.models.layers.parallel import Shard
from ferrum.models.layers.quantized_linear import QuantizedLinear
from ferrum.models.llama import LlamaForCausalLM, WeightBinding
from ferrum.weights.errors import WeightError
from ferrum.weights.loader import WeightLoader
from ferrum.weights.quantization.published.base import PublishedFormat, Repacked, RepackError, widen
from ferrum.weights.quantization.scheme import SUPER_GROUPS
from ferrum.weights.quantization.tensor import QuantizedTensor
from ferrum.weights.spec.sources import WeightSource
from ferrum.weights.spec.tensors import TensorSpec, WeightMetadata

__all__ = ["PublishedLayer", "plan_published", "repack_published"]


class PublishedWeightsError(WeightError, ValueError):
    """A published checkpoint's tensors disagree with its quantization_config or the model; names the
    file and the tensor."""


@dataclass(frozen=True)
class PublishedLayer:
    """One quantized checkpoint module and where its repacked weight goes."""

    module: str  # HF name, e.g. "model.layers.0.self_attn.q_proj"
    shape: tuple[int, int]  # the checkpoint weight's [N, K] (whole, before any tensor-parallel shard)
    specs: tuple[TensorSpec, ...]  # its checkpoint tensors, read as stored
    roles: dict[str, str]  # spec name -> role
    target: QuantizedTensor  # the storage rows it fills
    layer: QuantizedLinear
    shard: Shard | None


def _layer_index(module: str) -> int:
    parts = module.split(".")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "layers" and parts[2].isdigit() else -1


def plan_published(model: LlamaForCausalLM, fmt: PublishedFormat, binding: WeightBinding,
                   target: QuantizedTensor, metadata: WeightMetadata, weights: WeightSource,
                   repack_on: str) -> PublishedLayer:
    """The PublishedLayer of a quantized binding (its checkpoint name M.weight): its tensors found
    and checked in the header (PublishedWeightsError naming the file and each problem)."""
    where = weights.display
    module = binding.checkpoint_name.removesuffix(".weight")
    layer = model.get_submodule(binding.parameter.removesuffix(".weight"))
    assert isinstance(layer, QuantizedLinear)
    n, k = target.shape
    if binding.shard is not None:  # the whole checkpoint weight
        n, k = (_whole(model, module, 0), k) if binding.shard.dim == 0 else (n, _whole(model, module, 1))
    names = fmt.tensors(module)
    infos = {role: metadata.tensors[name] for role, name in names.items() if name in metadata.tensors}
    missing = [names[r] for r in names if r not in infos and not fmt.optional(r)]
    problems = [f"tensor {name!r} is missing" for name in missing] or fmt.check(module, n, k, infos)
    if problems:
        raise PublishedWeightsError(where, f"{fmt.describe()}: " + "; ".join(problems))
    specs = tuple(TensorSpec(names[role], shape, dtype, repack_on, source=replace(weights, tensor_name=names[role]))
                  for role, (shape, dtype) in infos.items())
    return PublishedLayer(module, (n, k), specs, {names[r]: r for r in infos}, target, layer, binding.shard)


def _whole(model: LlamaForCausalLM, module: str, dim: int) -> int:
    """A checkpoint module's whole output (dim 0) or input (dim 1) size, from the model's config."""
    c, leaf = model.config, module.split(".")[-1]
    sizes = {"q_proj": (c.q_size, c.hidden_size), "k_proj": (c.kv_size, c.hidden_size),
             "v_proj": (c.kv_size, c.hidden_size), "o_proj": (c.hidden_size, c.q_size),
             "gate_proj": (c.intermediate_size, c.hidden_size), "up_proj": (c.intermediate_size, c.hidden_size),
             "down_proj": (c.hidden_size, c.intermediate_size), "lm_head": (c.vocab_size, c.hidden_size)}
    return sizes[leaf][dim]


async def repack_published(layers: list[PublishedLayer], fmt: PublishedFormat, loader: WeightLoader,
                           device: Device, where: str) -> int:
    """Reads and repacks every layer into its storage, a decoder layer at a time; the bytes read."""
    by_block: dict[int, list[PublishedLayer]] = {}
    for item in layers:
        by_block.setdefault(_layer_index(item.module), []).append(item)
    orders: dict[int, torch.Tensor | None] = {}  # per QuantizedLinear: its parts must share one input order
    nbytes = 0
    for block in sorted(by_block):
        group = by_block[block]
        raw = await loader.load_tensors([spec for item in group for spec in item.specs])
        for item in group:
            tensors = {item.roles[spec.name]: raw[spec.name] for spec in item.specs}
            nbytes += sum(t.numel() * t.element_size() for t in tensors.values())
            try:
                repacked = fmt.repack(item.module, *item.shape, tensors, item.layer.dtype)
                if repacked.weight.scheme != item.target.scheme:  # a fused layer's parts stored differently
                    repacked = Repacked(widen(repacked.weight, item.target.scheme), repacked.input_order)
            except RepackError as exc:
                raise PublishedWeightsError(where, f"{fmt.describe()}: {exc}") from None
            _fill(item, _sharded(repacked, item, where), orders, where)
        del raw
    with torch.no_grad():
        for item in layers:
            order = orders.get(id(item.layer))
            item.layer.set_input_order(None if order is None else order.to(device.torch_device))
    return nbytes


def _sharded(repacked: Repacked, item: PublishedLayer, where: str) -> Repacked:
    """The rank's shard of a whole repacked weight (all of it without tensor parallelism)."""
    shard = item.shard
    if shard is None:
        return repacked
    weight = repacked.weight
    if shard.dim == 0:
        return Repacked(weight.rows(shard.start, shard.end), repacked.input_order)
    if repacked.input_order is not None:
        raise PublishedWeightsError(where, f"{item.module}: its inputs are stored in act order (desc_act), which "
                                    "cannot be split across tensor-parallel ranks; serve it with "
                                    "tensor_parallel_size 1")
    scheme = item.target.scheme
    per = 2 if weight.scheme.method == "int4" else 1  # inputs a byte
    parts = {"qweight": weight.parts["qweight"][:, shard.start // per:shard.end // per]}
    if weight.scheme.grouped:
        g = weight.scheme.group_size
        if shard.start % g or (shard.end % g and shard.end != weight.shape[1]):
            raise PublishedWeightsError(where, f"{item.module}: its {weight.scheme.method} groups of {g} straddle two "
                                        "tensor-parallel ranks' inputs")
        for name in ("scale", "zero", "sub_scales"):
            if name in weight.parts:
                parts[name] = weight.parts[name][:, shard.start // g:-(-shard.end // g)]
        if "super_scales" in weight.parts:  # Q4_K's super-blocks of 8 groups, whole on each rank
            sg = g * SUPER_GROUPS
            if shard.start % sg or (shard.end % sg and shard.end != weight.shape[1]):
                raise PublishedWeightsError(where, f"{item.module}: its Q4_K super-blocks of {sg} inputs straddle two "
                                            "tensor-parallel ranks' inputs")
            parts["super_scales"] = weight.parts["super_scales"][:, shard.start // sg:-(-shard.end // sg)]
    else:
        parts["scale"] = weight.parts["scale"]
    if "input_scale" in weight.parts:  # per output row: every rank's inputs take it whole
        parts["input_scale"] = weight.parts["input_scale"]
    return Repacked(QuantizedTensor(scheme, (weight.shape[0], shard.end - shard.start), weight.dtype, parts))


def _fill(item: PublishedLayer, repacked: Repacked, orders: dict[int, torch.Tensor | None], where: str) -> None:
    weight, target = repacked.weight, item.target
    problems = [p for p in QuantizedTensor(target.scheme, weight.shape, target.dtype, weight.parts).layout_problems()]
    if weight.shape != target.shape or problems:
        raise PublishedWeightsError(where, f"{item.module}: repacked to {weight.shape} "
                                    f"{'; '.join(problems)}, the layer holds {target.shape}")
    key = id(item.layer)
    order = repacked.input_order
    if key in orders:
        known = orders[key]
        if (known is None) != (order is None) or (known is not None and order is not None
                                                   and not torch.equal(known, order.to(known.device))):
            raise PublishedWeightsError(where, f"{item.module}: its act order (g_idx) differs from the other "
                                        "projections fused with it (they share one input)")
    orders[key] = order
    with torch.no_grad():
        for name, part in target.parts.items():
            part.copy_(weight.parts[name])
