"""Checks and times Ferrum on a CUDA GPU in one go; prints a table at the end.

    python scripts/gpu_suite.py --phases env,kernels,correct,decode,offline --out DIR

Phases:
  env      GPU, versions, measured device-to-device copy bandwidth (bytes read + written)
  kernels  the Triton kernel tests, compiled (tests/test_triton_kernels.py, tests/test_triton_gemv.py,
           tests/test_*gpu*.py)
  correct  bf16 logits (prefill and decode, through the CUDA graphs) and greedy outputs vs HF
           transformers on the same random-weight Llama-3.2-1B and Qwen3-0.6B checkpoints
  decode   batch-1 decode ms/token vs the floor of weight bytes over measured bandwidth (1B; 8B
           with --with-8b), and HF transformers generate at batch 1 on the same weights
  offline  the offline workload (256 requests, 100-1024 in, 100-1024 out, ignore EOS) on the 1B
  hf       HF transformers' generate_batch (continuous batching) on the same requests, 512 out
  cold     time from `ferrum serve` to ready for the 8B shape; load rate vs safetensors load_file
  graphab  GPU time of the 1B batch-1 decode graph under --pdl-modes / --decode-splits variants
  serve    `ferrum bench serve` against `ferrum serve` at concurrency 64 vs offline at max_num_seqs 64
Random-weight checkpoints are made under --ckpt (scripts/make_random_checkpoint.py).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ferrum.models.triton_gemv import GemvConfig  # noqa: E402

RESULTS: list[dict] = []


def record(phase: str, name: str, value, unit: str = "", note: str = "") -> None:
    row = dict(phase=phase, name=name, value=value, unit=unit, note=note)
    RESULTS.append(row)
    print(f"[{phase}] {name}: {value} {unit} {note}", flush=True)


def checkpoint(shape: str, ckpt_root: Path) -> Path:
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
                t = f.get_slice(name)
                n = 1
                for d in t.get_shape():
                    n *= d
                total += n * 2
    return total


# -- phases -----------------------------------------------------------------------------------


def phase_env(args) -> float:
    props = torch.cuda.get_device_properties(0)
    record("env", "gpu", props.name, note=f"cc {props.major}.{props.minor}, {props.total_memory / 2**30:.1f} GiB")
    import triton

    record("env", "versions", f"torch {torch.__version__}, triton {triton.__version__}")
    n = 2 * 2**30 // 2
    x = torch.randn(n, device="cuda", dtype=torch.bfloat16)
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
    times.sort()
    bw = 2 * x.numel() * 2 / times[len(times) // 2]
    record("env", "copy bandwidth (read+write)", round(bw / 1e9), "GB/s")
    del x, y
    torch.cuda.empty_cache()
    return bw


def phase_kernels(args) -> None:
    tests = ["tests/test_triton_kernels.py", "tests/test_triton_gemv.py"]
    tests += [str(p.relative_to(ROOT)) for p in ROOT.glob("tests/test_*gpu*.py")]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
                          cwd=ROOT, capture_output=True, text=True)
    tail = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else proc.stderr[-500:]
    print(proc.stdout[-6000:], proc.stderr[-3000:])
    record("kernels", "pytest " + " ".join(tests), tail)


def make_engine(folder: Path, **overrides):
    from ferrum.engine.config import EngineConfig
    from ferrum.engine.llm_engine import LLMEngine

    settings = dict(model=str(folder), device="cuda", dtype="bfloat16", max_num_seqs=256,
                    max_num_batched_tokens=8192, max_model_len=4096)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def ferrum_logits(engine, prompt: list[int], continuation: list[int]) -> torch.Tensor:
    """Logits at the prompt's last position (prefill kernel), then at each continuation token fed
    one at a time (decode kernel, CUDA graph of batch 1)."""
    from ferrum.engine.sampling_params import SamplingParams
    from ferrum.engine.scheduler import ScheduledSequence
    from ferrum.engine.sequence import Sequence

    seq = Sequence(f"check-{time.monotonic_ns()}", list(prompt), SamplingParams(max_tokens=len(continuation) + 1), 0.0)
    engine.block_manager.grow(seq, len(prompt))
    rows = []
    logits, _ = engine.runner.execute([ScheduledSequence(seq, len(prompt))])
    rows.append(logits[0].float().cpu())
    for tok in continuation:
        seq.output_token_ids.append(tok)
        engine.block_manager.grow(seq, seq.num_tokens)
        logits, _ = engine.runner.execute([ScheduledSequence(seq, 1)])
        rows.append(logits[0].float().cpu())
    engine.block_manager.free(seq)
    return torch.stack(rows)


def phase_correct(args) -> None:
    from transformers import AutoModelForCausalLM

    from ferrum.engine.sampling_params import SamplingParams

    for shape in ("llama-3.2-1b", "qwen3-0.6b"):
        folder = checkpoint(shape, args.ckpt)
        vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
        rng = random.Random(0)
        cases = [([rng.randrange(vocab - 2) for _ in range(n)], [rng.randrange(vocab - 2) for _ in range(12)])
                 for n in (5, 77, 300)]
        hf32 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).cuda().eval()
        hf32_model = hf32
        ref32 = []
        with torch.no_grad():
            for p, c in cases:
                ref32.append(hf32(torch.tensor([p + c], device="cuda")).logits[0, len(p) - 1 : len(p) + len(c)].float().cpu())
        del hf32
        hf32_model = hf32_model.cpu()
        torch.cuda.empty_cache()
        hf16 = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
        ref16 = []
        hf_greedy = []
        prompts = [p for p, _ in cases]
        with torch.no_grad():
            for p, c in cases:
                ref16.append(hf16(torch.tensor([p + c], device="cuda")).logits[0, len(p) - 1 : len(p) + len(c)].float().cpu())
            for p in prompts:
                g = hf16.generate(torch.tensor([p], device="cuda"), max_new_tokens=32, do_sample=False,
                                  eos_token_id=None, pad_token_id=0)
                hf_greedy.append(g[0, len(p):].tolist())
        del hf16
        torch.cuda.empty_cache()
        engine = make_engine(folder, kv_cache_memory_gb=4.0, max_num_seqs=16)
        ours = [ferrum_logits(engine, p, c) for p, c in cases]
        outs = engine.generate(prompts, SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
        err_ours = max(float((o - r).abs().max()) for o, r in zip(ours, ref32))
        err_hf = max(float((h - r).abs().max()) for h, r in zip(ref16, ref32))
        scale = max(float(r.abs().max()) for r in ref32)
        top_ours = sum(int((o.argmax(-1) == r.argmax(-1)).sum()) for o, r in zip(ours, ref32))
        top_hf = sum(int((h.argmax(-1) == r.argmax(-1)).sum()) for h, r in zip(ref16, ref32))
        total = sum(r.shape[0] for r in ref32)
        ok = err_ours <= 2 * err_hf + 1e-3
        record("correct", f"{shape} bf16 logits max|ferrum - hf fp32|", round(err_ours, 4), "",
               f"HF bf16 vs HF fp32: {err_hf:.4f}; |logit| max {scale:.2f}; bound 2x HF's: {'PASS' if ok else 'FAIL'}")
        record("correct", f"{shape} top-1 agreement with HF fp32", f"ferrum {top_ours}/{total}, HF bf16 {top_hf}/{total}")
        matched = [sum(1 for _ in iter_prefix(a, b)) for a, b in zip(outs, hf_greedy)]
        # where the two greedy paths part, how far apart are the two chosen tokens in HF's fp32 logits?
        margins = []
        hf32_model = hf32_model.cuda()
        with torch.no_grad():
            for p, ours_out, theirs, n in zip(prompts, outs, hf_greedy, matched):
                if n == len(theirs):
                    continue
                logits = hf32_model(torch.tensor([p + theirs[:n]], device="cuda")).logits[0, -1].float()
                margins.append(round(abs(float(logits[ours_out[n]] - logits[theirs[n]])), 4))
        del hf32_model
        torch.cuda.empty_cache()
        near_ties = all(m <= 2 * err_hf for m in margins)
        record("correct", f"{shape} greedy 32 tokens == HF bf16 generate", f"{matched} tokens match of 32 per prompt",
               "", f"fp32 logit gap between the two tokens where they part: {margins} "
               f"({'all near-ties within 2x HF bf16 error: PASS' if near_ties else 'FAIL: a clear divergence'})")
        engine.release()
        del engine
        torch.cuda.empty_cache()


def iter_prefix(a: list[int], b: list[int]):
    for x, y in zip(a, b):
        if x != y:
            return
        yield x


def time_batch1_decode(folder: Path, prompt_len: int = 128, new_tokens: int = 256, **overrides) -> float:
    from ferrum.engine.sampling_params import SamplingParams

    engine = make_engine(folder, max_num_seqs=8, max_model_len=2048, **overrides)
    rng = random.Random(1)
    vocab = engine.model_config.vocab_size
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    engine.generate([[rng.randrange(vocab - 2) for _ in range(prompt_len)]], SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    engine.add_request("b1", [rng.randrange(vocab - 2) for _ in range(prompt_len)], params)
    engine.step()  # prefill + first token
    torch.cuda.synchronize()
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

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).cuda().eval()
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
    from ferrum.models import triton_kernels

    shapes = ["llama-3.2-1b"] + (["llama-3.1-8b"] if args.with_8b else [])
    default_mode = triton_kernels.PDL_MODE
    for shape in shapes:
        folder = checkpoint(shape, args.ckpt)
        nbytes = weight_bytes_read_per_token(folder)
        floor = nbytes / bandwidth
        per_token = time_batch1_decode(folder)
        record("decode", f"{shape} batch-1 decode", round(per_token * 1e3, 3), "ms/token",
               f"{1 / per_token:.0f} tok/s; floor {floor * 1e3:.3f} ms ({nbytes / 1e9:.2f} GB / {bandwidth / 1e9:.0f} GB/s)"
               f" -> {floor / per_token:.1%} of floor; PDL mode {default_mode}")
        # A/B of programmatic dependent launch modes and batch-1 attention splits, interleaved
        variants = [(int(m), None) for m in args.pdl_modes.split(",") if m] if args.pdl_modes else []
        variants += [(default_mode, int(n)) for n in args.decode_splits.split(",") if n] if args.decode_splits else []
        for _ in range(args.ab_repeat if variants else 0):
            for mode, splits in variants:
                with kernel_variant(mode, splits):
                    t = time_batch1_decode(folder)
                record("decode", f"{shape} batch-1 decode, {variant_label(mode, splits)}", round(t * 1e3, 3), "ms/token",
                       f"{floor / t:.1%} of floor")
        if shape == "llama-3.2-1b" and args.burst_sweep:
            for steps in (1, 8, 32, 64):
                t = time_batch1_decode(folder, num_scheduler_steps=steps)
                record("decode", f"{shape} batch-1 decode, num_scheduler_steps {steps}", round(t * 1e3, 3), "ms/token",
                       f"{floor / t:.1%} of floor")
        if args.with_hf:
            hf = hf_batch1_tokens_per_s(folder)
            record("decode", f"{shape} HF generate batch 1 (eager, bf16)", round(hf, 1), "tok/s",
                   f"ferrum {1 / per_token / hf:.1f}x")


def phase_bursts(args) -> None:
    """Host timeline of greedy bursts at batch 1 (1B): how long the host waits for each burst, how
    long from a burst's tokens to the next burst's launch, how long the launch call takes."""
    from ferrum.engine.sampling_params import SamplingParams

    folder = checkpoint("llama-3.2-1b", args.ckpt)
    engine = make_engine(folder, max_num_seqs=8, max_model_len=2048)
    runner = engine.runner
    marks: list[tuple[str, float]] = []
    read, launch = runner.read_greedy, runner.launch_greedy

    def timed_read(burst):
        marks.append(("read>", time.perf_counter()))
        out = read(burst)
        marks.append(("read<", time.perf_counter()))
        return out

    events: list[tuple[torch.cuda.Event, torch.cuda.Event, int]] = []

    def timed_launch(*a, **k):
        marks.append(("launch>", time.perf_counter()))
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        out = launch(*a, **k)
        e1.record()
        events.append((e0, e1, out.steps))
        marks.append(("launch<", time.perf_counter()))
        return out

    runner.read_greedy, runner.launch_greedy = timed_read, timed_launch
    engine.generate([list(range(1, 129))], SamplingParams(max_tokens=512, temperature=0, ignore_eos=True))
    gaps: dict[str, list[float]] = {"wait in read": [], "read -> next launch": [], "launch call": []}
    names = {("read>", "read<"): "wait in read", ("read<", "launch>"): "read -> next launch",
             ("launch>", "launch<"): "launch call"}
    for (a, ta), (b, tb) in zip(marks, marks[1:]):
        if (a, b) in names:
            gaps[names[(a, b)]].append((tb - ta) * 1e3)
    record("bursts", "llama-3.2-1b burst host timeline (ms, median)",
           ", ".join(f"{k} {statistics.median(v):.3f} (n={len(v)})" for k, v in gaps.items() if v))
    torch.cuda.synchronize()
    # the device's view: how long each burst kept the GPU busy, and how long it sat idle between
    busy = [e0.elapsed_time(e1) / steps for e0, e1, steps in events]
    idle = [events[i][1].elapsed_time(events[i + 1][0]) for i in range(len(events) - 1)]
    record("bursts", "llama-3.2-1b GPU per token within a burst / idle between bursts (ms, median)",
           f"{statistics.median(busy):.4f} / {statistics.median(idle):.3f}",
           note=f"{len(events)} bursts; idle total {sum(idle):.2f} ms over {sum(s for *_, s in events)} tokens")
    engine.release()


def phase_profile(args) -> None:
    """Where a batch-1 decode step's time goes: graph replay alone vs the whole engine step, host
    pieces, and the kernels of one eager decode forward."""
    from ferrum.engine.sampler import sample
    from ferrum.engine.sampling_params import SamplingParams

    for shape in ["llama-3.2-1b"] + (["llama-3.1-8b"] if args.with_8b else []):
        folder = checkpoint(shape, args.ckpt)
        engine = make_engine(folder, max_num_seqs=8, max_model_len=2048)
        runner = engine.runner
        engine.add_request("p", list(range(1, 129)), SamplingParams(max_tokens=1900, temperature=0, ignore_eos=True))
        for _ in range(5):
            engine.step()
        graph, _ = runner.graphs[1]

        def timed(fn, n=100):
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            for _ in range(n):
                fn()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) / n, (time.perf_counter() - t0) / n * 1e3

        gpu_ms, _ = timed(graph.replay)
        record("profile", f"{shape} decode graph replay (batch 1, GPU time)", round(gpu_ms, 3), "ms")
        step_gpu, step_wall = timed(engine.step, 50)
        per_step = engine.config.num_scheduler_steps
        record("profile", f"{shape} whole engine.step (batch 1)", round(step_wall, 3), "ms wall",
               f"{per_step} decodes per step (greedy burst): {step_wall / per_step:.3f} ms per token")
        seq = engine.sequences["p"]
        plan_ms = min(timed(lambda: engine.scheduler.schedule(), 1)[1] for _ in range(3))
        _, prep_ms = timed(lambda: runner._decode_with_graph([seq]), 50)
        logits = runner._decode_with_graph([seq])
        _, sample_ms = timed(lambda: sample(logits, [seq]), 50)
        record("profile", f"{shape} host pieces", f"schedule {plan_ms:.3f} ms, prep+replay launch {prep_ms:.3f} ms "
               f"(incl. GPU wait), sample {sample_ms:.3f} ms")
        # one step taken apart on the host clock: what the CPU does before and after the GPU's part
        from ferrum.engine.output_processor import OutputProcessor

        parts = {"schedule": 0.0, "execute (launch)": 0.0, "sample (waits for GPU)": 0.0, "outputs": 0.0}
        n = 50
        for _ in range(n):
            t0 = time.perf_counter()
            plan = engine.scheduler.schedule()
            t1 = time.perf_counter()
            logits, seqs = runner.execute(list(plan.scheduled))
            t2 = time.perf_counter()
            result = sample(logits, seqs)
            t3 = time.perf_counter()
            engine.outputs.append(seqs, result)
            [OutputProcessor.delta(q) for q in seqs]
            t4 = time.perf_counter()
            for key, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                parts[key] += dt / n * 1e3
        record("profile", f"{shape} step parts (host clock)", ", ".join(f"{k} {v:.3f} ms" for k, v in parts.items()))
        # the launch alone: host time of graph.replay() and of filling the inputs, GPU idle before
        launch, copies = 0.0, 0.0
        for _ in range(20):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            runner._load_graph_inputs([seq])
            t1 = time.perf_counter()
            graph.replay()
            t2 = time.perf_counter()
            copies += (t1 - t0) / 20 * 1e3
            launch += (t2 - t1) / 20 * 1e3
        torch.cuda.synchronize()
        record("profile", f"{shape} host time of filling the inputs / graph.replay()", f"{copies:.3f} / {launch:.3f} ms")
        from torch.profiler import ProfilerActivity, profile

        with torch.inference_mode():
            for _ in range(3):
                runner._decode_forward(1)
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(10):
                    runner._decode_forward(1)
                torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=20))
        engine.release()
        del engine
        torch.cuda.empty_cache()


# Kernel variants the decode and graphab phases time against the defaults: (PDL mode, spec), spec
# None (the defaults), n > 0 (n attention splits at batch 1), 0 (no attention at all: its cost in
# the chain, not a result), ("gemv", name) (a projection configuration below) or ("qkv",
# "qkv_whole") (q/k/v in one K slice).
GEMV_VARIANTS = {  # name: ((n, k) of the projection, its batch-1 configuration)
    "o_bn4": ((2048, 2048), GemvConfig(block_n=4, block_k=2048)),
    "o_bn1": ((2048, 2048), GemvConfig(block_n=1, block_k=2048, num_warps=2)),
    "gate_up_bn4": ((8192, 2048), GemvConfig(block_n=4, block_k=2048)),
    "gate_up_w2": ((8192, 2048), GemvConfig(block_n=2, block_k=2048, num_warps=2)),
    "down_w4": ((2048, 8192), GemvConfig(block_n=2, block_k=8192, num_warps=4)),
    "down_bk4096": ((2048, 8192), GemvConfig(block_n=2, block_k=4096, num_warps=4)),
    "down_bn1": ((2048, 8192), GemvConfig(block_n=1, block_k=8192, num_warps=4)),
    "lm_head_bn4": ((128256, 2048), GemvConfig(block_n=4, block_k=2048)),
    "lm_head_w8": ((128256, 2048), GemvConfig(block_n=4, block_k=2048, num_warps=8)),
    "down_bk8192_w8": ((2048, 8192), GemvConfig(block_n=2, block_k=8192, num_warps=8)),
    "down_bk2048": ((2048, 8192), GemvConfig(block_n=2, block_k=2048, num_warps=4)),
    "down_bk4096_w8": ((2048, 8192), GemvConfig(block_n=2, block_k=4096, num_warps=8)),
    "down_bn4_bk4096": ((2048, 8192), GemvConfig(block_n=4, block_k=4096, num_warps=4)),
    "gate_up_bk1024": ((8192, 2048), GemvConfig(block_n=2, block_k=1024, num_warps=4)),
    "o_bk1024": ((2048, 2048), GemvConfig(block_n=2, block_k=1024, num_warps=4)),
    "lm_head_bk1024": ((128256, 2048), GemvConfig(block_n=2, block_k=1024, num_warps=4)),
    # 8B shapes
    "8b_o_bk2048": ((4096, 4096), GemvConfig(block_n=2, block_k=2048, num_warps=4)),
    "8b_gate_up_bk2048": ((14336, 4096), GemvConfig(block_n=2, block_k=2048, num_warps=4)),
    "8b_down_bn2_w4": ((4096, 14336), GemvConfig(block_n=2, block_k=2048, num_warps=4)),
    "8b_lm_head_bk2048": ((128256, 4096), GemvConfig(block_n=2, block_k=2048, num_warps=4)),
}


@contextlib.contextmanager
def kernel_variant(mode: int, spec):
    """Kernels launched (and CUDA graphs captured) inside use the variant; the defaults after."""
    import triton

    from ferrum.models import triton_gemv, triton_kernels
    from ferrum.models.gpu_attention import TritonAttentionBatch

    saved = (triton_kernels.PDL_MODE, triton_kernels.decode_splits, triton_gemv.default_config,
             triton_gemv.qkv_block_k, TritonAttentionBatch.attend_stored)
    splits, config, qkv_block_k = saved[1], saved[2], saved[3]
    triton_kernels.PDL_MODE = mode
    if spec == ("qkv", "qkv_whole"):
        triton_gemv.qkv_block_k = lambda k, rows: triton.next_power_of_2(k) if rows == 1 else qkv_block_k(k, rows)
    elif isinstance(spec, tuple):
        (vn, vk), cfg = GEMV_VARIANTS[spec[1]]
        triton_gemv.default_config = (lambda n, k, rows, norm=False:
                                      cfg if (n, k, rows) == (vn, vk, 1) else config(n, k, rows, norm))
    elif spec == 0:
        TritonAttentionBatch.attend_stored = lambda self, layer, q, cache: q.view(-1, layer.q_size)
    elif spec is not None:
        triton_kernels.decode_splits = lambda b, kv, sms=132: spec if b == 1 else splits(b, kv, sms)
    try:
        yield
    finally:
        (triton_kernels.PDL_MODE, triton_kernels.decode_splits, triton_gemv.default_config,
         triton_gemv.qkv_block_k, TritonAttentionBatch.attend_stored) = saved


def variant_label(mode: int, spec) -> str:
    if isinstance(spec, tuple):
        what = "q/k/v in one K slice" if spec[0] == "qkv" else f"GEMV variant {spec[1]}: {GEMV_VARIANTS[spec[1]][1]}"
        return f"PDL mode {mode}, {what}"
    if spec == 0:
        return f"PDL mode {mode}, NO attention"
    return f"PDL mode {mode}" + (f", batch-1 attention splits {spec}" if spec else "")


def phase_graphab(args) -> None:
    """GPU time of the batch-1 decode graph (1B, or --graphab-shape) under variants of the kernels (PDL modes, attention
    splits), re-captured in one engine and timed in interleaved rounds: an A/B without the host's
    noise. Each timing replays the graph 200 times from the same sequence state (context 160-360)."""
    from ferrum.engine.sampling_params import SamplingParams
    from ferrum.models import triton_kernels

    folder = checkpoint(args.graphab_shape, args.ckpt)
    engine = make_engine(folder, max_num_seqs=8, max_model_len=2048)
    runner = engine.runner
    engine.add_request("p", list(range(1, 129)), SamplingParams(max_tokens=1900, temperature=0, ignore_eos=True))
    while engine.sequences["p"].num_computed_tokens < 160:
        engine.step()
    torch.cuda.synchronize()  # a burst may still be queued: its tokens are not needed here
    seq = engine.sequences["p"]
    default_mode = triton_kernels.PDL_MODE
    variants = [(int(m), None) for m in (args.pdl_modes or "0,1").split(",")]
    variants += [(default_mode, int(n)) for n in args.decode_splits.split(",") if n] if args.decode_splits else []
    if args.no_attention:  # splits 0: attention left out of the graph (its cost in the chain, not a result)
        variants.append((default_mode, 0))
    variants += [(default_mode, ("gemv", name)) for name in filter(None, args.gemv_variants.split(","))]
    variants += [(default_mode, ("qkv", name)) for name in filter(None, args.qkv_variants.split(","))]
    times: dict[tuple, list[float]] = {v: [] for v in variants}
    kept: list[dict] = []

    def replay_time(graph: torch.cuda.CUDAGraph, warm_up: int = 0, n: int = 200) -> float:
        """GPU ms a replay, over n replays from the sequence's state (after warm_up replays)."""
        for _ in range(warm_up):
            graph.replay()
        runner._load_graph_inputs([seq])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / n

    with torch.inference_mode():
        for _ in range(args.ab_repeat):
            for mode, splits in variants:
                kept.append(runner.graphs)  # not destroyed mid-run: a fresh set beside them
                runner.graphs = {}
                with kernel_variant(mode, splits):
                    runner._capture_graphs()
                times[(mode, splits)].append(replay_time(runner.graphs[1][0], warm_up=10))
        # the engine's own graphs (captured at start-up), and bursts as the engine queues them: a
        # burst of 16 replays (with its table upload and token copy) queued behind another
        runner.graphs = kept[0]
        init_graph = runner.graphs[1][0]
        burst_times, init_times = [], []
        engine.block_manager.grow(seq, seq.num_computed_tokens + 64)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(args.ab_repeat):
            init_times.append(replay_time(init_graph))
            for _ in range(5):
                runner._load_graph_inputs([seq])
                runner.launch_greedy([seq], 16)
                a.record()
                runner.launch_greedy([seq], 16, continue_at=[seq.num_computed_tokens + 16])
                b.record()
                b.synchronize()
                burst_times.append(a.elapsed_time(b) / 16)
    record("graphab", f"{args.graphab_shape} batch-1 decode graph captured at start-up", round(min(init_times) * 1e3, 1),
           "us (GPU, best round)", "rounds: " + ", ".join(f"{t * 1e3:.1f}" for t in init_times))
    record("graphab", f"{args.graphab_shape} batch-1 burst of 16 behind another, per token", round(statistics.median(burst_times) * 1e3, 1),
           "us (GPU, median)", "all: " + ", ".join(f"{t * 1e3:.1f}" for t in burst_times))
    for (mode, splits), ts in times.items():
        record("graphab", f"{args.graphab_shape} batch-1 decode graph, {variant_label(mode, splits)}", round(min(ts) * 1e3, 1), "us (GPU, best round)",
               "rounds: " + ", ".join(f"{t * 1e3:.1f}" for t in ts))
    engine.release()
    del engine
    torch.cuda.empty_cache()


