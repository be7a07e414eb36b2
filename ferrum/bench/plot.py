"""`--plot FILE.png`: latency percentiles and output throughput against concurrency."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ferrum.bench.errors import BenchError
from ferrum.bench.metrics import Distribution, LevelResult


class PlotUnavailableError(BenchError):
    """matplotlib is not installed."""


def require_matplotlib() -> Any:
    """matplotlib.pyplot on the Agg backend; PlotUnavailableError saying how to install it."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        raise PlotUnavailableError(
            "--plot needs matplotlib: pip install 'ferrum[bench]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(results: Sequence[LevelResult], pick: str) -> tuple[list[float], list[float], list[float]]:
    """Concurrency, median and p99 (ms) of the levels that have samples of metric `pick`."""
    xs: list[float] = []
    medians: list[float] = []
    p99s: list[float] = []
    for r in results:
        d: Distribution = getattr(r, pick)
        if d.median_ms is not None and d.p99_ms is not None:
            xs.append(r.concurrency)
            medians.append(d.median_ms)
            p99s.append(d.p99_ms)
    return xs, medians, p99s


def plot_levels(results: Sequence[LevelResult], path: str | Path, title: str) -> None:
    """Four panels (TTFT, TPOT, ITL: median and p99; output tokens/s), concurrency on a log2 axis."""
    plt = require_matplotlib()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8), constrained_layout=True)
    panels = (("ttft", "TTFT (ms)"), ("tpot", "TPOT (ms)"), ("itl", "ITL (ms)"))
    for ax, (pick, label) in zip(axes.flat, panels, strict=False):
        xs, medians, p99s = _series(results, pick)
        ax.plot(xs, medians, marker="o", label="median")
        ax.plot(xs, p99s, marker="s", linestyle="--", label="p99")
        ax.set_ylabel(label)
        ax.legend()
    throughput = axes.flat[3]
    throughput.plot([r.concurrency for r in results], [r.output_throughput for r in results], marker="o",
                    color="tab:green")
    throughput.set_ylabel("output tokens/s")
    for ax in axes.flat:
        ax.set_xlabel("concurrency")
        if len({r.concurrency for r in results}) > 1:
            ax.set_xscale("log", base=2)
        ax.set_xticks([r.concurrency for r in results], [str(r.concurrency) for r in results])
        ax.minorticks_off()
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path, dpi=100)
    plt.close(fig)
