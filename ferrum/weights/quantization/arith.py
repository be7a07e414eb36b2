"""Full precision to a QuantizedTensor and back. `quantize` computes in float32 on whatever device
the weight is on (the loader hands it the weight on the model's device where that is a GPU)."""

from __future__ import annotations

import torch

from ferrum.weights.quantization.scheme import QuantScheme
from ferrum.weights.quantization.tensor import QuantizedTensor

__all__ = ["FP8_MAX", "dequantize", "quantize"]

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
_TINY = 1e-10
_BLOCK_ELEMENTS = 1 << 22  # weight elements quantized at a time (16 MiB per float32 temporary)


def quantize(weight: torch.Tensor, scheme: QuantScheme) -> QuantizedTensor:
    """`weight` [N, K] (floating) in `scheme`'s layout; the bundle remembers weight.dtype. Rows are
    quantized a block at a time, so the float32 temporaries stay small whatever the weight's size
    (the loader quantizes many weights at once)."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize: needs a floating [N, K] weight, got {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    if scheme.grouped:
        scheme.check_in_features(k, "quantize")  # even K; the last group may be shorter than group_size
    out = QuantizedTensor.empty(scheme, n, k, weight.dtype, device=weight.device)
    rows = max(1, _BLOCK_ELEMENTS // max(k, 1))
    for start in range(0, n, rows):
        block = _quantize_rows(weight[start : start + rows], scheme)
        for name, part in block.items():
            out.parts[name][start : start + rows] = part
    return out


def _quantize_rows(weight: torch.Tensor, scheme: QuantScheme) -> dict[str, torch.Tensor]:
    """The parts of rows of a weight (every part is per row: blocks of rows quantize alone)."""
    n, k = weight.shape
    w = weight.float()
    if scheme.method in ("int8", "fp8"):
        amax = w.abs().amax(dim=1).clamp_min(_TINY)
        if scheme.method == "int8":
            scale = amax / 127.0
            q = (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8)
        else:
            scale = amax / FP8_MAX
            q = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return {"qweight": q, "scale": scale}
    g, groups = scheme.group_size, scheme.groups(k)
    if groups * g != k:  # a ragged last group: filled up with its own last input, so its min and max stay its own
        w = torch.cat((w, w[:, -1:].expand(n, groups * g - k)), dim=1)
    grouped = w.reshape(n, groups, g)
    if scheme.symmetric:  # q - 8 in -8..7: the smallest scale that puts the group's min at >= -8, its max at <= 7
        scale = torch.maximum(grouped.amin(dim=2) / -8.0, grouped.amax(dim=2) / 7.0).clamp_min(_TINY)
        zero = torch.zeros_like(scale)
    else:  # min..max onto 0..15; the zero is the value of q = 8
        lo, hi = grouped.amin(dim=2), grouped.amax(dim=2)
        scale = ((hi - lo) / 15.0).clamp_min(_TINY)
        zero = lo + 8.0 * scale
    # stored in the weight's dtype (a scale never rounded to 0): quantized against the stored scale and zero
    scale_s = scale.to(weight.dtype).clamp_min(torch.finfo(weight.dtype).tiny)
    zero_s = zero.to(weight.dtype)
    q = ((grouped - zero_s.float()[..., None]) / scale_s.float()[..., None]).round_().add_(8).clamp_(0, 15)
    q8 = q.reshape(n, groups * g)[:, :k].to(torch.uint8)
    return {"qweight": q8[:, 0::2] | (q8[:, 1::2] << 4), "scale": scale_s, "zero": zero_s}


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> the values 0..15 as uint8 [N, K] (inputs 2j and 2j + 1 from byte j)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def dequantize(qt: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The weight the bundle stands for, [N, K] in `dtype` (default: the bundle's own)."""
    dtype = dtype or qt.dtype
    q, scale = qt.parts["qweight"], qt.parts["scale"].float()
    if qt.scheme.method in ("int8", "fp8"):
        return (q.float() * scale[:, None]).to(dtype)
    g, k = qt.scheme.group_size, qt.shape[1]
    scale = scale.repeat_interleave(g, dim=1)[:, :k]  # input k's group is k // g (the last one may be ragged)
    zero = qt.parts["zero"].float().repeat_interleave(g, dim=1)[:, :k]
    return ((unpack_int4(q).float() - 8.0) * scale + zero).to(dtype)
