"""`QuantizedLinear`: a linear layer whose weight is stored quantized (int8, int4, fp8), and the
ways it computes, one `LinearMethod` per (kernels, method), chosen once when the layer is built:

    kernels     the device's Triton/CUDA kernels (ferrum.kernels.quant_matmul): any GPU batch
    cpu_kernels the CPU's C++ kernels (ferrum.kernels.cpu): int4 and int8 as integer dot products with
                x quantized to int8 in blocks of 32, the weight repacked once (prepare()); other
                schemes as under `cpu`
    cpu         torch's CPU ops: int8 through _weight_int8pack_mm; int4 through
                _weight_int4pack_mm_for_cpu after a one-time repack into its layout (prepare());
                fp8 by dequantizing for each matmul (correct, slow)
    dequantize  every method by dequantizing for each matmul (devices with neither)

The layer owns its storage: the parts of a `QuantizedTensor` registered as buffers in their own
dtypes (model.to(dtype) moves them and never casts them). `storage()` is the weight loader's
destination, `prepare()` runs once after loading (vLLM's process_weights_after_loading),
`kernel_weight()` is the storage as the GPU kernels read it. A published checkpoint may store the
inputs reordered (GPTQ's act order: `set_input_order`); the layer then reorders its input to match,
and the fused decode chain, whose kernels read the input in order, is not used. int8 with zeros per
group (`QuantScheme.offsets`: GGUF's Q5_1 and Q5_K, asymmetric 8-bit GPTQ): the GPU's kernels (the
GEMV too) take the zeros with the scales; the CPU kernels' GEMV computes the symmetric product in
float32 and adds each group's zero times the sum of its inputs (a [T, groups] @ [groups, N] product)
before the one rounding to x's dtype, and the CPU's decode chain, whose C++ GEMV reads only
q * scale, is not used for such layers.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Literal, Self, TypeAlias

import torch
import torch.nn.functional as F
from torch import nn

from ferrum.kernels.config import DEFAULT_GEMM, GemmRules
from ferrum.kernels.quant_weight import QuantWeight
from ferrum.weights.quantization.arith import dequantize, int4_factors, unpack_int4
from ferrum.weights.quantization.scheme import QuantScheme
from ferrum.weights.quantization.tensor import QuantizedTensor, part_layout

QuantKernels: TypeAlias = Literal["kernels", "cpu_kernels", "cpu", "dequantize"]
Combine: TypeAlias = Callable[[torch.Tensor], torch.Tensor]  # the product's collective (tensor parallelism)

_INT4_CPU_ROWS = 16  # the CPU's int4 layout packs rows in blocks of 16 (64 per conversion chunk)
_INT4_CPU_CHUNK = 4096  # rows repacked at a time: bounds the int32 temporary
_GEMV_LANES = 8  # the CPU kernels' GEMV computes 8 output rows side by side


@cache
def _int4_dense_rows() -> int:
    return int(torch.ops.ferrum_cpu.int4_dense_rows())


def _per_input(zero: torch.Tensor, group: int, k: int) -> torch.Tensor:
    """Zeros per group [N, groups] as float32 [N, K] (each group's value repeated over its inputs)."""
    return zero.float().repeat_interleave(group, dim=1)[:, :k]


def zero_term(x: torch.Tensor, zero: torch.Tensor, group: int) -> torch.Tensor:
    """int8 with zeros per group: sum over groups of zero[n, g] * (the sum of x's inputs in group g),
    [T, N] float32 (a ragged last group's missing inputs count as 0)."""
    groups = zero.shape[1]
    xf = x.float()
    if groups * group != x.shape[1]:
        xf = F.pad(xf, (0, groups * group - x.shape[1]))
    return xf.view(x.shape[0], groups, group).sum(dim=2) @ zero.float().t()


def cpu_gemv_takes(scheme: QuantScheme, in_features: int) -> bool:
    """The CPU kernels' GEMV runs int4 and int8 weights whose inputs and groups are whole 32-input blocks."""
    if in_features % 32 or scheme.method not in ("int4", "int8"):
        return False
    grouped = scheme.method == "int4" or scheme.per_group
    return not grouped or (scheme.group_size % 32 == 0 and in_features % scheme.group_size == 0)


class LinearMethod:
    """How a QuantizedLinear multiplies: x [T, K] -> x @ W^T [T, N] (no bias)."""

    def prepare(self, layer: QuantizedLinear) -> None:
        """Once, after the weights are loaded: any repacking the method needs."""

    def matmul(self, layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def dequantized(self, layer: QuantizedLinear) -> torch.Tensor:
        return dequantize(layer.storage())


class DequantizeMethod(LinearMethod):
    def matmul(self, layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequantize(layer.storage(), x.dtype))


class KernelsMethod(LinearMethod):
    def __init__(self, gemm: GemmRules) -> None:
        from ferrum.kernels.quant_matmul import quant_matmul

        self.quant_matmul = quant_matmul
        self.gemm = gemm  # the device's rules for products of many rows (GemmRules)

    def matmul(self, layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
        return self.quant_matmul(x, layer.kernel_weight(), rules=self.gemm)


class CpuInt8Method(LinearMethod):
    """torch._weight_int8pack_mm: int8 weights [N, K], scales in x's dtype."""

    def prepare(self, layer: QuantizedLinear) -> None:
        layer.register_buffer("scale_x", layer.scale.to(layer.dtype), persistent=False)

    def matmul(self, layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(x, layer.qweight, layer.scale_x)


class CpuInt4Method(LinearMethod):
    """torch._weight_int4pack_mm_for_cpu, whose dequantization is ours, (q - 8) * scale + zero, on
    its own layout: the packed weight [N', K'/2] (N' the rows rounded up to 16, K' the inputs to
    whole groups: the op needs K a multiple of the group size) and the scales and zeros interleaved
    [K'/g, N', 2]. prepare() repacks the storage into it, in place of the parts; a ragged last
    group's padding inputs hold q = 8 and meet zeros that matmul pads x with."""

    def prepare(self, layer: QuantizedLinear) -> None:
        n, k = layer.shape
        groups = layer.scheme.groups(k)
        padded, padded_k = -(-n // _INT4_CPU_ROWS) * _INT4_CPU_ROWS, groups * layer.scheme.group_size
        packed = torch.empty((padded, padded_k // 2), dtype=torch.uint8)
        values = unpack_int4(layer.qweight)  # uint8 [N, K]
        for start in range(0, padded, _INT4_CPU_CHUNK):
            end = min(start + _INT4_CPU_CHUNK, padded)
            chunk = torch.full((end - start, padded_k), 8, dtype=torch.int32)  # padding: (8 - 8) * 0 + 0, or x's 0s
            real = values[start:min(end, n)]
            chunk[: real.shape[0], :k] = real
            packed[start:end] = torch._convert_weight_to_int4pack_for_cpu(chunk, 2)
        scales_and_zeros = torch.zeros((groups, padded, 2), dtype=layer.dtype)
        scale, zero = int4_factors(layer.storage())
        scales_and_zeros[:, :n, 0] = scale.t()
        scales_and_zeros[:, :n, 1] = zero.t()
        layer.drop_storage()
        layer.register_buffer("packed", packed)
        layer.register_buffer("scales_and_zeros", scales_and_zeros)
        layer.repacked = True

    def matmul(self, layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
        padded_k = 2 * layer.packed.shape[1]
        if padded_k != layer.in_features:  # a ragged last group: x's padding inputs are zeros
            x = F.pad(x, (0, padded_k - layer.in_features))
        y = torch._weight_int4pack_mm_for_cpu(x, layer.packed, layer.scheme.group_size, layer.scales_and_zeros)
        return y if y.shape[-1] == layer.out_features else y[..., : layer.out_features]

    def dequantized(self, layer: QuantizedLinear) -> torch.Tensor:
        if not layer.repacked:
            return super().dequantized(layer)
        eye = torch.eye(layer.in_features, dtype=layer.dtype)  # the kernel's own dequantization, row by row
        return self.matmul(layer, eye).t().contiguous()


class CpuKernelsMethod(LinearMethod):
    """ferrum.kernels.cpu's integer products (int4_gemv, int8_gemv): x quantized to int8 in blocks of
    32 inputs meets the weight as stored, 8 output rows side by side. prepare() repacks the storage
    into the kernels' layout (the rows padded to a multiple of 8): int4's scales with its minimums
    (zero - 8 scale) or zeros, in float16 where that keeps them exact, else float32; int8's bytes
    offset by 128. Products of dense_rows(layer) rows or more (long prefills) dequantize the weight for
    the call and take one dense matrix product instead."""

    DENSE_ROWS = 32  # int8's, and int4's where the kernels say nothing else

    def dense_rows(self, layer: QuantizedLinear) -> int:
        """The rows of x from which this layer's product is dense: int4's as the built kernels measure it
        (256 on plain AVX2, whose int4 kernel takes many rows at once), else DENSE_ROWS."""
        return _int4_dense_rows() if layer.scheme.method == "int4" else self.DENSE_ROWS

    def prepare(self, layer: QuantizedLinear) -> None:
        n, k = layer.shape
        rows = -(-n // _GEMV_LANES) * _GEMV_LANES
        blocks = k // 32

        def by_lanes(t: torch.Tensor) -> torch.Tensor:  # [N, G] -> [N/8, G, 8], padded
            t = F.pad(t, (0, 0, 0, rows - n)) if rows != n else t
            return t.reshape(rows // _GEMV_LANES, _GEMV_LANES, -1).transpose(1, 2).contiguous()

        if layer.scheme.method == "int4":
            values = F.pad(unpack_int4(layer.qweight), (0, 0, 0, rows - n)).view(-1, 8, blocks, 2, 4, 4)
            packed = (values[:, :, :, 0] | (values[:, :, :, 1] << 4)).permute(0, 2, 3, 1, 4)
            packed = packed.reshape(-1, blocks, 4, 32).contiguous()
            # w = q * scale + minimum, or (q - 8) * scale + zero: the first form whose values float16
            # holds exactly (GGUF's Q4_1 stores float16 minimums; bf16 models' zeros), else float32
            scale, zero = (t.float() for t in int4_factors(layer.storage()))
            forms = [(scale, zero - 8 * scale, False), (scale, zero, True)]
            exact = [f for f in forms if all(torch.equal(t.half().float(), t) for t in f[:2])]
            scale, offset, zero_point = exact[0] if exact else forms[0]
            params = torch.float16 if exact else torch.float32
            layer.register_buffer("gemv_scale", by_lanes(scale).to(params))
            layer.register_buffer("gemv_offset", by_lanes(offset).to(params))
            layer.gemv_zero_point = zero_point
            layer.drop_storage()
        else:
            biased = (layer.qweight.to(torch.int16) + 128).to(torch.uint8)
            values = F.pad(biased, (0, 0, 0, rows - n)).view(-1, 8, blocks, 8, 4)
            packed = values.permute(0, 2, 3, 1, 4).reshape(-1, blocks, 8, 32).contiguous()
            scale = layer.scale.float()
            layer.register_buffer("gemv_scale", by_lanes(scale if scale.dim() == 2 else scale[:, None]))
            for name in ("qweight", "scale"):  # int8 with zeros keeps them (matmul adds their term)
                delattr(layer, name)
        layer.register_buffer("packed", packed)
        layer.repacked = True

    def matmul(self, layer: QuantizedLinear, x: torch.Tensor) -> torch.Tensor:
        offsets = layer.scheme.offsets  # int8 zeros per group: added in float32, then one rounding
        if x.shape[0] >= self.dense_rows(layer):  # long prefill: one dense product, the weight dequantized for it
            weight = self.dense_weight(layer, torch.float32 if offsets else x.dtype)[: layer.out_features]
            if offsets:
                weight = (weight + _per_input(layer.zero, layer.scheme.group_size, layer.in_features)).to(x.dtype)
            return F.linear(x, weight)
        if offsets:
            sym: torch.Tensor = torch.ops.ferrum_cpu.int8_gemv(x.float(), layer.packed, layer.gemv_scale,
                                                               layer.scheme.group_size)
            return (sym[..., : layer.out_features] + zero_term(x, layer.zero, layer.scheme.group_size)).to(x.dtype)
        if layer.scheme.method == "int4":
            y: torch.Tensor = torch.ops.ferrum_cpu.int4_gemv(x, layer.packed, layer.gemv_scale, layer.gemv_offset,
                                                             layer.gemv_zero_point, layer.scheme.group_size)
        else:
            y = torch.ops.ferrum_cpu.int8_gemv(x, layer.packed, layer.gemv_scale,
                                               layer.scheme.group_size if layer.scheme.per_group else 0)
        return y if y.shape[-1] == layer.out_features else y[..., : layer.out_features]

    def dense_weight(self, layer: QuantizedLinear, dtype: torch.dtype) -> torch.Tensor:
        """The repacked weight dequantized, [N rounded up to 8, K] in `dtype` (the C++ kernels' own)."""
        group = layer.scheme.group_size if layer.scheme.method == "int4" or layer.scheme.per_group else 0
        if layer.scheme.method == "int4":
            weight: torch.Tensor = torch.ops.ferrum_cpu.int4_dequantize(
                layer.packed, layer.gemv_scale, layer.gemv_offset, layer.gemv_zero_point, group, dtype)
        else:
            weight = torch.ops.ferrum_cpu.int8_dequantize(layer.packed, layer.gemv_scale, group, dtype)
        return weight

    def dequantized(self, layer: QuantizedLinear) -> torch.Tensor:
        if not layer.repacked:
            return super().dequantized(layer)
        n, k = layer.shape
        row_groups, blocks = layer.packed.shape[:2]

        def by_rows(t: torch.Tensor) -> torch.Tensor:  # [N/8, G, 8] -> [N, K] (each group's value repeated)
            per_row = t.float().transpose(1, 2).reshape(row_groups * _GEMV_LANES, -1)[:n]
            return per_row.repeat_interleave(k // per_row.shape[1], dim=1)

        if layer.scheme.method == "int4":
            packed = layer.packed.view(row_groups, blocks, 4, 8, 4).permute(0, 3, 1, 2, 4)  # [N/8, 8, B, 4, 4]
            values = torch.stack([packed & 0xF, packed >> 4], dim=3).reshape(-1, k)[:n].float()
            weight = (values - 8 * layer.gemv_zero_point) * by_rows(layer.gemv_scale) + by_rows(layer.gemv_offset)
        else:
            packed = layer.packed.view(row_groups, blocks, 8, 8, 4).permute(0, 3, 1, 2, 4)
            values = packed.reshape(-1, k)[:n].float() - 128
            weight = values * by_rows(layer.gemv_scale)
            if layer.scheme.offsets:
                weight += _per_input(layer.zero, layer.scheme.group_size, k)
        return weight.to(layer.dtype)


def linear_method(kernels: QuantKernels, scheme: QuantScheme, dtype: torch.dtype, in_features: int,
                  gemm: GemmRules = DEFAULT_GEMM) -> LinearMethod:
    """The CPU's int8 / int4 ops only where the activations are half precision: in float32 they ran
    the demo model 7x (int8) and 15x (int4) slower than dequantizing each weight per call
    (scripts/quant_cpu_bench.py, AMD EPYC Zen 4: 5.5 and 2.5 against 38 tokens/s)."""
    if kernels == "kernels":
        return KernelsMethod(gemm)
    if kernels == "cpu_kernels" and cpu_gemv_takes(scheme, in_features):
        return CpuKernelsMethod()
    half = dtype in (torch.bfloat16, torch.float16)
    cpu = kernels in ("cpu", "cpu_kernels")
    if cpu and half and scheme.method == "int8" and not scheme.per_group:
        return CpuInt8Method()
    if cpu and half and scheme.method == "int4":
        return CpuInt4Method()
    return DequantizeMethod()


class QuantizedLinear(nn.Module):
    """y = combine(x @ W^T) + bias, W [out_features, in_features] stored in `scheme`'s layout;
    `dtype` is the model's (int4's scales and zeros, the bias, the activations). `combine`: the
    tensor-parallel collective applied to the product before the bias (row-parallel layers: the
    sum across ranks; a vocabulary-split LM head: the gather)."""

    qweight: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    sub_scales: torch.Tensor
    super_scales: torch.Tensor
    scale_x: torch.Tensor
    packed: torch.Tensor
    scales_and_zeros: torch.Tensor
    gemv_scale: torch.Tensor
    gemv_offset: torch.Tensor
    input_scale: torch.Tensor
    static_activation_scale: torch.Tensor | None
    input_order: torch.Tensor | None

    def __init__(self, in_features: int, out_features: int, bias: bool, scheme: QuantScheme,
                 kernels: QuantKernels, dtype: torch.dtype, combine: Combine | None = None,
                 gemm: GemmRules = DEFAULT_GEMM) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.scheme, self.dtype, self.combine = scheme, dtype, combine
        for name, (shape, part_dtype) in part_layout(scheme, out_features, in_features, dtype).items():
            self.register_buffer(name, torch.empty(shape, dtype=part_dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.method = linear_method(kernels, scheme, dtype, in_features, gemm)
        self.repacked = False  # prepare() put the storage into the method's own layout
        self.gemv_zero_point = False  # the CPU GEMV's int4 offsets are zeros (else minimums)
        self.register_buffer("input_order", None)
        self.register_buffer("static_activation_scale", None, persistent=False)  # prepare(): input_scale's largest

    def set_input_order(self, order: torch.Tensor | None) -> None:
        """The storage's input j is the layer's input order[j] (int64 [in_features]); None: in order."""
        if order is not None and tuple(order.shape) != (self.in_features,):
            raise ValueError(f"input order of {tuple(order.shape)} for {self.in_features} input features")
        self.input_order = None if order is None else order.to(torch.int64)

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def _check_layout(self) -> None:
        if self.repacked:
            raise RuntimeError(f"{self.scheme.describe()} weight was repacked for {type(self.method).__name__} "
                               "(prepare() ran): its storage is no longer in the loader's layout")

    def storage(self) -> QuantizedTensor:
        """The weight's storage (the buffers themselves): where the loader writes it."""
        self._check_layout()
        names = part_layout(self.scheme, self.out_features, self.in_features, self.dtype)
        return QuantizedTensor(self.scheme, self.shape, self.dtype, {name: getattr(self, name) for name in names})

    def kernel_weight(self) -> QuantWeight:
        """The storage as the GPU kernels read it (made on every call: cheap, never stale); with an
        input order, its inputs are the reordered ones (forward reorders x first)."""
        self._check_layout()
        if self.scheme.sub_scales:  # Q4_K's (sc, m) bytes as one int16 a group, (d, dmin) as one int64 a super-block
            return QuantWeight("int4", self.qweight, self.sub_scales.view(torch.int16)[..., 0],
                               self.super_scales.view(torch.int64)[..., 0], self.scheme.group_size, sub_scales=True)
        if self.scheme.method == "int4" or self.scheme.offsets:
            return QuantWeight(self.scheme.method, self.qweight, self.scale, self.zero, self.scheme.group_size)
        return QuantWeight(self.scheme.method, self.qweight, self.scale,
                           group_size=self.scheme.group_size if self.scheme.per_group else 0,
                           input_scale=self.activation_scale())

    def activation_scale(self) -> torch.Tensor | None:
        """A static input scale (fp8 `static_input`) as the layer's activations take it, float32 [1]: the
        largest of its rows' (a fused layer's parts may differ); None for dynamic activations."""
        if not self.scheme.static_input:
            return None
        if self.static_activation_scale is not None:
            return self.static_activation_scale
        return self.input_scale.amax().reshape(1)

    def prepare(self) -> None:
        """Once, after loading: the static activation scale reduced once, then the method's repacking
        (the CPU's int4 layout)."""
        if self.scheme.static_input:
            self.static_activation_scale = self.input_scale.amax().reshape(1)
        self.method.prepare(self)

    def drop_storage(self) -> None:
        """The loader's parts deleted (prepare() repacked them into the method's own buffers)."""
        for name in part_layout(self.scheme, self.out_features, self.in_features, self.dtype):
            delattr(self, name)

    def dequantized(self) -> torch.Tensor:
        """The weight the storage stands for, [out, in] in the model's dtype, its inputs in order (tests, checks)."""
        weight = self.method.dequantized(self)
        if self.input_order is None:
            return weight
        return torch.empty_like(weight).index_copy_(1, self.input_order, weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.input_order is not None:
            flat = flat.index_select(1, self.input_order)
        y = self.method.matmul(self, flat.contiguous())
        if self.combine is not None:
            y = self.combine(y)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Self:
        """model.to(dtype) moves the storage and never casts it: its parts keep their own dtypes."""
        parts = {id(t) for t in self._buffers.values() if t is not None}

        def keeping_dtypes(t: torch.Tensor) -> torch.Tensor:
            moved = fn(t)
            return t.to(moved.device) if id(t) in parts and moved.dtype != t.dtype else moved

        return super()._apply(keeping_dtypes, recurse)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"{self.scheme.describe()}, {type(self.method).__name__}")


class QuantizedExperts(QuantizedLinear):
    """A mixture of experts' stacked projections, [E * rows, K] (ferrum.models.layers.moe), stored quantized
    as one weight: every part's rows are the experts' rows, and a row is quantized on its own, so expert
    e's rows of the storage are its weight quantized. It keeps the loader's layout (prepare() repacks
    nothing: the GPU's per-pair expert kernels read it as it lies) and gives one expert's rows dequantized
    to the plain path (`rows_dequantized`)."""

    def prepare(self) -> None:
        """Nothing: the stack stays in the loader's layout."""

    def rows_dequantized(self, start: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Rows [start, end) of the weight, dequantized to `dtype`."""
        return dequantize(self.storage().rows(start, end), dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise TypeError("a stack of experts is read expert by expert (ferrum.models.layers.moe), not as one layer")

