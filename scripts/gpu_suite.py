"""Checks and times Ferrum on a CUDA GPU in one go; prints a table at the end. Uses only Ferrum's
public surface: the CLI (`ferrum serve`, `ferrum bench`), `create_engine`, `LLMEngine`'s requests
and steps, and its step observer.

    python scripts/gpu_suite.py --phases env,tests,correct,decode,offline --out DIR [--with-8b]
    python scripts/gpu_suite.py --phases env,offline,serve --compare /path/to/older/ferrum

Phases:
  env      GPU, versions, measured device-to-device copy bandwidth (bytes read + written)
  tests    the GPU tests: tests/kernels, tests/engine/test_gpu_engine.py, tests/backends/test_cuda_gpu.py
  correct  bf16 logits (prefill, and decode through the CUDA graphs at batch 1 and 3) and greedy
           outputs vs HF transformers on random-weight Llama-3.2-1B and Qwen3-0.6B checkpoints
  decode   batch-1 decode ms/token vs the floor of weight bytes over measured bandwidth (1B; 8B
           with --with-8b); HF transformers generate at batch 1 with --with-hf
  offline  `ferrum bench offline` with its defaults (256 requests, 100-1024 in and out) on the 1B
  serve    `ferrum bench serve` at concurrency 64 against `ferrum serve` vs offline at max_num_seqs 64
           (--serve-concurrency, the 8B with --with-8b, --serve-repeat alternating runs)
  cold     `ferrum serve` to ready for the 8B shape; load rate vs safetensors load_file(device="cuda")
  memory   the 8B server with default settings: the device's memory (NVML, every process) against
           the gpu_memory_utilization budget, after start-up and under load; KV blocks; which
           processes hold a CUDA context
  prefix   TTFT of 64 requests sharing a 1536-token prefix, new then cached, and of 64 sharing
           nothing with prefix caching on and off (1B)
  timeline the engine's steps (kind, tokens, wall time) on the offline workload, from its observer
  roofline `ferrum bench offline` (the offline workload) on the 1B (and the 8B with --with-8b) with the KV
           cache in bf16 and in fp8: output tok/s, the per-step roofline's fraction, the KV tokens that fit
  budget   the same on the 8B (the 1B without --with-8b) for each --budgets pair of a step's token budget
           and burst length (max_num_batched_tokens:num_scheduler_steps)

--compare CHECKOUT runs the CLI-level phases (offline, serve, cold, memory, prefix) a second time
with the Ferrum of another checkout (its `ferrum` CLI, imported from there), and the decode phase
through that checkout's own scripts/gpu_suite.py, so that two commits are measured on one machine.
Random-weight checkpoints are made under --ckpt (scripts/make_random_checkpoint.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import traceback
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

RESULTS: list[dict] = []


def record(phase: str, name: str, value, unit: str = "", note: str = "") -> None:
    row = dict(phase=phase, name=name, value=value, unit=unit, note=note)
    RESULTS.append(row)
    print(f"[{phase}] {name}: {value} {unit} {note}", flush=True)


BACKEND = "cuda"  # --backend: "cpu" with --model runs the phases as a smoke test on a machine without a GPU
MODEL_OVERRIDE: Path | None = None


def checkpoint(shape: str, ckpt_root: Path) -> Path:
    if MODEL_OVERRIDE is not None:
        return MODEL_OVERRIDE.resolve()
    out = ckpt_root / shape
    if not (out / "config.json").exists():
        subprocess.run([sys.executable, str(ROOT / "scripts/make_random_checkpoint.py"), "--shape", shape,
                        "--out", str(out)], check=True)
    return out


def weight_bytes_read_per_token(folder: Path) -> int:
    """Bytes of weights one decode step reads: every weight but an untied embedding table."""
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text())
    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for name in f.keys():
                if name.endswith("embed_tokens.weight") and not config.get("tie_word_embeddings"):
                    continue
                n = 1
                for d in f.get_slice(name).get_shape():
                    n *= d
                total += n * 2
    return total


# -- running Ferrum: this checkout's, or another's ---------------------------------------------------


class Variant:
    """A Ferrum checkout: its CLI is run with the checkout as working directory and import path."""

    def __init__(self, name: str, root: Path) -> None:
        self.name, self.root = name, root

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(self.root), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        return env

    def cli(self, *argv: str) -> list[str]:
        return [sys.executable, "-m", "ferrum.cli", *argv]


def variants(args) -> list[Variant]:
    found = [Variant("new", ROOT)]
    if args.compare:
        found.append(Variant("old", Path(args.compare).resolve()))
    return found


def bench(variant: Variant, *argv: str) -> dict:
    """`ferrum bench ...` (the client is always this checkout's; an `offline` run is the variant's)."""
    out = Path(argv[argv.index("--output-json") + 1])
    runner = variant if argv[0] == "offline" else Variant("new", ROOT)
    proc = subprocess.run(runner.cli("bench", *argv), cwd=runner.root, env=runner.env(), capture_output=True,
                          text=True)
    print(proc.stdout[-3000:], proc.stderr[-1500:])
    return json.loads(out.read_text())


@contextmanager
def server(variant: Variant, folder: Path, port: int, log_path: Path, *extra: str) -> Iterator[float]:
    """`ferrum serve` of the variant, up; yields the seconds from spawn to /ready answering 200 (the
    model loaded and warmed up; /health answers as soon as HTTP is up)."""
    cmd = variant.cli("serve", "--model", str(folder), "--port", str(port), "--backend", BACKEND, *extra)
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=variant.root, env=variant.env(), stdout=open(log_path, "w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"ferrum serve exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=1) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.perf_counter() - started > 400:
                raise RuntimeError("ferrum serve did not become ready in 400 s")
            time.sleep(0.05)
        yield time.perf_counter() - started
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def metric(port: int, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


def nvml_memory() -> tuple[int, int, dict[int, int]]:
    """(used, total, pid -> bytes) of GPU 0, as NVML (nvidia-smi) reports them."""
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    info = pynvml.nvmlDeviceGetMemoryInfo(handle)
    procs = {p.pid: int(p.usedGpuMemory or 0) for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)}
    return int(info.used), int(info.total), procs


# -- phases -----------------------------------------------------------------------------------


def phase_env(args) -> float:
    props = torch.cuda.get_device_properties(0)
    record("env", "gpu", props.name, note=f"cc {props.major}.{props.minor}, {props.total_memory / 2**30:.1f} GiB")
    import triton

    record("env", "versions", f"torch {torch.__version__}, triton {triton.__version__}")
    bw = copy_bandwidth()
    record("env", "copy bandwidth (read+write)", round(bw / 1e9), "GB/s")
    return bw


def copy_bandwidth(elements: int = 2**30) -> float:
    """Bytes read + written per second by a device-to-device copy of `elements` bf16 values."""
    x = torch.randn(elements, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    times = []
    for _ in range(20):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        y.copy_(x)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    del x, y
    torch.cuda.empty_cache()
    return 2 * elements * 2 / statistics.median(times)


def phase_tests(args) -> None:
    tests = ["tests/kernels", "tests/engine/test_gpu_engine.py", "tests/backends/test_cuda_gpu.py",
             "tests/engine/test_fp8_kv_cache.py"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                          cwd=ROOT, capture_output=True, text=True)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    record("tests", "pytest " + " ".join(tests), tail)


def gpu_engine(folder: Path, **overrides):
    from ferrum.engine.builder import create_engine

    settings: dict[str, Any] = dict(dtype="bfloat16", max_num_seqs=256, max_num_batched_tokens=8192,
                                    max_model_len=4096)
    if BACKEND == "cpu":
        settings |= dict(dtype="float32", kv_cache_memory_gb=0.2, max_num_seqs=8, max_num_batched_tokens=512)
    return create_engine(str(folder), backend=BACKEND, **(settings | overrides))


def ferrum_decode_logits(engine, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy continuations of `prompts` (run together) and, for each, the float32 logits the
    engine sampled from at every position: the prompt's last (prefill) and each decode (through
    the CUDA graph of the batch's size; logprobs keep every decode on the host's sampler)."""
    from ferrum.engine.sampling_params import SamplingParams

    rows: dict[str, list[torch.Tensor]] = {}

    def observe(record_) -> None:
        if record_.logits is not None:
            for rid, row in zip(record_.request_ids, record_.logits, strict=True):
                rows.setdefault(rid, []).append(row.float().cpu())

    remove = engine.add_observer(observe)
    ids = [f"check-{i}-{time.monotonic_ns()}" for i in range(len(prompts))]
    out: dict[str, list[int]] = {i: [] for i in ids}
    params = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, logprobs=0)
    for rid, prompt in zip(ids, prompts, strict=True):
        engine.add_request(rid, prompt, params)
    while engine.has_work:
        for delta in engine.step():
            out[delta.request_id].extend(delta.new_token_ids)
    remove()
    return [out[i] for i in ids], [torch.stack(rows[i]) for i in ids]


