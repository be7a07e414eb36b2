"""How the Triton kernels are set up: a typed part of the engine's configuration (`engine.kernels`
in YAML). Nothing here imports triton.

The defaults were measured on one NVIDIA H100 (benchmarks/gpu.md): whole decode graphs of the
Llama-3.2-1B and Llama-3.1-8B shapes replayed with and without each setting.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal


@dataclass(frozen=True)
class GemvTable:
    """How the fused decode projections (batches of 1-4 rows) slice their weights.

    Each program owns `features_per_program` output features. At one row, a projection with the
    RMSNorm fused in reads all of K in one slice up to `whole_k_with_norm` (so that the norm is
    applied to the whole row first, in HF's order); without a norm all of K up to
    `whole_k_without_norm`, and past it `k_slice`-wide slices (twice the programs resident, each
    loading its first slice while the kernel before finishes). The q/k/v projection at one row
    takes two K slices from `qkv_two_slices_from` on. With 2-4 rows the slices shrink with the rows.
    whole_k_features (0: features_per_program): at one row, a projection without a fused norm that reads
    all of K in one slice takes this many output features a program. Such a product (o_proj) is short
    and bound by latency: fewer, larger programs put every load of the weight in flight in one wave.
    int4's table: 16, all of K up to 4096 (H100: the Llama-3.1-8B o_proj alone 5.2 -> 4.3 us, the
    Llama-3.2-1B int4 step 0.622 -> 0.609 ms; the 8B step unchanged; fp8 ran slower with it).
    whole_k_max_outputs (0: any): whole_k_features, and whole_k_without_norm past k_slice, apply only to
    products of at most this many outputs; wider ones are sliced at k_slice in programs of
    features_per_program. bf16's table: 8 features, all of K up to 4096, for up to 2048 outputs (H100,
    batch 1: Qwen3-30B-A3B, whose o_proj is 2048 x 4096, 3.130 -> 3.080 and 3.155 -> 3.105 ms a token;
    the Llama-3.2-1B step unchanged at 1.050 ms; the same rule on Llama-3.1-8B's 4096 x 4096 o_proj
    made its step 1.2% slower, 5.297 -> 5.358 ms, hence the limit).
    int8_inputs (int4 weights at one row): x is rounded to int8 with one step a thread's 32 inputs
    (their largest magnitude / 127) and each int4 word's 8 products are two dp4a instructions, the
    nibbles masked into bytes, instead of 8 float32 multiply-adds (ferrum.kernels.gemv_chunks). On by
    default for int4 (KernelConfig.gemv_int4): on an H100 the Llama-3.1-8B int4 step 2.27 -> 2.07 ms,
    for 0.6% more perplexity than int4 alone (1.400 -> 1.408 of float32's on the demo model,
    scripts/int8_inputs_quality.py).
    """

    features_per_program: int = 2
    num_warps: int = 4
    whole_k_with_norm: int = 4096
    whole_k_without_norm: int = 2048
    k_slice: int = 2048
    qkv_two_slices_from: int = 2048
    int8_inputs: bool = False
    whole_k_features: int = 0
    whole_k_max_outputs: int = 0

    @classmethod
    def sliced(cls, features_per_program: int, k_slice: int, num_warps: int = 4,
               int8_inputs: bool = False) -> GemvTable:
        """A table that reads K in k_slice-wide slices (all of K where it is narrower), with or
        without a fused norm."""
        return cls(features_per_program, num_warps, k_slice, k_slice, k_slice, k_slice, int8_inputs)

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name == "int8_inputs":
                if not isinstance(value, bool):
                    raise ValueError(f"kernels.gemv.int8_inputs must be true or false, got {value!r}")
                continue
            if item.name in ("whole_k_features", "whole_k_max_outputs"):
                if isinstance(value, bool) or not isinstance(value, int) or value < 0 or value & (value - 1):
                    raise ValueError(f"kernels.gemv.{item.name} must be 0 or a power of two, got {value!r}")
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kernels.gemv.{item.name} must be a positive integer, got {value!r}")
            if item.name != "num_warps" and item.name != "features_per_program" and value & (value - 1):
                raise ValueError(f"kernels.gemv.{item.name} must be a power of two, got {value}")


@dataclass(frozen=True)
class GemmRules:
    """How ferrum.kernels.quant_matmul multiplies many rows by a quantized weight on one device.
    fp8_rowwise: torch._scaled_mm takes row-wise scales there (compute capability 9.0; an 8.9 GPU takes
    the Triton W8A16 GEMM). int4_w8a8_rows: int4 products of at least this many rows (and at least
    quant_matmul.DEQUANTIZE_FROM) run as W8A8 on the tensor cores in int4_w8a8_format ("int8", or "fp8"
    e4m3 where fp8_rowwise), the weight requantized per output channel and x rounded per row
    (quant_matmul's docstring); 0: never (dequantize + cuBLAS)."""

    fp8_rowwise: bool = True
    int4_w8a8_rows: int = 0
    int4_w8a8_format: Literal["int8", "fp8"] = "int8"


DEFAULT_GEMM = GemmRules()  # quant_matmul's when given none: row-wise fp8; int4 W4A16 at every M (no W8A8)


@dataclass(frozen=True)
class KernelConfig:
    """pdl: programmatic dependent launch through the decode chain, on devices that have it
    (compute capability 9.0 and later): each kernel launches while the one before it runs and loads
    its weights before waiting for it.
    max_decode_splits: at most this many slices of each sequence's cache run in parallel in decode
    attention (the splits fill the GPU at small batches).
    fused_decode_rows: decode batches of up to this many rows run the fused matrix-vector chain
    (0 turns it off: cuBLAS projections and separate norm / activation kernels). 1, measured on an
    H100 (Llama-3.1-8B, bf16): the chain's step at 2 rows 7.08 ms and at 4 rows 15.56 ms against
    6.24 and 6.28 ms through cuBLAS, while at 1 row it reads the weights at 92-95% of the bandwidth.
    gemv: the fused projections' slicing, for weights in the activations' dtype; gemv_int8,
    gemv_fp8, gemv_int4: for quantized weights (gemv_table picks by kind). Their defaults are the
    best of scripts/quant_gemv_bench.py's candidates on one H100 at the Llama-3.1-8B shapes
    (4096 x 4096 and 4096 x 14336, batch 1): 4 features a program in 2048-input slices (fp8: 1024,
    86.5 against 89.0 us a layer's four projections). int4 and int8 at one row read 32 and 16
    inputs a thread (ferrum.kernels.gemv_chunks): their warps are capped at one per 1024 and 512
    inputs of the slice.
    int4_w8a8_rows: int4 products of at least this many rows (and quant_matmul.DEQUANTIZE_FROM, 129: prefill
    chunks, large decode batches) as W8A8 on the tensor cores, in int4_w8a8_format: "fp8" (the weight
    requantized to float8 e4m3 per output channel, x per row, torch._scaled_mm with row-wise scales; where
    those are not taken, compute capability below 9.0, int8 serves) or "int8" (the weight and x in int8, a
    Triton int8 GEMM with the scales in its epilogue); activations in 16 bits only (served in float32:
    W4A16). None, the default: from DEQUANTIZE_FROM rows on compute capability 9.0 (row-wise fp8), else
    never; 0: never (the weight dequantized to bf16, then cuBLAS: W4A16 at every M). Measured on an H100
    (Llama-3.1-8B int4 g128, `ferrum bench offline`, 256 requests): 7,514 output tok/s in fp8 and 7,481 in
    int8 against 6,636 without (bf16: 7,660); the gate/up and down products at 192 rows 1.25-1.33x faster.
    On the demo model, rounding every product so costs perplexity on top of int4's own
    (scripts/int8_inputs_quality.py, emulated): fp8 1.6%, int8 3.0% (x per row 1.9%, the requantized
    weights 0.2%). benchmarks/quantization.md.
    one_shot_all_reduce_kb: under tensor parallelism on GPUs that reach each other's memory, sums
    of up to this many KB (decode steps) are one kernel over peer-mapped buffers instead of NCCL
    (ferrum.engine.parallel.peer_all_reduce; 512, the default, is the measured choice: benchmarks/gpu.md).
    0: NCCL for every sum. Where the fast path cannot be set up (no peer access, a second group in one
    process), NCCL.
    one_shot_push: the one-shot kernel writes each rank's tensor into every rank's buffer (one NVLink
    trip: the data travels with the flag) rather than having each rank read the others' (false: pull,
    two trips one after the other; ferrum.kernels.all_reduce).
    graph_prompt_keys: a step's prompt chunks replay the decode graph a row a token (DecodeGraphs.run_rows)
    while their rows attend to at most this many keys in all, else the step runs eagerly (0: always
    eagerly). Each of the graph's attention rows reads its whole context on its own, where an eager
    prefill reads a chunk's context once for all its rows. Measured on an H200 (the 135M demo model):
    prompts of up to 250 tokens with no cached prefix (31,375 keys) reach the first token in 1.2-2.3 ms
    through the graph against 10 ms eagerly; long chunks after long cached prefixes are not measured.
    cpu: on the CPU, attention, the norms, rope and silu * mul run the C++ kernels of
    ferrum.kernels.cpu, compiled once per machine into `cpu_cache_dir` (false: plain PyTorch, the
    torch_paged attention backend). Where they cannot be built (no C++ compiler), the log says why
    and the plain path serves.
    cpu_huge_pages: with the C++ kernels, the model's quantized weights and tables (its buffers) gathered into
    transparent huge pages where the OS offers them on request (ferrum.backends.host_memory): a decode step
    streams them, and with 4 KiB pages every 4 KiB is a TLB miss (the demo model's 120 int4 projections at
    one row: 0.958x the time on a Zen 3, 2 threads and 1). The KV cache stays in 4 KiB pages: in huge pages
    a short request's first writes hold 2 MiB a kv head and layer (about 360 MB for the demo model), with
    no gain seen at 6,000 tokens."""

    pdl: bool = True
    max_decode_splits: int = 32
    fused_decode_rows: int = 1
    gemv: GemvTable = field(default_factory=lambda: GemvTable(whole_k_without_norm=4096, whole_k_features=8,
                                                              whole_k_max_outputs=2048))
    gemv_int8: GemvTable = field(default_factory=lambda: GemvTable.sliced(4, 2048))
    gemv_fp8: GemvTable = field(default_factory=lambda: GemvTable.sliced(4, 1024))
    gemv_int4: GemvTable = field(default_factory=lambda: replace(GemvTable.sliced(4, 2048, int8_inputs=True),
                                                                 whole_k_without_norm=4096, whole_k_features=16))
    int4_w8a8_rows: int | None = None
    int4_w8a8_format: Literal["int8", "fp8"] = "fp8"
    one_shot_all_reduce_kb: int = 512
    one_shot_push: bool = True
    graph_prompt_keys: int = 65536
    cpu: bool = True
    cpu_cache_dir: str = "~/.cache/ferrum/kernels"
    cpu_huge_pages: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.pdl, bool):
            raise ValueError(f"kernels.pdl must be true or false, got {self.pdl!r}")
        if isinstance(self.max_decode_splits, bool) or not 1 <= self.max_decode_splits <= 64:
            raise ValueError(f"kernels.max_decode_splits must be in 1..64, got {self.max_decode_splits!r}")
        if isinstance(self.fused_decode_rows, bool) or not 0 <= self.fused_decode_rows <= 16:
            raise ValueError(f"kernels.fused_decode_rows must be in 0..16, got {self.fused_decode_rows!r}")
        if self.int4_w8a8_rows is not None and (isinstance(self.int4_w8a8_rows, bool)
                                                or not isinstance(self.int4_w8a8_rows, int) or self.int4_w8a8_rows < 0):
            raise ValueError(f"kernels.int4_w8a8_rows must be a count of rows >= 0 (0: never; null: auto), got "
                             f"{self.int4_w8a8_rows!r}")
        if self.int4_w8a8_format not in ("int8", "fp8"):
            raise ValueError(f"kernels.int4_w8a8_format must be int8 or fp8, got {self.int4_w8a8_format!r}")
        if isinstance(self.one_shot_all_reduce_kb, bool) or not 0 <= self.one_shot_all_reduce_kb <= 65536:
            raise ValueError(f"kernels.one_shot_all_reduce_kb must be in 0..65536, got {self.one_shot_all_reduce_kb!r}")
        if not isinstance(self.one_shot_push, bool):
            raise ValueError(f"kernels.one_shot_push must be true or false, got {self.one_shot_push!r}")
        if isinstance(self.graph_prompt_keys, bool) or not isinstance(self.graph_prompt_keys, int) \
                or self.graph_prompt_keys < 0:
            raise ValueError(f"kernels.graph_prompt_keys must be a count of keys >= 0, got {self.graph_prompt_keys!r}")
        if not isinstance(self.cpu, bool):
            raise ValueError(f"kernels.cpu must be true or false, got {self.cpu!r}")
        if not isinstance(self.cpu_huge_pages, bool):
            raise ValueError(f"kernels.cpu_huge_pages must be true or false, got {self.cpu_huge_pages!r}")
        if not isinstance(self.cpu_cache_dir, str) or not self.cpu_cache_dir:
            raise ValueError(f"kernels.cpu_cache_dir must be a folder, got {self.cpu_cache_dir!r}")
        for name in _TABLES:
            if not isinstance(getattr(self, name), GemvTable):
                raise ValueError(f"kernels.{name} must be a GemvTable, got {getattr(self, name)!r}")

    def gemm_rules(self, fp8_rowwise: bool) -> GemmRules:
        """quant_matmul's rules on a device whose torch._scaled_mm does (or does not) take row-wise scales."""
        fmt = self.int4_w8a8_format if fp8_rowwise else "int8"
        rows = (1 if fp8_rowwise else 0) if self.int4_w8a8_rows is None else self.int4_w8a8_rows
        return GemmRules(fp8_rowwise, rows, fmt)

    def gemv_table(self, kind: Literal["int8", "fp8", "int4"] | None) -> GemvTable:
        """The fused projections' table for a weight stored as `kind` (None: in the activations' dtype)."""
        if kind is None:
            return self.gemv
        return {"int8": self.gemv_int8, "fp8": self.gemv_fp8, "int4": self.gemv_int4}[kind]

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any] | KernelConfig | None) -> KernelConfig:
        """From YAML: {pdl: false, max_decode_splits: 16, gemv: {k_slice: 1024}}; unknown keys are
        refused by name."""
        if raw is None:
            return cls()
        if isinstance(raw, KernelConfig):
            return raw
        if not isinstance(raw, Mapping):
            raise ValueError(f"engine.kernels must be a mapping, got {raw!r}")
        values = dict(raw)
        _check_keys("kernels", values, cls)
        for name in _TABLES:
            table = values.get(name)
            if table is None or isinstance(table, GemvTable):
                continue
            if not isinstance(table, Mapping):
                raise ValueError(f"engine.kernels.{name} must be a mapping, got {table!r}")
            _check_keys(f"kernels.{name}", table, GemvTable)
            try:  # a quantized kind's keys override its own defaults, not the bf16 table's
                values[name] = replace(getattr(cls(), name), **table)
            except ValueError as e:
                raise ValueError(f"engine.kernels.{name}: {e}") from None
        return cls(**values)


_TABLES = ("gemv", "gemv_int8", "gemv_fp8", "gemv_int4")  # KernelConfig's GemvTable fields


def _check_keys(where: str, values: Mapping[str, Any], kind: type) -> None:
    known = {item.name for item in fields(kind)}
    unknown = sorted(str(key) for key in values if key not in known)
    if unknown:
        raise ValueError(f"unknown engine.{where} key(s): {', '.join(unknown)}; valid keys: {', '.join(sorted(known))}")