def phase_timeline(args) -> None:
    """The offline workload at max_num_seqs 64 and 256, each step timed on the host clock and
    classed as a graph decode step or an eager (prefill / mixed) step."""
    from ferrum.engine.output_processor import OutputProcessor
    from ferrum.engine.sampler import sample
    from ferrum.engine.sampling_params import SamplingParams

    folder = checkpoint("llama-3.2-1b", args.ckpt)
    for max_seqs in (64, 256):
        engine = make_engine(folder, max_num_seqs=max_seqs, max_model_len=2048)
        work = offline_workload(args.num_prompts, engine.model_config.vocab_size)
        for i, (prompt, out_len) in enumerate(work):
            engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=out_len, temperature=0, ignore_eos=True))
        stats = {k: [0, 0.0, 0.0, 0.0, 0.0, 0.0] for k in ("decode", "eager")}  # n, sched, exec, sample, out, tokens
        started = time.perf_counter()
        while engine.has_work:
            t0 = time.perf_counter()
            plan = engine.scheduler.schedule()
            kind = "decode" if all(x.is_decode for x in plan.scheduled) else "eager"
            t1 = time.perf_counter()
            logits, seqs = engine.runner.execute(list(plan.scheduled))
            t2 = time.perf_counter()
            result = sample(logits, seqs)
            t3 = time.perf_counter()
            engine.outputs.append(seqs, result)
            for q in seqs:
                OutputProcessor.delta(q)
                if q.is_finished:
                    engine.scheduler.remove(q)
                    engine.sequences.pop(q.request_id, None)
            t4 = time.perf_counter()
            row = stats[kind]
            row[0] += 1
            row[1] += t1 - t0
            row[2] += t2 - t1
            row[3] += t3 - t2
            row[4] += t4 - t3
            row[5] += sum(x.num_new_tokens for x in plan.scheduled)
        total = time.perf_counter() - started
        for kind, (n, a, b, c, d, toks) in stats.items():
            if n:
                record("timeline", f"max_num_seqs {max_seqs}: {kind} steps", n, "steps",
                       f"{(a + b + c + d) / total:.0%} of {total:.1f}s; per step ms: schedule {a / n * 1e3:.2f}, "
                       f"execute {b / n * 1e3:.2f}, sample(wait) {c / n * 1e3:.2f}, outputs {d / n * 1e3:.2f}; "
                       f"{toks / n:.0f} tokens/step")
        engine.release()
        del engine
        torch.cuda.empty_cache()


