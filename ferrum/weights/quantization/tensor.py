"""`QuantizedTensor`: the typed bundle one weight [N, K] becomes, its parts by name:

    int8   qweight int8 [N, K]             scale float32 [N] (per_group: [N, ceil(K/g)]; offsets: zero too)
    fp8    qweight float8_e4m3fn [N, K]    scale float32 [N] (per_group: [N, ceil(K/g)])
           static_input: input_scale float32 [N], each row its checkpoint tensor's activation scale (a fused
           layer's parts may differ: the layer's activations take their largest)
    int4   qweight uint8 [N, K/2]          scale, zero [N, ceil(K/g)] (in scheme.params, else the weight's dtype)
           byte j of a row holds input 2j in its low nibble and input 2j + 1 in its high nibble;
           input k is in group k // g (the last group holds K - (groups - 1) * g inputs)
           sub_scales: sub_scales uint8 [N, ceil(K/32), 2] (sc, m) and super_scales float32
           [N, ceil(K/256), 2] (d, dmin) in place of scale and zero

Every part's first dimension is the output channel, so rows [a, b) of the weight are rows [a, b)
of every part (a fused q/k/v projection is filled one checkpoint tensor at a time), and a group
never spans two rows.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

import torch

from ferrum.weights.quantization.scheme import QuantScheme

__all__ = ["QuantizedTensor", "part_layout"]


def part_layout(
    scheme: QuantScheme, n: int, k: int, dtype: torch.dtype
) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The parts (name -> (shape, dtype)) that a [n, k] weight of `dtype` is stored as."""
    scales = (n, scheme.groups(k)) if scheme.per_group else (n,)
    if scheme.method == "int8" and scheme.offsets:
        return {"qweight": ((n, k), torch.int8), "scale": (scales, torch.float32), "zero": (scales, torch.float32)}
    if scheme.method == "int8":
        return {"qweight": ((n, k), torch.int8), "scale": (scales, torch.float32)}
    if scheme.method == "fp8" and scheme.static_input:
        return {"qweight": ((n, k), torch.float8_e4m3fn), "scale": (scales, torch.float32),
                "input_scale": ((n,), torch.float32)}
    if scheme.method == "fp8":
        return {"qweight": ((n, k), torch.float8_e4m3fn), "scale": (scales, torch.float32)}
    groups, params = scheme.groups(k), scheme.params or dtype
    if scheme.sub_scales:
        return {"qweight": ((n, k // 2), torch.uint8), "sub_scales": ((n, groups, 2), torch.uint8),
                "super_scales": ((n, scheme.supers(k), 2), torch.float32)}
    return {"qweight": ((n, k // 2), torch.uint8), "scale": ((n, groups), params), "zero": ((n, groups), params)}


@dataclass(frozen=True)
class QuantizedTensor:
    """A [N, K] weight of `dtype`, stored as `parts` in `scheme`'s layout (see part_layout)."""

    scheme: QuantScheme
    shape: tuple[int, int]
    dtype: torch.dtype  # the full-precision dtype it stands for: dequantize() gives it
    parts: Mapping[str, torch.Tensor]

    def __post_init__(self) -> None:
        object.__setattr__(self, "parts", MappingProxyType(dict(self.parts)))

    @classmethod
    def empty(cls, scheme: QuantScheme, n: int, k: int, dtype: torch.dtype,
              device: torch.device | str = "cpu") -> QuantizedTensor:
        parts = {name: torch.empty(shape, dtype=dt, device=device)
                 for name, (shape, dt) in part_layout(scheme, n, k, dtype).items()}
        return cls(scheme, (n, k), dtype, parts)

    def rows(self, start: int, end: int) -> QuantizedTensor:
        """Rows [start, end) of the weight: views of the same rows of every part."""
        return QuantizedTensor(self.scheme, (end - start, self.shape[1]), self.dtype,
                               {name: part[start:end] for name, part in self.parts.items()})

    def to(self, device: torch.device | str) -> QuantizedTensor:
        return QuantizedTensor(self.scheme, self.shape, self.dtype,
                               {name: part.to(device) for name, part in self.parts.items()})

    @property
    def device(self) -> torch.device:
        return self.parts["qweight"].device

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parts.values())

    def layout_problems(self) -> list[str]:
        """How the parts differ from the scheme's layout for this shape (empty: they match)."""
        expected = part_layout(self.scheme, self.shape[0], self.shape[1], self.dtype)
        problems = []
        for name, (shape, dtype) in expected.items():
            part = self.parts.get(name)
            if part is None:
                problems.append(f"part {name!r} missing")
            elif tuple(part.shape) != shape or part.dtype != dtype:
                problems.append(f"part {name!r} is {tuple(part.shape)} {part.dtype}, expected {shape} {dtype}")
        problems += [f"unexpected part {name!r}" for name in self.parts if name not in expected]
        return problems
