"""A readable name for the device a benchmark ran on."""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def device_name(device: str) -> str:
    """e.g. "NVIDIA H100 80GB HBM3" for cuda:0, or the CPU's model name and torch's thread count."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    if device.startswith("cpu"):
        return f"{_cpu_model()} ({torch.get_num_threads()} threads)"
    return device


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"
