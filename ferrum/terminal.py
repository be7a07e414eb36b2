"""Drawing one progress line on a terminal (weight downloads, benchmarks)."""

from __future__ import annotations

import shutil
from typing import TextIO


def is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def draw_bar(stream: TextIO, label: str, fraction: float, tail: str) -> None:
    """Redraws `label |████    | tail` in place, as wide as the terminal."""
    width = shutil.get_terminal_size((100, 20)).columns
    bar_width = max(width - len(label) - len(tail) - 4, 10)
    filled = int(bar_width * min(max(fraction, 0.0), 1.0))
    stream.write(f"\r{label} |{'█' * filled}{' ' * (bar_width - filled)}|{tail}")
    stream.flush()
