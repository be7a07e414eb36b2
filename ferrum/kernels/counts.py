"""The counts a kernel's programs take when done, so that the last of them can finish the launch's work
(the router's top k after its logits' slices, a split-K tile's sum): one int32 buffer a device, zeros
between launches. Each kernel that counts sets the counts it used back to 0 before it ends, and a
device's launches run one after another on the engine's stream, so every kernel may use it from index 0.
Allocated at the device's first such launch (a warm-up, before any CUDA graph is captured)."""

from __future__ import annotations

import torch

COUNTS = 1 << 16  # the most counts one launch may take (256 KiB a device)
_COUNTS: dict[torch.device, torch.Tensor] = {}


def done_counts(device: torch.device) -> torch.Tensor:
    """The device's COUNTS int32 counts, zeros between launches."""
    counts = _COUNTS.get(device)
    if counts is None:
        counts = _COUNTS[device] = torch.zeros(COUNTS, dtype=torch.int32, device=device)
    return counts
