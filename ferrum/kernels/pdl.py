"""Programmatic dependent launch (PDL), on Hopper and later: each kernel of a decode step is
launched while the one before it still runs. It issues the loads that do not depend on that kernel
(its weights, the older KV cache), then waits for it (griddepcontrol.wait: the earlier kernel
complete, its writes visible) before reading or writing anything else, so that the launch latency
and the first weight loads hide behind the previous kernel's tail. Whether a kernel is launched so
is the caller's choice (`KernelConfig.pdl` on a `Device` that has it), passed as `pdl`.
"""

from __future__ import annotations

from typing import Any

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


def pdl_launch(pdl: bool) -> dict[str, Any]:
    """Extra launch arguments for a kernel whose programs call pdl_wait(PDL=pdl_mode(pdl))."""
    return {"launch_pdl": True} if pdl else {}


def pdl_mode(pdl: bool) -> int:
    """The kernels' PDL constant: 1 lets the next kernel launch once every program of this one has
    issued its early loads; 0 is a plain launch."""
    return 1 if pdl else 0


@triton.jit
def pdl_wait(PDL: tl.constexpr) -> None:
    """Called once by every program of a kernel launched with pdl_launch, after the loads that do
    not depend on the kernel before and before anything that does."""
    if PDL == 1:
        gdc_launch_dependents()
    if PDL > 0:
        gdc_wait()
