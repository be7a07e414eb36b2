"""The decode path's kernels compiled for Hopper (sm_90) with programmatic dependent launch, on
any machine (Triton's ptxas needs no GPU): the interpreter the other kernel tests use on the CPU
neither compiles them nor shows where the loads sit against griddepcontrol.wait."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compiled() -> dict:
    pytest.importorskip("triton", reason="the GPU kernels are Triton (pip install triton)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.hopper_ptx"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_every_decode_kernel_waits_once_and_lets_the_next_launch_first(compiled: dict) -> None:
    for name, kernel in compiled.items():
        events = kernel["order"]
        assert events.count("wait") == 1, (name, events)
        assert events.count("trigger") == 1 and events.index("trigger") < events.index("wait"), (name, events)


def test_projections_issue_their_weight_loads_before_the_wait(compiled: dict) -> None:
    """The weights do not depend on the kernel before: their loads go out before the wait, so
    they are in flight while that kernel finishes."""
    for name in ("gemv o_proj", "gemv gate_up", "gemv down_proj", "qkv rope", "gemv int4 gate_up",
                 "gemv int8 down_proj", "gemv fp8 o_proj", "qkv rope int4", "gemv int4 down_proj",
                 "gemv int4-k down_proj"):
        events = compiled[name]["order"]
        assert events.index("wait") >= 4 and set(events[: events.index("wait")]) <= {"load", "trigger"}, (name, events)
    # gate/up loads two weight rows per feature where o_proj loads one: twice the loads ahead
    ahead = {name: compiled[name]["order"].index("wait") for name in ("gemv o_proj", "gemv gate_up")}
    assert ahead["gemv gate_up"] > ahead["gemv o_proj"]


def test_moe_experts_wait_before_any_load(compiled: dict) -> None:
    """Which experts' rows the per-pair kernels read comes from the router, the kernel before: they wait first."""
    for name in ("moe pair gate_up", "moe combine down"):
        events = compiled[name]["order"]
        assert "load" not in events[: events.index("wait")], (name, events)


def test_decode_attention_reads_the_older_cache_before_the_wait(compiled: dict) -> None:
    events = compiled["decode attention"]["order"]
    wait = events.index("wait")
    assert events[:wait].count("load") >= 3  # length, table, the first block's k and v
    assert "load" in events[wait:]  # q and the k/v of the keys this step may have written after it


def test_quantized_k_loops_issue_their_group_factors_with_the_weights(compiled: dict) -> None:
    """In the K loop of an int4 projection of many slices, ptxas keeps the loads of the group scales and zeros
    near the top, with the weights' (loaded a slice ahead; Q4_K with x in float32: at the start of the
    product): sunk next to their use, late in the loop, their latency stalled every slice (the 8B's int4
    down_proj 16.2 -> 13.5 us, Q4_K's 22.5 -> 15.1 us on an H200; benchmarks/quantization.md, published.md).
    With int8 inputs, Q4_K's loaded at the start of the product went half way down the loop (0.45-0.49),
    after x's rounding; loaded a slice ahead, the last is at 0.26."""
    for name in ("gemv int4 down_proj", "gemv int4-k down_proj"):
        loads = compiled[name]["loop_loads"]
        if loads is None:
            pytest.skip("Triton's nvdisasm is missing")
        assert len(loads) >= 16 and max(loads) < 0.3, (name, [round(x, 2) for x in loads])


def test_w4a16_bf16_pairs_compile_for_every_gpu_that_serves_bf16() -> None:
    """The W4A16 GEMMs' inline PTX (bf16x2 fma; sm_90's bf16x2 subtraction would not assemble for sm_80-89)
    through ptxas for sm_80, 86, 89 and 90, in the planes kernel and in the weight tiles (their planes
    joined into input order): 8 fmas a word (4 to subtract 136, 4 by scale and zero), wgmma on sm_90 only."""
    pytest.importorskip("triton", reason="the GPU kernels are Triton (pip install triton)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.hopper_ptx", "--w4a16"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    targets = json.loads(proc.stdout.strip().splitlines()[-1])
    assert sorted(targets) == sorted(f"{k} {cc}" for k in ("planes", "tiles") for cc in (80, 86, 89, 90))
    for name, kernel in targets.items():
        assert kernel["bf16x2_fma"] >= 8, (name, kernel)
    for k in ("planes", "tiles"):
        assert targets[f"{k} 90"]["wgmma"] >= 8 and targets[f"{k} 80"]["wgmma"] == 0, targets
