"""`LayerOps`: the norm and activation ops layers call, chosen once from the `Device`.

torch    the plain PyTorch ops, in HF's order of operations (every device)
triton   ferrum.kernels.norm: one kernel for the residual add + RMSNorm, one for silu * mul
         (devices Triton compiles for; in tests, Triton's interpreter on the CPU)
cpu      ferrum.kernels.cpu's C++ ops, the same two fused, in the torch path's order of operations
         (the CPU, once its kernels are built: ferrum.kernels.cpu.build)

and the kernel, if any, that quantizes layers on load for them (`quantize`: the CPU kernels' int4 fit,
the arithmetic of ferrum.weights.quantization.arith a group at a time in one pass, about 15x faster
than torch's ops on 2 cores; None: arith's own torch ops).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ferrum.backends.device import Device
from ferrum.weights.quantization.arith import QuantizeKernel
from ferrum.weights.quantization.scheme import QuantScheme

NormFn = Callable[[torch.Tensor, torch.Tensor, float, "torch.Tensor | None"], tuple[torch.Tensor, torch.Tensor]]
GatedActivationFn = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LayerOps:
    name: str
    rms_norm: NormFn  # (x, weight, eps, residual) -> (norm of x [+ residual], x [+ residual])
    silu_and_mul: GatedActivationFn  # [T, 2n] gate then up -> silu(gate) * up [T, n]
    quantize: QuantizeKernel | None = None  # quantization on load (None: ferrum.weights.quantization.arith's)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's order of operations, in float32; torch's fused rms_norm accumulates in bf16 on the CPU,
    which the large activations of real checkpoints do not survive."""
    dtype = x.dtype
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(dtype)


def _torch_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    if residual is not None:
        x = x + residual
    return rms_norm_reference(x, weight, eps), x


def _torch_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def torch_ops() -> LayerOps:
    return LayerOps("torch", _torch_rms_norm, _torch_silu_and_mul)


def triton_ops() -> LayerOps:
    from ferrum.kernels import norm

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        normed, summed = norm.rms_norm(x, weight, eps, residual)
        return normed, x if summed is None else summed

    return LayerOps("triton", rms_norm, norm.silu_and_mul)


def cpu_ops() -> LayerOps:
    """The CPU kernels' ops (torch.ops.ferrum_cpu: loaded by ferrum.kernels.cpu.build first)."""

    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        normed, summed = torch.ops.ferrum_cpu.rms_norm(x, weight, eps, residual)
        return normed, summed

    def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.ferrum_cpu.silu_and_mul(gate_up)
        return out

    return LayerOps("cpu", rms_norm, silu_and_mul, cpu_int4_fit)


def cpu_int4_fit(weight: torch.Tensor, scheme: QuantScheme) -> dict[str, torch.Tensor] | None:
    """int4 on load through the CPU kernels (torch.ops.ferrum_cpu.int4_fit): a weight on the CPU whose
    in-features are whole groups, its scales in a 16- or 32-bit float; None for anything else."""
    params = scheme.params or weight.dtype
    if (scheme.method != "int4" or weight.device.type != "cpu" or weight.shape[1] % scheme.group_size
            or params not in (torch.float32, torch.bfloat16, torch.float16)):
        return None
    qweight, scale, zero = torch.ops.ferrum_cpu.int4_fit(weight, scheme.group_size, scheme.symmetric, params)
    return {"qweight": qweight, "scale": scale, "zero": zero}


def layer_ops(device: Device, cpu_kernels: bool = False) -> LayerOps:
    """Triton's kernels where they compile for the device, the CPU kernels where they are loaded
    (`cpu_kernels`), torch elsewhere."""
    if device.triton:
        return triton_ops()
    return cpu_ops() if cpu_kernels and device.kind == "cpu" else torch_ops()