def phase_eager(args) -> None:
    """One mixed step (a 850-token prompt beside 50 decodes) under the profiler: where its time goes."""
    from torch.profiler import ProfilerActivity, profile

    from ferrum.engine.sampling_params import SamplingParams
    from ferrum.engine.scheduler import ScheduledSequence
    from ferrum.engine.sequence import Sequence

    folder = checkpoint("llama-3.2-1b", args.ckpt)
    engine = make_engine(folder, max_num_seqs=64, max_model_len=2048)
    rng = random.Random(3)
    vocab = engine.model_config.vocab_size

    def seq(n: int) -> Sequence:
        s = Sequence(f"e{time.monotonic_ns()}", [rng.randrange(vocab - 2) for _ in range(n)],
                     SamplingParams(max_tokens=8), 0.0)
        engine.block_manager.grow(s, n + 1)
        return s

    decodes = []
    for _ in range(50):
        s = seq(600)
        s.num_computed_tokens = 599  # its cache holds (garbage) k/v: only the timing matters here
        decodes.append(s)

    def mixed_step() -> float:
        prompt = seq(850)
        plan = [ScheduledSequence(d, 1) for d in decodes] + [ScheduledSequence(prompt, 850)]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        logits, _ = engine.runner.execute(plan)
        logits.argmax(-1).tolist()
        for d in decodes:
            d.num_computed_tokens -= 1
        engine.block_manager.free(prompt)
        return time.perf_counter() - t0

    for _ in range(3):
        mixed_step()
    wall = sorted(mixed_step() for _ in range(5))[2]
    record("eager", "mixed step: 850-token prompt + 50 decodes", round(wall * 1e3, 2), "ms wall")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        mixed_step()
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15))
    engine.release()


