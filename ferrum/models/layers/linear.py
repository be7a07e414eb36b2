"""The one factory of a model's linear layers (`LinearFactory`), and what the fused decode's GEMV
kernels read of a linear layer (`gemv_weight`).

A layer is made from its module path ("layers.3.self_attn.qkv_proj", "lm_head") and the served
model's QuantizationConfig (quantized on load) or its checkpoint's published format (`PublishedLayers`:
GPTQ, AWQ, FP8, compressed-tensors, GGUF, repacked into the same storage): a plain nn.Linear
(RowParallelLinear, ParallelLMHead under tensor
parallelism) where the layer is not quantized, else a QuantizedLinear of its QuantScheme computing
through the kernels chosen once for the Device (`quant_kernels`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from ferrum.backends.device import Device
from ferrum.kernels.config import DEFAULT_GEMM, GemmRules, KernelConfig
from ferrum.kernels.quant_weight import QuantWeight
from ferrum.models.layers.parallel import ParallelLMHead, RowParallelLinear, TensorParallel
from ferrum.models.layers.quantized_linear import QuantizedExperts, QuantizedLinear, QuantKernels
from ferrum.weights.quantization.published.base import PublishedLayers
from ferrum.weights.quantization.scheme import (
    SUB_GROUP,
    SUPER_GROUPS,
    QuantizationConfig,
    QuantizationConfigError,
    QuantScheme,
)

__all__ = ["LinearFactory", "check_skip", "gemv_weight", "quant_kernels"]

log = logging.getLogger(__name__)


def quant_kernels(device: Device, cpu_kernels: bool = False) -> QuantKernels:
    """How quantized layers compute on `device`: its Triton/CUDA kernels where Triton compiles for
    it; on the CPU its C++ kernels where they are loaded (`cpu_kernels`), else torch's CPU ops;
    dequantized weights elsewhere."""
    if device.triton:
        return "kernels"
    if device.kind == "cpu":
        return "cpu_kernels" if cpu_kernels else "cpu"
    return "dequantize"


def _gather_vocab(tp: TensorParallel, vocab_size: int, logits: torch.Tensor) -> torch.Tensor:
    return tp.all_gather_last(logits)[..., :vocab_size]


@dataclass(frozen=True)
class LinearFactory:
    """Makes every linear layer of a model. `dtype`: the model's (int4's scales and zeros, biases).
    `published`: the checkpoint's own quantization, where it is stored quantized (then `quantization`,
    on load, is None)."""

    quantization: QuantizationConfig | None = None
    dtype: torch.dtype = torch.float32
    kernels: QuantKernels = "cpu"
    gemm: GemmRules = DEFAULT_GEMM  # CUDA: how quant_matmul multiplies many rows on the device
    published: PublishedLayers | None = None

    fp8_unsupported: str | None = None  # why the device cannot run fp8 (None: it can)

    @classmethod
    def for_device(cls, device: Device, dtype: torch.dtype, quantization: QuantizationConfig | None,
                   published: PublishedLayers | None = None, cpu_kernels: bool = False,
                   kernels: KernelConfig | None = None) -> LinearFactory:
        """A layer in fp8 (quantized on load or published) is a QuantizationConfigError where the device
        cannot run it (CUDA before compute capability 8.9). `kernels`: the engine's (its GemmRules)."""
        unsupported = None
        if device.kind == "cuda" and not device.fp8:
            cc = device.compute_capability or (0, 0)
            unsupported = (f"quantization fp8 needs compute capability 8.9 or later; {device.name} "
                           f"({device.description}) has {cc[0]}.{cc[1]}: use int8 or int4")
        if unsupported and quantization is not None and quantization.method == "fp8":
            raise QuantizationConfigError(unsupported)
        rowwise = (device.compute_capability or (9, 0)) >= (9, 0)
        return cls(quantization, dtype, quant_kernels(device, cpu_kernels),
                   (kernels or KernelConfig()).gemm_rules(rowwise), published, unsupported)

    def scheme_for(self, path: str, in_features: int) -> QuantScheme | None:
        if self.published is not None:
            scheme = self.published.scheme_for(path, in_features)
        else:
            scheme = None if self.quantization is None else self.quantization.scheme_for(path)
        if scheme is not None and scheme.method == "fp8" and self.fp8_unsupported:
            raise QuantizationConfigError(f"{path}: {self.fp8_unsupported}")
        return scheme

    def _check_in_features(self, scheme: QuantScheme, in_features: int, what: str) -> None:
        """QuantizationConfigError unless the layer's inputs can be stored in `scheme` and read by
        this factory's kernels (the GPU's read int4 as 32-bit words of 8 inputs)."""
        scheme.check_in_features(in_features, what)
        if self.kernels == "kernels" and scheme.per_group and in_features % 4:
            raise QuantizationConfigError(
                f"{what}: the GPU kernels read {scheme.method} with group scales as words of 4 inputs; "
                f"{in_features} input features is not a multiple of 4"
            )
        if self.kernels == "kernels" and scheme.method == "int4" and in_features % 8:
            raise QuantizationConfigError(
                f"{what}: the GPU kernels read int4 as words of 8 inputs; {in_features} input features is not a "
                "multiple of 8"
            )

    def linear(self, path: str, in_features: int, out_features: int, bias: bool) -> nn.Linear | QuantizedLinear:
        scheme = self.scheme_for(path, in_features)
        if scheme is None:
            return nn.Linear(in_features, out_features, bias=bias)
        self._check_in_features(scheme, in_features, path)
        return QuantizedLinear(in_features, out_features, bias, scheme, self.kernels, self.dtype,
                               gemm=self.gemm)

    def experts(self, path: str, in_features: int, out_features: int,
                tp: TensorParallel | None = None) -> QuantizedExperts | None:
        """A mixture's stack of experts' projections [E * rows, in_features] quantized as one weight, or None
        where `path` is not quantized (the stack is then a plain parameter). Under tensor parallelism a
        stack whose inputs are split across ranks (down's: `in_features` is this rank's share) keeps whole
        groups on each rank."""
        scheme = self.scheme_for(path, in_features * (tp.size if tp is not None else 1))
        if scheme is None:
            return None
        if tp is not None and tp.size > 1:
            scheme.check_shard(in_features, f"{path} (this rank's share of {in_features * tp.size} input features "
                                            f"split over tensor_parallel_size={tp.size})")
        self._check_in_features(scheme, in_features, path)
        return QuantizedExperts(in_features, out_features, False, scheme, self.kernels, self.dtype,
                                gemm=self.gemm)

    def row_parallel(self, path: str, in_features: int, out_features: int, bias: bool,
                     tp: TensorParallel) -> RowParallelLinear | QuantizedLinear:
        """A layer whose input features (`in_features`: this rank's share) are split across ranks:
        its int4 groups must not straddle two ranks: each rank's share is whole groups (unsplit,
        tp.size 1, the last group may be ragged)."""
        scheme = self.scheme_for(path, in_features * tp.size)
        if scheme is None:
            return RowParallelLinear(in_features, out_features, bias, tp)
        if tp.size == 1:
            self._check_in_features(scheme, in_features, path)
        else:
            what = (f"{path} (this rank's share of {in_features * tp.size} input features split over "
                    f"tensor_parallel_size={tp.size})")
            if scheme.sub_scales and in_features % (SUB_GROUP * SUPER_GROUPS):
                log.info("%s: Q4_K super-blocks of %d inputs straddle two ranks' shares of %d: served with "
                         "float32 scales and zeros per group of %d (exact; 6 bits a weight against 4.75)", path,
                         SUB_GROUP * SUPER_GROUPS, in_features, SUB_GROUP)
                scheme = scheme.expanded()
            scheme.check_shard(in_features, what)
            self._check_in_features(scheme, in_features, what)
        return QuantizedLinear(in_features, out_features, bias, scheme, self.kernels, self.dtype, tp.all_reduce,
                               gemm=self.gemm)

    def lm_head(self, rows: int, hidden: int, vocab_size: int,
                tp: TensorParallel) -> nn.Linear | ParallelLMHead | QuantizedLinear:
        """The output head (untied): `rows` of the vocabulary on this rank, gathered under tensor parallelism."""
        scheme = self.scheme_for("lm_head", hidden)
        if scheme is None:
            return nn.Linear(hidden, vocab_size, bias=False) if tp.size == 1 else ParallelLMHead(
                rows, hidden, vocab_size, tp)
        self._check_in_features(scheme, hidden, "lm_head")
        combine = None if tp.size == 1 else partial(_gather_vocab, tp, vocab_size)
        return QuantizedLinear(hidden, rows, False, scheme, self.kernels, self.dtype, combine,
                               gemm=self.gemm)


def check_skip(quantization: QuantizationConfig, layers: Iterable[str]) -> None:
    """QuantizationConfigError naming a `skip` entry that matches none of the model's linear layers."""
    names = list(layers)
    for entry in quantization.skip:
        if not any(name == entry or name.endswith("." + entry) for name in names):
            examples = sorted({name.split(".")[-1] for name in names})
            path = next((name for name in names if "." in name), names[0])
            raise QuantizationConfigError(
                f"quantization skip entry {entry!r} names none of the model's linear layers; they are named "
                f"{', '.join(examples)}, e.g. {path!r} (q/k/v and gate/up are fused into qkv_proj and "
                "gate_up_proj; embeddings are never quantized)"
            )


def gemv_weight(linear: nn.Module) -> torch.Tensor | QuantWeight:
    """What the GEMV kernels read of a linear layer: its quantized storage, or its weight. (A layer
    storing its inputs reordered has none: the chain's kernels read their input in order.)"""
    if isinstance(linear, QuantizedLinear):
        if linear.input_order is not None:
            raise RuntimeError("a layer whose inputs are stored reordered (act order) runs through forward()")
        return linear.kernel_weight()
    weight = linear.weight
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(linear).__name__} has no weight tensor for the GEMV kernels")
    return weight
