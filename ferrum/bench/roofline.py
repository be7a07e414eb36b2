"""The per-step roofline of a benchmark run: the least time the run's steps could take on this device.

Each forward pass of the engine (a step; a greedy burst's every decode iteration) must at least do
its FLOPs at the device's peak matmul rate or move its bytes at its copy bandwidth, whichever takes
longer:

    FLOPs  2 x the body's linear weights a token uses x the pass's tokens (a mixture of experts' layer:
           the router and its top k experts, the shared expert), 2 x the head x its sequences, and
           4 x num_heads x head_dim x layers for each cached key a token's attention reads (QK^T, PV)
    bytes  the weights one pass reads (as stored: quantized bytes where quantized; the head, not the
           embedding table, which a pass reads a row of; of a mixture of experts' experts, those the
           pass's tokens pick: with routing spread evenly, E (1 - (1 - k/E)^tokens) of the E per layer,
           the expected number), each sequence's whole KV cache read once, and the pass's new tokens'
           KV written

The roofline is the sum over the passes of max(FLOPs / peak, bytes / bandwidth). Activations, norms,
sampling and the host are left out: they are part of what the measured time spends above it. The
peak and the bandwidth are measured on the device at the start of the benchmark (`measure_peaks`):
a large square matmul in the serving dtype, and a device-to-device copy (bytes read plus written).
With tensor parallelism the one device's peaks are multiplied by the ranks (each rank runs its share).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from ferrum.engine.observer import StepRecord
from ferrum.models.config import ModelConfig


@dataclass(frozen=True)
class DevicePeaks:
    matmul_flops: float  # FLOP/s of a large square matmul in the serving dtype
    bandwidth: float  # bytes/s of a device-to-device copy, read plus written

    def describe(self) -> str:
        return f"{self.matmul_flops / 1e12:.1f} TFLOP/s, {self.bandwidth / 1e9:.0f} GB/s"


def measure_peaks(device: torch.device, dtype: torch.dtype) -> DevicePeaks:
    """The best of a few timings of an n x n x n matmul (n 8192 on a GPU, 2048 on the CPU) and of a copy
    (1 GiB on a GPU, 256 MiB on the CPU)."""
    gpu = device.type != "cpu"
    n = 8192 if gpu else 2048
    copy_bytes = (1 << 30) if gpu else (256 << 20)
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    t_mm = _best(lambda: torch.mm(a, b), device, 5 if gpu else 3)
    src = torch.ones(copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    t_copy = _best(lambda: dst.copy_(src), device, 10 if gpu else 3)
    return DevicePeaks(matmul_flops=2 * n**3 / t_mm, bandwidth=2 * copy_bytes / t_copy)


def _best(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    """The least of `repeats` timings of `run` (after one untimed), the device synchronized around each."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    run()
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        sync()
        times.append(time.perf_counter() - start)
    return min(times)