def offline_workload(num: int, vocab: int, seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [([rng.randrange(vocab - 2) for _ in range(rng.randint(100, 1024))], rng.randint(100, 1024))
            for _ in range(num)]


def phase_offline(args) -> float:
    """`ferrum bench offline` with its defaults (256 requests, 100-1024 in and out, ignore EOS) on the 1B."""
    folder = checkpoint("llama-3.2-1b", args.ckpt)
    res = bench("offline", "--model", str(folder), "--max-model-len", "2048", "--num-prompts", str(args.num_prompts),
                "--output-json", str(args.out / "offline.json"))
    rate = res["output_tokens_per_s"]
    record("offline", f"ferrum bench offline, llama-3.2-1b, {res['num_requests']} req", round(rate), "output tok/s",
           f"{res['elapsed_s']:.1f}s, {res['total_output_tokens']} tokens (as requested: "
           f"{res['output_tokens_as_requested']}), max_num_seqs {res['engine']['max_num_seqs']}")
    return rate


def phase_hf(args, ferrum_rate: float | None) -> None:
    from transformers import AutoModelForCausalLM, GenerationConfig

    folder = checkpoint("llama-3.2-1b", args.ckpt)
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    work = offline_workload(args.num_prompts, vocab)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16, attn_implementation="sdpa").cuda().eval()
    gen = GenerationConfig(max_new_tokens=args.hf_out, do_sample=False, eos_token_id=-1, pad_token_id=0,
                           use_cuda_graph=False)
    model.generate_batch(inputs=[p for p, _ in work[:4]], generation_config=GenerationConfig(
        max_new_tokens=8, do_sample=False, eos_token_id=-1, pad_token_id=0))
    torch.cuda.synchronize()
    started = time.perf_counter()
    results = model.generate_batch(inputs=[p for p, _ in work], generation_config=gen)
    elapsed = time.perf_counter() - started
    generated = sum(len(r.generated_tokens) for r in results.values())
    rate = generated / elapsed
    ratio = f"ferrum {ferrum_rate / rate:.1f}x" if ferrum_rate else ""
    record("hf", f"HF generate_batch {len(work)} req, {args.hf_out} out", round(rate), "output tok/s",
           f"{elapsed:.1f}s, {generated} tokens; {ratio}")
    del model
    torch.cuda.empty_cache()


