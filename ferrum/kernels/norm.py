"""RMSNorm (of x, or of x + residual, which is also returned) and silu(gate) * up, in HF's bf16 order of
operations: reductions in float32, results rounded to the activation dtype where HF rounds them."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X: tl.tensor, R: tl.tensor, W: tl.tensor, OUT: tl.tensor, ROUT: tl.tensor,
                     stride_x: tl.tensor, stride_r: tl.tensor, stride_o: tl.tensor, stride_ro: tl.tensor,
                     n: tl.tensor, eps: tl.tensor, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr) -> None:
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(OUT.dtype.element_ty)  # HF adds residuals in the activation dtype
        tl.store(ROUT + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
    normed = (xf * rstd).to(OUT.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (w * normed).to(OUT.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of x (or of x + residual, which is also returned as the new residual)."""
    rows, n = x.shape
    out = torch.empty_like(x)
    rout = torch.empty_like(x) if residual is not None else None
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, rout if rout is not None else out,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        rout.stride(0) if rout is not None else 0, n, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=8 if block >= 4096 else 4,
    )
    return out, rout


@triton.jit
def _silu_and_mul_kernel(X: tl.tensor, OUT: tl.tensor, stride_x: tl.tensor, stride_o: tl.tensor, n: tl.tensor,
                         BLOCK: tl.constexpr) -> None:
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (act * u).to(OUT.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * n] (gate then up) -> silu(gate) * up: [T, n]."""
    rows, n2 = x.shape
    n = n2 // 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block = 1024
    _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block)
    return out