@dataclass(frozen=True)
class ModelCost:
    """What one forward pass costs per token, per sequence and per cached key."""

    linear_flops_per_token: float  # 2 x the body's linear weights
    head_flops_per_seq: float  # 2 x vocab x hidden
    attention_flops_per_key: float  # 4 x num_heads x head_dim x layers
    weight_bytes_per_pass: float  # every weight a pass reads, as stored (a mixture's experts apart)
    kv_bytes_per_token: float  # k and v of every layer, every rank
    expert_bytes: float = 0.0  # a mixture of experts: one expert's weights in every sparse layer
    num_experts: int = 0
    top_k: int = 0

    def expert_bytes_read(self, tokens: int) -> float:
        """The expected bytes of the experts a pass of `tokens` tokens picks (0 for a dense model)."""
        if not self.num_experts:
            return 0.0
        return self.expert_bytes * self.num_experts * (1.0 - (1.0 - self.top_k / self.num_experts) ** tokens)

    @classmethod
    def of(cls, config: ModelConfig, weight_bytes: int, embedding_itemsize: int, kv_bytes_per_token: int,
           experts_bytes: int | None = None) -> ModelCost:
        """`weight_bytes`: the model's weights as stored, every rank summed; an untied embedding table
        is taken out (a pass reads only its tokens' rows). `experts_bytes`: a mixture's expert stacks as
        stored, every rank summed (None: in `embedding_itemsize`, the serving dtype)."""
        h, layers = config.hidden_size, config.num_layers
        attention = h * (config.q_size + 2 * config.kv_size) + config.q_size * h
        moe = config.moe
        sparse = len(moe.sparse_layers) if moe is not None else 0
        linear = float(attention * layers + 3 * h * config.intermediate_size * (layers - sparse))
        expert = 0.0
        if moe is not None:
            expert = 3.0 * h * moe.intermediate_size * sparse  # one expert, every sparse layer
            linear += sparse * (h * moe.num_experts + 3 * h * moe.shared_intermediate_size) + moe.top_k * expert
        embedding = config.vocab_size * h * embedding_itemsize
        experts_stored = expert * embedding_itemsize * (moe.num_experts if moe is not None else 0)
        if experts_bytes is not None and moe is not None:
            experts_stored = float(experts_bytes)
        return cls(
            linear_flops_per_token=2.0 * linear,
            head_flops_per_seq=2.0 * config.vocab_size * h,
            attention_flops_per_key=4.0 * config.num_heads * config.head_dim * layers,
            weight_bytes_per_pass=float(weight_bytes - experts_stored
                                        - (0 if config.tie_word_embeddings else embedding)),
            kv_bytes_per_token=float(kv_bytes_per_token),
            expert_bytes=experts_stored / moe.num_experts if moe is not None else 0.0,
            num_experts=moe.num_experts if moe is not None else 0,
            top_k=moe.top_k if moe is not None else 0,
        )


@dataclass
class Roofline:
    """Sums the passes of the steps it is given (an engine observer: `engine.add_observer(roofline.add)`)."""

    cost: ModelCost
    peaks: DevicePeaks
    seconds: float = 0.0
    flops: float = 0.0
    bytes: float = 0.0
    passes: int = 0
    compute_bound: int = 0  # passes whose FLOPs take longer than their bytes
    by_kind: dict[str, float] = field(default_factory=dict)  # roofline seconds per step kind

    def add(self, record: StepRecord) -> None:
        c = self.cost
        for j in range(record.iterations):  # a burst's iteration j: every sequence j tokens further on
            ahead = j * record.num_seqs
            flops = (c.linear_flops_per_token * record.num_tokens + c.head_flops_per_seq * record.num_seqs
                     + c.attention_flops_per_key * (record.attended_keys + ahead))
            moved = (c.weight_bytes_per_pass + c.expert_bytes_read(record.num_tokens)
                     + c.kv_bytes_per_token * (record.cached_tokens + ahead + 2 * record.num_tokens))
            t_flops, t_bytes = flops / self.peaks.matmul_flops, moved / self.peaks.bandwidth
            self.seconds += max(t_flops, t_bytes)
            self.by_kind[record.kind] = self.by_kind.get(record.kind, 0.0) + max(t_flops, t_bytes)
            self.flops += flops
            self.bytes += moved
            self.passes += 1
            self.compute_bound += t_flops > t_bytes

    def fraction(self, elapsed_s: float) -> float:
        """The roofline's share of the measured time (1.0: the run took no longer than its bound)."""
        return self.seconds / elapsed_s if elapsed_s > 0 else 0.0


@dataclass(frozen=True)
class RooflineReport:
    """A run's roofline beside its measured time."""

    peak_tflops: float
    bandwidth_gbs: float
    seconds: float
    fraction: float  # roofline / measured elapsed
    passes: int
    compute_bound_passes: int
    seconds_by_kind: dict[str, float]

    @classmethod
    def of(cls, roofline: Roofline, elapsed_s: float) -> RooflineReport:
        return cls(roofline.peaks.matmul_flops / 1e12, roofline.peaks.bandwidth / 1e9, roofline.seconds,
                   roofline.fraction(elapsed_s), roofline.passes, roofline.compute_bound,
                   dict(sorted(roofline.by_kind.items())))