def start_server(folder: Path, port: int, log_path: Path, *extra: str) -> tuple[subprocess.Popen, float]:
    """Starts `ferrum serve`; returns the process and the seconds until /health answered 200."""
    import urllib.request

    cmd = [sys.executable, "-m", "ferrum.cli", "serve", "--model", str(folder), "--port", str(port),
           "--backend", "cuda", *extra]
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, start_new_session=True)
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"ferrum serve exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return proc, time.perf_counter() - started
        except OSError:
            pass
        if time.perf_counter() - started > 300:
            raise RuntimeError("ferrum serve did not become ready in 300 s")
        time.sleep(0.05)


def stop_server(proc: subprocess.Popen) -> None:
    import signal

    os.killpg(proc.pid, signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def bench(*argv: str) -> dict:
    out = Path(argv[argv.index("--output-json") + 1])
    proc = subprocess.run([sys.executable, "-m", "ferrum.cli", "bench", *argv], cwd=ROOT, capture_output=True,
                          text=True)
    print(proc.stdout[-3000:], proc.stderr[-1500:])
    return json.loads(out.read_text())


def phase_serve(args) -> None:
    """HTTP at concurrency 64 (engine in its own process, and on a thread for comparison) vs the
    offline engine at max_num_seqs 64, same workload. The offline reference runs before and after
    the HTTP runs (it varied by up to 10% from one run to the next on the H100) and the two are
    averaged."""
    folder = checkpoint("llama-3.2-1b", args.ckpt)
    common = ["--num-prompts", str(args.num_prompts), "--seed", "0"]
    engine_flags = ["--max-num-seqs", "64", "--max-model-len", "2048"]

    def offline_c64(name: str, note: str = "") -> float:
        res = bench("offline", "--model", str(folder), *engine_flags, *common,
                    "--output-json", str(args.out / f"{name}.json"))
        record("serve", f"offline, max_num_seqs 64{note}", round(res["output_tokens_per_s"]), "output tok/s")
        return res["output_tokens_per_s"]

    before = offline_c64("offline_c64")
    results = {}
    for mode in ("on", "off"):
        proc, ready = start_server(folder, 8011, args.out / f"serve_{mode}.log", *engine_flags,
                                   "--engine-process", mode)
        try:
            levels = [args.serve_levels] if mode == "on" else ["64"]
            extra = ["--plot", str(args.out / "serve_latency.png")] if mode == "on" else []
            res = bench("serve", "--url", "http://127.0.0.1:8011", "--tokenizer", str(folder), "--concurrency",
                        *levels, *common, "--output-json", str(args.out / f"serve_{mode}.json"), *extra)
        finally:
            stop_server(proc)
        results[mode] = res
    reference = (before + offline_c64("offline_c64_after", " (again, after the HTTP runs)")) / 2
    record("serve", "offline, max_num_seqs 64, mean of the two", round(reference), "output tok/s")
    for mode, res in results.items():
        for lvl in res["levels"]:
            c = lvl["concurrency"]
            note = (f"TTFT p50/p99 {lvl['ttft_ms']['median']:.0f}/{lvl['ttft_ms']['p99']:.0f} ms, TPOT p50/p99 "
                    f"{lvl['tpot_ms']['median']:.2f}/{lvl['tpot_ms']['p99']:.2f} ms, ITL p50 {lvl['itl_ms']['median']:.2f} ms, "
                    f"failed {lvl['failed']}")
            if c == 64:
                note += f"; {lvl['output_throughput'] / reference:.0%} of offline (mean)"
            record("serve", f"HTTP c={c} engine process {mode}", round(lvl["output_throughput"]), "output tok/s", note)


def phase_cold(args) -> None:
    """`ferrum serve` to ready for the 8B shape (warm page cache, as load_file's figure is), with the
    weight-load rate beside safetensors.torch.load_file(device="cuda") of the same files."""
    from safetensors.torch import load_file

    folder = checkpoint("llama-3.1-8b", args.ckpt)
    files = sorted(folder.glob("*.safetensors"))
    nbytes = sum(f.stat().st_size for f in files)
    for f in files:  # warm the page cache for both readers alike
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    torch.cuda.synchronize()
    started = time.perf_counter()
    for f in files:
        tensors = load_file(str(f), device="cuda")
        del tensors
    torch.cuda.synchronize()
    lf = time.perf_counter() - started
    torch.cuda.empty_cache()
    record("cold", "safetensors load_file(device=cuda), 8B", round(nbytes / 1e9 / lf, 2), "GB/s", f"{lf:.2f}s")
    # the two loaders again, one after the other in this process, same page-cache state
    from ferrum.models.loader import load_model

    for label, load in (("ferrum load_model", lambda: load_model(folder, torch.bfloat16, "cuda")),
                        ("safetensors load_file", lambda: [load_file(str(f), device="cuda") for f in files])):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loaded = load()
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        del loaded
        torch.cuda.empty_cache()
        record("cold", f"{label} (in this process, after the first pair)", round(nbytes / 1e9 / dt, 2), "GB/s", f"{dt:.2f}s")
    for attempt in ("first start (Triton compiles its kernels)", "restart (Triton's kernel cache warm)"):
        log_path = args.out / f"cold_8b_{attempt[:5].strip()}.log"
        proc, ready = start_server(folder, 8012, log_path, "--max-model-len", "8192")
        stop_server(proc)
        lines = log_path.read_text().splitlines()
        load_line = next((ln for ln in lines if "loaded" in ln and "GB of weights" in ln), "")
        parts = [ln.split(": ", 1)[-1] for ln in lines if "captured" in ln or "warmed up" in ln]
        record("cold", f"ferrum serve -> ready, 8B, local disk, {attempt}", round(ready, 2), "s",
               load_line.split("ferrum.models.loader")[-1].strip() + "; " + "; ".join(parts))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phases", default="env,kernels,correct,decode,offline")
    parser.add_argument("--ckpt", type=Path, default=Path("/tmp/ferrum-ckpt"))
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp")))
    parser.add_argument("--num-prompts", type=int, default=256)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--hf-out", type=int, default=512)
    parser.add_argument("--offline-limit-s", type=float, default=300.0)
    parser.add_argument("--with-8b", action="store_true")
    parser.add_argument("--serve-levels", default="8,16,32,64")
    parser.add_argument("--with-hf", action="store_true")
    parser.add_argument("--burst-sweep", action="store_true", help="decode: also time other num_scheduler_steps")
    parser.add_argument("--pdl-modes", default="", help="decode: also time these PDL modes, e.g. 0,1,2")
    parser.add_argument("--decode-splits", default="", help="decode: also time these batch-1 attention splits")
    parser.add_argument("--qkv-variants", default="", help="graphab: also time these q/k/v slicings (qkv_whole)")
    parser.add_argument("--graphab-shape", default="llama-3.2-1b", help="graphab: the checkpoint shape")
    parser.add_argument("--gemv-variants", default="", help="graphab: also time these GEMV configurations (names in phase_graphab)")
    parser.add_argument("--no-attention", action="store_true", help="graphab: also time the graph without attention")
    parser.add_argument("--ab-repeat", type=int, default=2, help="rounds of the --pdl-modes/--decode-splits variants")
    args = parser.parse_args()
    phases = args.phases.split(",")
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    bandwidth = None
    ferrum_rate = None
    for phase in phases:
        started = time.perf_counter()
        try:
            if phase == "env":
                bandwidth = phase_env(args)
            elif phase == "kernels":
                phase_kernels(args)
            elif phase == "correct":
                phase_correct(args)
            elif phase == "decode":
                phase_decode(args, bandwidth or phase_env(args))
            elif phase == "timeline":
                phase_timeline(args)
            elif phase == "eager":
                phase_eager(args)
            elif phase == "profile":
                phase_profile(args)
            elif phase == "graphab":
                phase_graphab(args)
            elif phase == "bursts":
                phase_bursts(args)
            elif phase == "offline":
                ferrum_rate = phase_offline(args)
            elif phase == "serve":
                phase_serve(args)
            elif phase == "cold":
                phase_cold(args)
            elif phase == "hf":
                phase_hf(args, ferrum_rate)
            else:
                record(phase, "unknown phase", "skipped")
        except Exception as exc:  # one phase failing must not hide the others' results
            traceback.print_exc()
            record(phase, "FAILED", repr(exc)[:300])
        print(f"--- phase {phase} took {time.perf_counter() - started:.1f}s", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "gpu_suite.json").write_text(json.dumps(RESULTS, indent=2))  # kept if a later phase is cut off
    print("\n==== results ====")
    for r in RESULTS:
        print(f"{r['phase']:8} | {r['name'][:60]:60} | {r['value']} {r['unit']} | {r['note']}")


if __name__ == "__main__":
    main()