def phase_correct(args) -> None:
    from transformers import AutoModelForCausalLM

    from ferrum.engine.sampling_params import SamplingParams

    for shape in ("llama-3.2-1b", "qwen3-0.6b"):
        folder = checkpoint(shape, args.ckpt)
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        rng = random.Random(0)
        prompts = [[rng.randrange(vocab - 2) for _ in range(n)] for n in (5, 77, 300)]
        engine = gpu_engine(folder, kv_cache_memory_gb=4.0, max_num_seqs=16)
        alone = [ferrum_decode_logits(engine, [p], 12) for p in prompts]  # batch-1 graphs
        together_tokens, together_logits = ferrum_decode_logits(engine, prompts, 12)  # the 3-row graph
        greedy = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))  # bursts
        engine.release()
        del engine
        torch.cuda.empty_cache()
        # the references, teacher-forced on Ferrum's own continuations
        errors: dict[str, list[float]] = {"ferrum bf16, batch 1": [], "ferrum bf16, batch 3": [], "HF bf16": []}
        top1 = {"ferrum": 0, "HF bf16": 0}
        total = 0
        hf_greedy = []
        with torch.no_grad():
            # transformers' cuda() is a functools.wraps of Module.cuda, which mypy can't bind
            hf32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()  # type: ignore[call-arg]
            hf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()  # type: ignore[call-arg]
            for i, p in enumerate(prompts):
                tokens, ours = alone[i][0][0], alone[i][1][0]
                ids = torch.tensor([p + tokens[:-1]], device="cuda")
                ref32 = hf32(ids).logits[0, len(p) - 1:].float().cpu()
                ref16 = hf16(ids).logits[0, len(p) - 1:].float().cpu()
                errors["ferrum bf16, batch 1"].append(float((ours - ref32).abs().max()))
                errors["HF bf16"].append(float((ref16 - ref32).abs().max()))
                if together_tokens[i] == tokens:
                    errors["ferrum bf16, batch 3"].append(float((together_logits[i] - ref32).abs().max()))
                top1["ferrum"] += int((ours.argmax(-1) == ref32.argmax(-1)).sum())
                top1["HF bf16"] += int((ref16.argmax(-1) == ref32.argmax(-1)).sum())
                total += ref32.shape[0]
                g = hf16.generate(torch.tensor([p], device="cuda"), max_new_tokens=32, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
                hf_greedy.append(g[0, len(p):].tolist())
            margins = []
            for p, ours_out, theirs in zip(prompts, greedy, hf_greedy, strict=True):
                # the first position where they part (over the shorter, should one stop early)
                n = next((k for k, (a, b) in enumerate(zip(ours_out, theirs, strict=False)) if a != b), len(theirs))
                if n < len(theirs):
                    logits = hf32(torch.tensor([p + theirs[:n]], device="cuda")).logits[0, -1].float()
                    margins.append(round(abs(float(logits[ours_out[n]] - logits[theirs[n]])), 4))
            del hf32, hf16
        torch.cuda.empty_cache()
        err_hf = max(errors["HF bf16"])
        for label in ("ferrum bf16, batch 1", "ferrum bf16, batch 3"):
            if errors[label]:
                err = max(errors[label])
                record("correct", f"{shape} {label}: logits max|ferrum - HF fp32|", round(err, 4), "",
                       f"HF bf16 vs HF fp32: {err_hf:.4f}; bound 2x HF's: "
                       f"{'PASS' if err <= 2 * err_hf + 1e-3 else 'FAIL'}")
        record("correct", f"{shape} top-1 agreement with HF fp32", f"ferrum {top1['ferrum']}/{total}, "
               f"HF bf16 {top1['HF bf16']}/{total}")
        matched = [next((k for k, (a, b) in enumerate(zip(o, t, strict=False)) if a != b), len(t))
                   for o, t in zip(greedy, hf_greedy, strict=True)]
        near_ties = all(m <= 2 * err_hf for m in margins)
        record("correct", f"{shape} greedy 32 tokens (bursts, batch 3) == HF bf16 generate",
               f"{matched} tokens match of 32", "", f"fp32 logit gap where they part: {margins} "
               f"({'all near-ties within 2x HF bf16 error: PASS' if near_ties else 'FAIL: a clear divergence'})")


def time_batch1_decode(folder: Path, prompt_len: int = 128, new_tokens: int = 256, **overrides) -> float:
    """Seconds per token of one greedy request, timed over whole engine.step calls (schedule, graph
    replays, detokenisation) after its prefill."""
    return batch1_per_token(gpu_engine(folder, max_num_seqs=8, max_model_len=2048, **overrides), prompt_len,
                            new_tokens)


def record_offline(name: str, folder: Path, out: Path, quantization: str | None = None,
                   kernels: dict | None = None) -> None:
    """`ferrum bench offline` (256 requests, 100-1024 in and out) on `folder` as a subprocess, recorded
    under phase "offline" as `name` (its output JSON at `out`); `kernels`: engine.kernels settings."""
    cmd = [sys.executable, "-m", "ferrum.cli", "bench", "offline", "--model", str(folder), "--max-model-len", "2048",
           "--num-prompts", "256", "--output-json", str(out)]
    if quantization is not None:
        cmd += ["--quantization", quantization]
    if kernels:
        cmd += ["--kernels", json.dumps(kernels)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode or not out.exists():
        record("offline", name, "failed", note=done.stderr[-800:])
        return
    res = json.loads(out.read_text())
    record("offline", name, round(res["output_tokens_per_s"]), "output tok/s", f"{res['elapsed_s']:.1f}s")


def print_results(path: Path) -> None:
    """The recorded results as a markdown table, and as JSON at `path`."""
    print("\n| phase | name | value | unit | note |\n| --- | --- | --- | --- | --- |")
    for row in RESULTS:
        print(f"| {row['phase']} | {row['name']} | {row['value']} | {row['unit']} | {row['note']} |")
    path.write_text(json.dumps(RESULTS, indent=1))


def batch1_per_token(engine, prompt_len: int = 128, new_tokens: int = 256) -> float:
    """time_batch1_decode on an engine already made; the engine is released after."""
    from ferrum.engine.sampling_params import SamplingParams

    rng = random.Random(1)
    vocab = engine.model_config.vocab_size
    engine.generate([[rng.randrange(vocab - 2) for _ in range(prompt_len)]],
                    SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    engine.add_request("b1", [rng.randrange(vocab - 2) for _ in range(prompt_len)],
                       SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True))
    engine.step()  # prefill + first token
    engine.device.runtime.synchronize()
    started = time.perf_counter()
    tokens = 0
    while engine.has_work:
        tokens += sum(len(out.new_token_ids) for out in engine.step())  # a step may run several decodes
    elapsed = time.perf_counter() - started
    engine.release()
    del engine
    torch.cuda.empty_cache()
    return elapsed / tokens


def hf_batch1_tokens_per_s(folder: Path, new_tokens: int = 64) -> float:
    from transformers import AutoModelForCausalLM

    # transformers' cuda() is a functools.wraps of Module.cuda, which mypy can't bind
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()  # type: ignore[call-arg]
    ids = torch.randint(0, 1000, (1, 128), device="cuda")
    with torch.no_grad():
        model.generate(ids, max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=0)
        torch.cuda.synchronize()
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                       eos_token_id=None, pad_token_id=0)
        torch.cuda.synchronize()
    rate = new_tokens / (time.perf_counter() - started)
    del model
    torch.cuda.empty_cache()
    return rate


def phase_decode(args, bandwidth: float) -> None:
    from ferrum.kernels.config import KernelConfig

    shapes = ["llama-3.2-1b"] + (["llama-3.1-8b"] if args.with_8b else [])
    for shape in shapes:
        folder = checkpoint(shape, args.ckpt)
        floor = weight_bytes_read_per_token(folder) / bandwidth
        for repeat in range(args.decode_repeat):
            per_token = time_batch1_decode(folder)
            record("decode", f"{shape} batch-1 ms/token (new){'' if not repeat else f' #{repeat + 1}'}",
                   round(per_token * 1e3, 3), "ms", f"floor {floor * 1e3:.3f} ms -> {floor / per_token:.1%} of floor")
        for name in filter(None, args.kernel_variants.split(",")):
            kernels = {"no-pdl": KernelConfig(pdl=False), "splits-16": KernelConfig(max_decode_splits=16),
                       "no-fused": KernelConfig(fused_decode_rows=0)}[name]
            per_token = time_batch1_decode(folder, kernels=kernels)
            record("decode", f"{shape} batch-1 ms/token, kernels {name}", round(per_token * 1e3, 3), "ms",
                   f"{floor / per_token:.1%} of floor")
        if args.with_hf:
            rate = hf_batch1_tokens_per_s(folder)
            record("decode", f"{shape} HF generate batch-1 (eager)", round(rate, 1), "tok/s",
                   f"ferrum {(1 / (per_token * rate)):.1f}x")
    if args.compare:
        old = Path(args.compare).resolve()
        out = args.out / "old-decode"
        out.mkdir(parents=True, exist_ok=True)
        phases = ["env", "decode"]
        cmd = [sys.executable, str(old / "scripts/gpu_suite.py"), "--phases", ",".join(phases), "--ckpt",
               str(args.ckpt), "--out", str(out)] + (["--with-8b"] if args.with_8b else [])
        for repeat in range(args.decode_repeat):
            subprocess.run(cmd, cwd=old, env=Variant("old", old).env(), capture_output=True, text=True)
            for row in json.loads((out / "gpu_suite.json").read_text()):
                if row["phase"] == "decode" and "ms/token" in row["name"]:
                    record("decode", f"{row['name']} (old){'' if not repeat else f' #{repeat + 1}'}",
                           row["value"], row["unit"], row["note"])


def phase_offline(args) -> None:
    """`ferrum bench offline` with its defaults (256 requests, 100-1024 in and out, ignore EOS) on the 1B."""
    folder = checkpoint("llama-3.2-1b", args.ckpt)
    for variant in variants(args):
        res = bench(variant, "offline", "--model", str(folder), "--max-model-len", "2048", "--num-prompts",
                    str(args.num_prompts), "--output-json", str(args.out / f"offline-{variant.name}.json"))
        record("offline", f"ferrum bench offline, llama-3.2-1b ({variant.name})", round(res["output_tokens_per_s"]),
               "output tok/s", f"{res['elapsed_s']:.1f}s, {res['total_output_tokens']} tokens (as requested: "
               f"{res['output_tokens_as_requested']})")


def phase_roofline(args) -> None:
    shapes = (["llama-3.1-8b"] if args.with_8b else []) + ["llama-3.2-1b"]
    for shape in shapes:
        folder = checkpoint(shape, args.ckpt)
        for kv in args.roofline_kv.split(","):
            try:
                res = bench(Variant("new", ROOT), "offline", "--model", str(folder), "--max-model-len", "2048",
                            "--num-prompts", str(args.num_prompts), "--kv-cache-dtype", kv, "--output-json",
                            str(args.out / f"roofline-{shape}-{kv}.json"))
            except (OSError, ValueError) as e:
                record("roofline", f"{shape} kv {kv}", "failed", note=str(e)[-300:])
                continue
            r = res["roofline"]
            record("roofline", f"{shape} kv {kv} ({res['kv_cache_dtype']})", round(res["output_tokens_per_s"]),
                   "output tok/s", f"{res['elapsed_s']:.1f}s; roofline {r['seconds']:.1f}s = {r['fraction']:.1%} of it "
                   f"({r['peak_tflops']:.0f} TFLOP/s, {r['bandwidth_gbs']:.0f} GB/s measured; "
                   f"{r['compute_bound_passes']}/{r['passes']} passes compute-bound; by kind {r['seconds_by_kind']}); "
                   f"KV cache {res['kv_cache_tokens']} tokens")


def phase_budget(args) -> None:
    shape = "llama-3.1-8b" if args.with_8b else "llama-3.2-1b"
    folder = checkpoint(shape, args.ckpt)
    for pair in args.budgets.split(","):
        tokens, steps = pair.split(":")
        out = args.out / f"budget-{shape}-{tokens}-{steps}.json"
        try:
            res = bench(Variant("new", ROOT), "offline", "--model", str(folder), "--max-model-len", "2048",
                        "--num-prompts", str(args.num_prompts), "--max-num-batched-tokens", tokens,
                        "--num-scheduler-steps", steps, "--output-json", str(out))
        except (OSError, ValueError) as e:
            record("budget", f"{shape} {pair}", "failed", note=str(e)[-300:])
            continue
        r = res["roofline"]
        record("budget", f"{shape} tokens {tokens}, burst {steps}", round(res["output_tokens_per_s"]),
               "output tok/s", f"{res['elapsed_s']:.1f}s; roofline {r['seconds']:.1f}s = {r['fraction']:.1%}")


def phase_serve(args) -> None:
    """HTTP at --serve-concurrency (64) vs the offline engine at max_num_seqs of the same number on the
    same workload (the 1B; the 8B with --with-8b). --serve-repeat 1: the offline reference taken
    before and after the HTTP run and averaged; more: offline and HTTP alternating that many times
    each (a fresh server each time: both hold the device's memory), medians compared."""
    folder = checkpoint("llama-3.1-8b" if args.with_8b else "llama-3.2-1b", args.ckpt)
    c = args.serve_concurrency
    common = ["--num-prompts", str(args.num_prompts), "--seed", "0"]
    flags = ["--max-num-seqs", str(c), "--max-model-len", "2048"]
    for variant in variants(args):
        def offline(tag: str, variant: Variant = variant) -> float:
            res = bench(variant, "offline", "--model", str(folder), *flags, *common,
                        "--output-json", str(args.out / f"offline-c{c}-{variant.name}-{tag}.json"))
            return res["output_tokens_per_s"]

        def http(tag: str, variant: Variant = variant) -> dict:
            with server(variant, folder, 8011, args.out / f"serve-{variant.name}.log", *flags):
                res = bench(variant, "serve", "--url", "http://127.0.0.1:8011", "--tokenizer", str(folder),
                            "--concurrency", str(c), *common,
                            "--output-json", str(args.out / f"serve-c{c}-{variant.name}-{tag}.json"))
            return res["levels"][0]

        offlines, levels = [], []
        for i in range(args.serve_repeat):
            offlines.append(offline(f"run{i}"))
            levels.append(http(f"run{i}"))
            lvl = levels[-1]
            record("serve", f"run {i + 1}: offline / HTTP c={c} ({variant.name})",
                   f"{offlines[-1]:.0f} / {lvl['output_throughput']:.0f}", "output tok/s",
                   f"{lvl['output_throughput'] / offlines[-1]:.0%}; TTFT p50/p99 {lvl['ttft_ms']['median']:.0f}/"
                   f"{lvl['ttft_ms']['p99']:.0f} ms, TPOT p50 {lvl['tpot_ms']['median']:.2f} ms, "
                   f"failed {lvl['failed']}")
        if args.serve_repeat == 1 and args.serve_refs > 1:
            offlines.append(offline("after"))
        reference = statistics.median(offlines)
        got = statistics.median(lvl["output_throughput"] for lvl in levels)
        record("serve", f"HTTP c={c} ({variant.name}), median of {len(levels)}", round(got), "output tok/s",
               f"offline max_num_seqs {c} median of {len(offlines)} {reference:.0f}: {got / reference:.0%} of "
               f"offline; TTFT p99 median {statistics.median(lvl['ttft_ms']['p99'] for lvl in levels):.0f} ms")


def phase_cold(args) -> None:
    """`ferrum serve` to ready for the 8B shape from local disk (page cache warm, as for load_file),
    the weight-load rate from its log beside safetensors.torch.load_file(device="cuda")."""
    from safetensors.torch import load_file

    folder = checkpoint("llama-3.1-8b", args.ckpt)
    files = sorted(folder.glob("*.safetensors"))
    nbytes = sum(f.stat().st_size for f in files)
    for f in files:  # warm the page cache for every reader alike
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass

    def load_file_rate() -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        for f in files:
            tensors = load_file(str(f), device="cuda")
            del tensors
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - started
        torch.cuda.empty_cache()
        return nbytes / 1e9 / elapsed

    for variant in variants(args):
        record("cold", "safetensors load_file(device=cuda), 8B", round(load_file_rate(), 2), "GB/s")
        for attempt in args.cold_starts.split(","):
            log_path = args.out / f"cold-{variant.name}-{attempt.replace(' ', '-')}.log"
            with server(variant, folder, 8012, log_path, "--max-model-len", "8192") as ready:
                pass
            lines = log_path.read_text().splitlines()
            load = next((ln.split(": ", 1)[-1] for ln in lines if "GB of weights" in ln), "")
            record("cold", f"ferrum serve -> ready, 8B, local disk, {attempt} ({variant.name})", round(ready, 2), "s",
                   load)


def phase_memory(args) -> None:
    """The 8B server with default settings (gpu_memory_utilization 0.9, 256 sequences, 8192 tokens):
    the device's memory in use, every process counted, against the budget; after start-up and after
    64 requests at once; which processes hold memory on the GPU; KV blocks."""
    folder = checkpoint("llama-3.1-8b", args.ckpt)
    torch.cuda.empty_cache()

    def server_usage() -> tuple[int, int, dict[int, int]]:
        """Bytes in use on the device as CUDA counts them (the planner's view), less this suite's
        own process; the device's total; the processes NVML lists (pid -> bytes)."""
        free, total = torch.cuda.mem_get_info()
        _, _, procs = nvml_memory()
        return total - free - procs.get(os.getpid(), 0), total, procs

    for variant in variants(args):
        with server(variant, folder, 8013, args.out / f"memory-{variant.name}.log", "--max-model-len", "8192"):
            used, total, procs = server_usage()
            budget = 0.9 * total
            blocks = int(metric(8013, "ferrum_kv_blocks_total"))
            mine = {p: m // 2**20 for p, m in procs.items() if p != os.getpid()}
            record("memory", f"8B server ready ({variant.name}): in use on the device", round(used / 2**20), "MiB",
                   f"{used / total:.1%} of {total / 2**20:.0f} MiB; budget {budget / 2**20:.0f} MiB "
                   f"({'held' if used <= budget else 'EXCEEDED'}); server processes (pid: MiB) {mine}; "
                   f"KV blocks {blocks}")
            bench(variant, "serve", "--url", "http://127.0.0.1:8013", "--tokenizer", str(folder), "--concurrency", "64",
                  "--num-prompts", "64", "--input-len", "100:2048", "--output-len", "16:128",
                  "--output-json", str(args.out / f"memory-load-{variant.name}.json"))
            used, total, procs = server_usage()
            record("memory", f"8B server after 64 requests ({variant.name})", round(used / 2**20), "MiB",
                   f"{used / total:.1%} of the device ({'within' if used <= budget else 'OVER'} the budget); "
                   f"processes { {p: m // 2**20 for p, m in procs.items() if p != os.getpid()} }")


def phase_prefix(args) -> None:
    """TTFT at concurrency 64 (--prefix-requests): a shared 1536-token prefix (--prefix-len; 64 own
    tokens each, 32 out), first new then already cached; and prompts of the same length sharing
    nothing, with prefix caching on and off."""
    folder = checkpoint("llama-3.2-1b", args.ckpt)
    n, prefix = str(args.prefix_requests), args.prefix_len
    for variant in variants(args):
        for caching in ("on", "off"):
            extra = ["--max-model-len", "4096"] + (["--no-prefix-caching"] if caching == "off" else [])
            with server(variant, folder, 8014, args.out / f"prefix-{variant.name}-{caching}.log", *extra):
                shared = bench(variant, "serve", "--url", "http://127.0.0.1:8014", "--tokenizer", str(folder),
                               "--concurrency", f"{n},{n}", "--num-prompts", n, "--prefix-len", str(prefix),
                               "--input-len", "64", "--output-len", "32", "--output-json",
                               str(args.out / f"prefix-shared-{variant.name}-{caching}.json"))
                alone = bench(variant, "serve", "--url", "http://127.0.0.1:8014", "--tokenizer", str(folder),
                              "--concurrency", f"{n},{n}", "--num-prompts", n, "--input-len", str(prefix + 64),
                              "--output-len", "32", "--output-json",
                              str(args.out / f"prefix-none-{variant.name}-{caching}.json"))
            for label, res, index in ((f"shared {prefix}-token prefix, new", shared, 0),
                                      (f"shared {prefix}-token prefix, cached", shared, 1),
                                      ("nothing shared", alone, 0), ("nothing shared, again", alone, 1)):
                lvl = res["levels"][index]
                record("prefix", f"{label}, caching {caching} ({variant.name})", round(lvl["ttft_ms"]["median"]),
                       "ms TTFT p50", f"p99 {lvl['ttft_ms']['p99']:.0f} ms, failed {lvl['failed']}")


def phase_timeline(args) -> None:
    """The engine's steps on the offline workload, from its step observer: time by kind of step."""
    from ferrum.engine.observer import StepRecord
    from ferrum.engine.sampling_params import SamplingParams

    folder = checkpoint("llama-3.2-1b", args.ckpt)
    engine = gpu_engine(folder, max_model_len=2048)
    steps: list[StepRecord] = []
    engine.add_observer(steps.append)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    started = time.perf_counter()
    for i in range(args.num_prompts):
        prompt = [rng.randrange(vocab - 2) for _ in range(rng.randint(100, 1024))]
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=rng.randint(100, 1024), temperature=0,
                                                            ignore_eos=True))
    while engine.has_work:
        engine.step()
    elapsed = time.perf_counter() - started
    for kind in ("prefill", "mixed", "decode", "burst"):
        mine = [s for s in steps if s.kind == kind]
        if mine:
            wall = sum(s.finished - s.started for s in mine)
            record("timeline", f"{kind} steps", len(mine), "", f"{wall:.2f}s of {elapsed:.2f}s, "
                   f"{sum(s.num_generated for s in mine)} tokens out, {sum(s.num_tokens for s in mine)} run")
    engine.release()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phases", default="env,tests,correct,decode,offline")
    parser.add_argument("--ckpt", type=Path, default=Path("/tmp/ferrum-ckpt"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--with-8b", action="store_true")
    parser.add_argument("--with-hf", action="store_true")
    parser.add_argument("--roofline-kv", default="auto,fp8", help="roofline: the KV cache dtypes to run")
    parser.add_argument("--budgets", default="8192:16,16384:16,4096:16,8192:32,16384:32",
                        help="budget: max_num_batched_tokens:num_scheduler_steps pairs")
    parser.add_argument("--decode-repeat", type=int, default=1, help="decode: engines timed per shape")
    parser.add_argument("--kernel-variants", default="", help="decode: also time these KernelConfigs: no-pdl, "
                        "splits-16, no-fused")
    parser.add_argument("--compare", default="", help="another Ferrum checkout to measure beside this one")
    parser.add_argument("--prefix-len", type=int, default=1536, help="prefix: the shared prefix's tokens")
    parser.add_argument("--serve-refs", type=int, default=2, help="serve: offline references (1: before only)")
    parser.add_argument("--serve-concurrency", type=int, default=64, help="serve: HTTP concurrency = max_num_seqs")
    parser.add_argument("--serve-repeat", type=int, default=1, help="serve: offline and HTTP runs alternating")
    parser.add_argument("--cold-starts", default="first start,restart", help="cold: starts to time per variant")
    parser.add_argument("--prefix-requests", type=int, default=64, help="prefix: requests at once")
    parser.add_argument("--backend", default="cuda", help="cpu: a smoke test of the phases (with --model)")
    parser.add_argument("--model", type=Path, default=None, help="this model folder instead of the checkpoints")
    args = parser.parse_args()
    global BACKEND, MODEL_OVERRIDE
    BACKEND, MODEL_OVERRIDE = args.backend, args.model
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    bandwidth = None
    phases: dict[str, Callable[..., object]] = {
        "env": lambda: None, "tests": phase_tests, "correct": phase_correct, "offline": phase_offline,
        "serve": phase_serve, "cold": phase_cold, "memory": phase_memory, "prefix": phase_prefix,
        "timeline": phase_timeline, "roofline": phase_roofline,
        "budget": phase_budget,
    }
    for phase in args.phases.split(","):
        started = time.perf_counter()
        try:
            if phase == "env":
                bandwidth = phase_env(args)
            elif phase == "decode":
                phase_decode(args, bandwidth or phase_env(args))
            elif phase in phases:
                phases[phase](args)
            else:
                record(phase, "unknown phase", "skipped")
        except Exception as exc:  # one phase failing must not hide the others' results
            traceback.print_exc()
            record(phase, "FAILED", repr(exc)[:300])
        print(f"--- phase {phase} took {time.perf_counter() - started:.1f}s", flush=True)
        (args.out / "gpu_suite.json").write_text(json.dumps(RESULTS, indent=2))  # kept if a later phase is cut off
    print("\n==== results ====")
    for r in RESULTS:
        print(f"{r['phase']:8} | {r['name'][:70]:70} | {r['value']} {r['unit']} | {r['note']}")


if __name__ == "__main__":
    main()
