"""Full precision to a QuantizedTensor and back. Data-free (from the weight alone): int8 scales each
row by its absmax, fp8 searches each row's scale over one octave, int4 fits each group's scale and zero
(_fit_int4). `quantize` computes in float32 on whatever device the weight is on (the loader hands it
the weight on the model's device where that is a GPU). A `QuantizeKernel` may stand in for it where
it runs the same algorithm faster (the CPU kernels' int4 fit: ferrum.models.layers.ops)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from ferrum.weights.quantization.scheme import SUPER_GROUPS, QuantScheme
from ferrum.weights.quantization.tensor import QuantizedTensor

__all__ = ["FP8_MAX", "QuantizeKernel", "dequantize", "quantize"]

# (weight [N, K], scheme) -> the bundle's parts, computed as quantize() computes them (within the rounding
# of sums taken in another order), or None for a scheme, shape or device it does not run
QuantizeKernel = Callable[[torch.Tensor, QuantScheme], "dict[str, torch.Tensor] | None"]

FP8_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
_TINY = 1e-10
_BLOCK_ELEMENTS = 1 << 22  # weight elements quantized at a time (16 MiB per float32 temporary; int4 holds ~12)


def quantize(weight: torch.Tensor, scheme: QuantScheme, kernel: QuantizeKernel | None = None) -> QuantizedTensor:
    """`weight` [N, K] (floating) in `scheme`'s layout; the bundle remembers weight.dtype. Rows are
    quantized a block at a time, so the float32 temporaries stay small whatever the weight's size
    (the loader quantizes many weights at once); or by `kernel`, where it takes the scheme."""
    if weight.dim() != 2 or not weight.is_floating_point():
        raise ValueError(f"quantize: needs a floating [N, K] weight, got {tuple(weight.shape)} {weight.dtype}")
    n, k = weight.shape
    if scheme.offsets:
        raise ValueError("quantize: int8 with zeros per group is a published format (GGUF's Q5_1 / Q5_K), not "
                         "quantized on load")
    if scheme.grouped:
        scheme.check_in_features(k, "quantize")  # even K; the last group may be shorter than group_size
    parts = kernel(weight, scheme) if kernel is not None else None
    if parts is not None:
        out = QuantizedTensor(scheme, (n, k), weight.dtype, parts)
        problems = out.layout_problems()
        if problems:
            raise ValueError(f"quantize: the kernel's parts for {scheme.describe()}: {'; '.join(problems)}")
        return out
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
    if scheme.per_group:  # int8 / fp8 with a scale per group: each group as a row of its own
        g, groups = scheme.group_size, scheme.groups(k)
        padded = torch.nn.functional.pad(w, (0, groups * g - k)).reshape(n * groups, g)
        rows = _quantize_rows(padded, QuantScheme(scheme.method))
        return {"qweight": rows["qweight"].reshape(n, groups * g)[:, :k], "scale": rows["scale"].reshape(n, groups)}
    if scheme.method == "int8":
        scale = w.abs().amax(dim=1).clamp_min(_TINY) / 127.0
        return {"qweight": (w / scale[:, None]).round_().clamp_(-127, 127).to(torch.int8), "scale": scale}
    if scheme.method == "fp8":
        scale = _fp8_scale(w)
        return {"qweight": (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), "scale": scale}
    g, groups = scheme.group_size, scheme.groups(k)
    valid = None
    if groups * g != k:  # a ragged last group: filled up with its own last input, left out of every sum
        w = torch.cat((w, w[:, -1:].expand(n, groups * g - k)), dim=1)
        valid = (torch.arange(groups * g, device=w.device) < k).float().reshape(1, groups, g)
    grouped = w.reshape(n, groups, g)
    scale, lo = _fit_int4(grouped, valid, scheme.symmetric)
    # stored in the params' dtype (a scale never rounded to 0): quantized against the stored scale and zero
    params = scheme.params or weight.dtype
    scale_s = scale.to(params).clamp_min(torch.finfo(params).tiny)
    zero_s = torch.zeros_like(scale_s) if scheme.symmetric else (lo + 8.0 * scale).to(params)
    q = ((grouped - zero_s.float()[..., None]) / scale_s.float()[..., None]).round_().add_(8).clamp_(0, 15)
    q8 = q.reshape(n, groups * g)[:, :k].to(torch.uint8)
    return {"qweight": q8[:, 0::2] | (q8[:, 1::2] << 4), "scale": scale_s, "zero": zero_s}


# fp8: per row, the scale amax / 448 * c with the least squared error (c over one octave: e4m3's grid repeats)
_FP8_SCALE_STEPS = tuple(2.0 ** (i / 8) for i in range(8))


def _fp8_scale(w: torch.Tensor) -> torch.Tensor:
    """Per row of `w` [n, K] (float32), the scale of _FP8_SCALE_STEPS whose e4m3 rounding is closest."""
    amax = w.abs().amax(dim=1).clamp_min(_TINY) / FP8_MAX
    best: tuple[torch.Tensor, torch.Tensor] | None = None  # scale, squared error
    for step in _FP8_SCALE_STEPS:
        scale = amax * step
        scaled = (w / scale[:, None]).clamp_(-FP8_MAX, FP8_MAX)  # as _quantize_rows will
        miss = scaled.to(torch.float8_e4m3fn).float().sub_(scaled)
        err = miss.square_().sum(dim=1) * scale.square()
        if best is None:
            best = (scale, err)
        else:
            better = err < best[1]
            best = (torch.where(better, scale, best[0]), torch.where(better, err, best[1]))
    assert best is not None
    return best[0]


# int4: starting ranges (the group's min..max over 15 + r steps, centred), refined together, and the rounds
_INT4_STARTS = (0.0, 1.0, 2.0)
_INT4_ROUNDS = 3


def _fit_int4(x: torch.Tensor, valid: torch.Tensor | None, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's (scale, lo) [n, G], w ~ lo + q * scale with q in 0..15, for `x` [n, G, g] (float32;
    inputs where `valid` [1, G, g] is 0 are padding). Data-free, as llama.cpp's make_qkx quantizers: from
    each start, alternate rounding to nearest with the least-squares scale under the weights rms + |w|
    (large weights matter more), keeping the (scale, lo) of least weighted squared error. Asymmetric:
    lo makes the group's mean error 0 (activations carry a large common component: an error shared by
    a group's inputs adds up); symmetric: lo = -8 * scale (zero 0). The starts run side by side (a
    leading dim of len(_INT4_STARTS)): fewer, larger operations."""
    count = torch.full((1, x.shape[1]), float(x.shape[2]), device=x.device) if valid is None else valid.sum(dim=2)
    kept = x if valid is None else x * valid
    mean = kept.sum(dim=2) / count
    importance = kept.square().sum(dim=2).div_(count).sqrt_()[..., None] + x.abs()  # rms + |w|
    if valid is not None:
        importance.mul_(valid)
    lo0, hi0 = x.amin(dim=2), x.amax(dim=2)  # the padding repeats a group's own input
    if symmetric:  # the smallest scale that puts the group's min at >= -8, its max at <= 7
        span, centred = torch.maximum(lo0 / -8.0, hi0 / 7.0) * 15.0, x
    else:
        span, centred = hi0 - lo0, x - mean[..., None]
    weighted = importance * centred
    total = (weighted * centred).sum(dim=2)  # sum of importance * centred^2: the error of scale 0
    steps = torch.tensor(_INT4_STARTS, device=x.device).add_(15.0)[:, None, None]
    scale = (span / steps).clamp_min(_TINY)  # [starts, n, G]
    lo = -8.0 * scale if symmetric else (hi0 + lo0) / 2 - 7.5 * scale
    best: tuple[torch.Tensor, ...] | None = None  # scale, lo, weighted squared error
    for _ in range(_INT4_ROUNDS):
        q = torch.addcmul((-lo / scale)[..., None], x, (1.0 / scale)[..., None]).round_().clamp_(0, 15)
        # for these q, the least-squares scale (asymmetric: with lo = mean(w) - scale * mean(q)) and its error
        q_mean = torch.full_like(scale, 8.0) if symmetric else (q if valid is None else q * valid).sum(3) / count
        dev = q.sub_(q_mean[..., None])
        spread = (dev * importance).mul_(dev).sum(dim=3)
        cross = dev.mul_(weighted).sum(dim=3)  # (in place: the largest temporaries are q and one more)
        scale = torch.where(cross > 0, cross / spread.clamp_min(_TINY), scale)
        lo = -8.0 * scale if symmetric else mean - scale * q_mean
        err = (total - cross.clamp_min(0.0) * scale).clamp_min_(0.0)  # of this scale and lo with these q
        if best is None:
            best = (scale, lo, err)
        else:
            better = err < best[2]
            best = tuple(torch.where(better, new, old) for new, old in zip((scale, lo, err), best, strict=True))
    assert best is not None
    pick = best[2].argmin(dim=0, keepdim=True)  # the first start of least error
    scale, lo = best[0].gather(0, pick)[0], best[1].gather(0, pick)[0]
    if not symmetric:  # the mean error of the final rounding to 0
        q = ((x - lo[..., None]) / scale[..., None]).round_().clamp_(0, 15)
        residual = x - torch.addcmul(lo[..., None], q, scale[..., None])
        lo = lo + (residual if valid is None else residual * valid).sum(dim=2) / count
    return scale, lo


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> the values 0..15 as uint8 [N, K] (inputs 2j and 2j + 1 from byte j)."""
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


def int4_factors(qt: QuantizedTensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An int4 bundle's (scale, zero) per group, [N, groups], w = (q - 8) * scale + zero: as stored, or
    from Q4_K's sub-scales (float32: scale = d * sc exactly, zero = 8 * scale - dmin * m rounded once, as
    the kernels compute them)."""
    if not qt.scheme.sub_scales:
        return qt.parts["scale"], qt.parts["zero"]
    sub, factors = qt.parts["sub_scales"].float(), qt.parts["super_scales"].float()
    groups = sub.shape[1]
    per_group = factors.repeat_interleave(SUPER_GROUPS, dim=1)[:, :groups]
    scale = per_group[..., 0] * sub[..., 0]
    return scale, 8.0 * scale - per_group[..., 1] * sub[..., 1]


def dequantize(qt: QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The weight the bundle stands for, [N, K] in `dtype` (default: the bundle's own)."""
    dtype = dtype or qt.dtype
    if qt.scheme.method == "int4":
        scale, zero = (t.float().repeat_interleave(qt.scheme.group_size, dim=1)[:, :qt.shape[1]]
                       for t in int4_factors(qt))  # input k's group is k // g (the last one may be ragged)
        return ((unpack_int4(qt.parts["qweight"]).float() - 8.0) * scale + zero).to(dtype)
    q, scale = qt.parts["qweight"], qt.parts["scale"].float()
    g, k = qt.scheme.group_size, qt.shape[1]  # int8, fp8
    per = scale.repeat_interleave(g, dim=1)[:, :k] if qt.scheme.per_group else scale[:, None]
    if qt.scheme.offsets:
        return (q.float() * per + qt.parts["zero"].float().repeat_interleave(g, dim=1)[:, :k]).to(dtype)
    return (q.float() * per).to(dtype)
