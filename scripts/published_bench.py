"""Published quantized checkpoints on a CUDA GPU, beside on-load quantization and bf16, in one run.

    python scripts/published_bench.py --out DIR [--shape llama-3.1-8b] [--formats gptq,awq,ct-w4a16,fp8]
        [--tests]

Writes, from the random bf16 checkpoint of --shape (scripts/make_random_checkpoint.py), one folder per
format with random integer codes in that format's documented layout (every linear layer quantized,
the output head in bf16: GPTQ 4-bit group 128 symmetric (checkpoint_format gptq), AWQ GEMM group 128,
compressed-tensors W4A16 group 128, FP8 per-tensor with dynamic or (fp8-static) static activation
scales), then for each, and for bf16, on-load int4 and
on-load fp8 from the bf16 folder: the start-up time (create_engine, weights to ready) and batch-1
decode (128-token prompt, 256 tokens) with the fraction of its floor: the bytes of every weight one
token reads as served (scales and zeros included) over the measured read bandwidth.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from gemv_bench import read_bandwidth  # noqa: E402
from gpu_suite import (  # noqa: E402 - shared GPU timing
    RESULTS,
    batch1_per_token,
    checkpoint,
    gpu_engine,
    print_results,
    record,
    record_offline,
)

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
GROUP = 128
_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the random codes are drawn
CONFIGS: dict[str, dict[str, Any]] = {
    "gptq": {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "sym": True, "desc_act": False,
             "checkpoint_format": "gptq"},
    "awq": {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"},
    "ct-w4a16": {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                 "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                     "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}}}},
    "fp8": {"quant_method": "fp8", "activation_scheme": "dynamic"},
    "fp8-static": {"quant_method": "fp8", "activation_scheme": "static"},
    "fp8-block": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    "gptq-w8": {"quant_method": "gptq", "bits": 8, "group_size": GROUP, "sym": True, "desc_act": False,
                "checkpoint_format": "gptq"},
}
# bytes per weight element of a linear layer as served, and per group of GROUP inputs
SERVED = {"gptq": (0.5, 4), "ct-w4a16": (0.5, 4), "awq": (0.5, 8), "int4": (0.5, 4), "fp8": (1.0, 0),
          "fp8-static": (1.0, 0), "bf16": (2.0, 0), "fp8-block": (1.0, 4), "gptq-w8": (1.0, 4),
          "gguf-q4k": (0.5, 12)}  # Q4_K in its own factors: 2 bytes a group of 32, 8 a super-block of 256
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def _words(shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    return torch.randint(-2**31, 2**31 - 1, shape, generator=gen, device=_DEVICE, dtype=torch.int32).cpu()


def _scales(shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return (torch.rand(shape, generator=gen, device=_DEVICE) * 0.002 + 0.0005).to(dtype).cpu()


def quantized_tensors(fmt: str, module: str, n: int, k: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random codes of an [n, k] weight in `fmt`'s layout."""
    g = k // GROUP
    if fmt == "gptq":
        return {f"{module}.qweight": _words((k // 8, n), gen), f"{module}.scales": _scales((g, n), gen),
                f"{module}.qzeros": torch.full((g, n // 8), 0x77777777, dtype=torch.int32),
                f"{module}.g_idx": (torch.arange(k) // GROUP).to(torch.int32)}
    if fmt == "awq":
        return {f"{module}.qweight": _words((k, n // 8), gen), f"{module}.qzeros": _words((g, n // 8), gen),
                f"{module}.scales": _scales((g, n), gen)}
    if fmt == "gptq-w8":
        return {f"{module}.qweight": _words((k // 4, n), gen), f"{module}.scales": _scales((g, n), gen),
                f"{module}.qzeros": torch.full((g, n // 4), 0x7F7F7F7F, dtype=torch.int32),
                f"{module}.g_idx": (torch.arange(k) // GROUP).to(torch.int32)}
    if fmt == "ct-w4a16":
        return {f"{module}.weight_packed": _words((n, k // 8), gen),
                f"{module}.weight_scale": _scales((n, g), gen, torch.bfloat16),
                f"{module}.weight_shape": torch.tensor([n, k])}
    weight = (torch.randn((n, k), generator=gen, device=_DEVICE) * 64).clamp(-448, 448).to(torch.float8_e4m3fn).cpu()
    if fmt == "fp8-block":
        blocks = (-(-n // 128), -(-k // 128))
        return {f"{module}.weight": weight, f"{module}.weight_scale_inv": _scales(blocks, gen, torch.float32)}
    if fmt == "fp8-static":  # room for activations up to 9 (random weights: their size is arbitrary)
        return {f"{module}.weight": weight, f"{module}.weight_scale": torch.tensor(0.0003),
                f"{module}.input_scale": torch.tensor(0.02)}
    return {f"{module}.weight": weight, f"{module}.weight_scale": torch.tensor(0.0003)}


def write_gguf_q4k(base: Path, out: Path) -> Path:
    """`base`'s shapes as a llama GGUF: every projection Q4_K (random codes, small float16 d and dmin),
    embeddings and output F16, norms F32, a byte-level BPE vocabulary of the model's size (one merge)."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter

    path = out / "model.Q4_K.gguf"
    if path.exists():
        return path
    out.mkdir(parents=True, exist_ok=True)
    c = json.loads((base / "config.json").read_text())
    rng = np.random.default_rng(5)
    writer = GGUFWriter(path.with_suffix(".tmp"), "llama")
    writer.add_block_count(c["num_hidden_layers"])
    writer.add_context_length(8192)
    writer.add_embedding_length(c["hidden_size"])
    writer.add_feed_forward_length(c["intermediate_size"])
    writer.add_head_count(c["num_attention_heads"])
    writer.add_head_count_kv(c["num_key_value_heads"])
    writer.add_rope_freq_base(float(c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta", 1e4)))
    writer.add_layer_norm_rms_eps(float(c["rms_norm_eps"]))
    writer.add_vocab_size(c["vocab_size"])
    writer.add_tokenizer_model("gpt2")
    alphabet = [chr(b) for b in range(33, 127)] + ['!"']
    writer.add_token_list(alphabet + [f"t{i}" for i in range(c["vocab_size"] - len(alphabet))])
    writer.add_token_merges(['! "'])
    writer.add_bos_token_id(c["vocab_size"] - 2)
    writer.add_eos_token_id(c["vocab_size"] - 1)
    h = c["hidden_size"]
    writer.add_tensor("token_embd.weight", (rng.standard_normal((c["vocab_size"], h)) * 0.02).astype(np.float16))
    writer.add_tensor("output.weight", (rng.standard_normal((c["vocab_size"], h)) * 0.02).astype(np.float16))
    writer.add_tensor("output_norm.weight", np.ones(h, dtype=np.float32))
    shapes = {}
    index = base / "model.safetensors.index.json"
    first = json.loads(index.read_text())["weight_map"]["model.layers.0.mlp.down_proj.weight"] if index.exists() else (
        "model.safetensors")
    with safe_open(str(base / first), "pt") as f:
        for key in f.keys():  # noqa: SIM118
            if key.startswith("model.layers.0.") and key.split(".")[-2] in LINEARS:
                shapes[key.split(".")[-2]] = tuple(f.get_slice(key).get_shape())
    for layer in range(c["num_hidden_layers"]):
        for norm in ("attn_norm", "ffn_norm"):
            writer.add_tensor(f"blk.{layer}.{norm}.weight", np.ones(h, dtype=np.float32))
        for proj, (n, k) in shapes.items():
            blocks = rng.integers(0, 256, (n * k // 256, 144), dtype=np.uint8)
            blocks[:, :4] = (rng.random((len(blocks), 2)) * 0.002 + 0.0005).astype(np.float16).view(np.uint8)
            writer.add_tensor(f"blk.{layer}.{GGUF_NAMES[proj]}.weight", blocks.reshape(n, -1),
                              raw_dtype=GGMLQuantizationType.Q4_K)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    path.with_suffix(".tmp").rename(path)
    return path


def write_published(base: Path, fmt: str, out: Path) -> Path:
    """`base` (bf16) with every linear layer but the head in `fmt`'s layout (one shard per base shard)."""
    if fmt == "gguf-q4k":
        return write_gguf_q4k(base, out)
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator(device=_DEVICE).manual_seed(3)
    index_path = base / "model.safetensors.index.json"
    files = sorted({*json.loads(index_path.read_text())["weight_map"].values()}) if index_path.exists() else [
        "model.safetensors"]
    weight_map: dict[str, str] = {}
    for name in files:
        tensors: dict[str, torch.Tensor] = {}
        with safe_open(str(base / name), "pt") as f:
            for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                module, _, leaf = key.rpartition(".")
                if leaf == "weight" and module.split(".")[-1] in LINEARS:
                    n, k = f.get_slice(key).get_shape()
                    tensors |= quantized_tensors(fmt, module, n, k, gen)
                else:
                    tensors[key] = f.get_tensor(key)
        save_file(tensors, str(tmp / name), metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, name)
    for extra in base.iterdir():
        if extra.suffix != ".safetensors" and extra.name != "model.safetensors.index.json":
            shutil.copy(extra, tmp / extra.name)
    if index_path.exists():
        (tmp / index_path.name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((base / "config.json").read_text())
    (tmp / "config.json").write_text(json.dumps({**config, "quantization_config": CONFIGS[fmt]}, indent=1))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def floor_bytes(folder: Path, served: str, base: Path) -> int:
    c = json.loads(((base if folder.suffix == ".gguf" else folder) / "config.json").read_text())
    h, i, v, layers = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["num_hidden_layers"]
    hd = c.get("head_dim") or h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    per_elem, per_group = SERVED[served]

    def linear(n: int, k: int) -> float:
        return n * k * per_elem + n * (k // GROUP) * per_group

    per_layer = linear(q + 2 * kv, h) + linear(h, q) + linear(2 * i, h) + linear(h, i) + 2 * 2 * h
    return int(layers * per_layer + 2 * v * h + 2 * h)


def startup_and_batch1(folder: Path, **settings: Any) -> tuple[float, float]:
    """Seconds from create_engine to ready, and gpu_suite's batch-1 seconds per token on that engine."""
    started = time.perf_counter()
    engine = gpu_engine(folder, max_num_seqs=8, max_model_len=2048, **settings)
    return time.perf_counter() - started, batch1_per_token(engine)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=Path("published-bench"))
    p.add_argument("--ckpt", type=Path, default=Path("/tmp/ferrum-ckpt"))
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--formats", default="gptq,awq,ct-w4a16,fp8")
    p.add_argument("--tests", action="store_true", help="the published formats' GPU tests first")
    p.add_argument("--no-batch1", action="store_true", help="skip the start-up and batch-1 runs")
    p.add_argument("--baselines", default="bf16,int4,fp8", help="the runs beside the formats: bf16, on-load int4 "
                   "and fp8 (the first of them the speed-up's reference)")
    p.add_argument("--offline", default="", help="labels to run `ferrum bench offline` for (256 requests), e.g. "
                   "bf16,int4 on load,gptq")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    props = torch.cuda.get_device_properties(0)
    record("env", "gpu", props.name, note=f"cc {props.major}.{props.minor}")
    bandwidth = read_bandwidth()
    record("env", "read bandwidth (2 GiB sum)", round(bandwidth / 1e9), "GB/s")
    if args.tests:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                               "tests/models/test_published.py", "tests/kernels/test_quant_kernels.py"],
                              capture_output=True, text=True, cwd=ROOT)
        record("tests", "published formats and quantized kernels on the GPU",
               done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "no output",
               note=done.stdout[-2500:].replace("\n", " | ") if done.returncode else "")
    base = checkpoint(args.shape, args.ckpt)
    baselines = {"bf16": ("bf16", base, {}, "bf16"),
                 "int4": ("int4 on load", base, {"quantization": {"method": "int4"}}, "int4"),
                 "fp8": ("fp8 on load", base, {"quantization": {"method": "fp8"}}, "fp8")}
    runs: list[tuple[str, Path, dict[str, Any], str]] = [baselines[b] for b in filter(None, args.baselines.split(","))]
    for fmt in filter(None, args.formats.split(",")):
        started = time.perf_counter()
        folder = write_published(base, fmt, args.ckpt / f"{args.shape}-{fmt}")
        record("write", fmt, round(time.perf_counter() - started, 1), "s", str(folder))
        runs.append((fmt, folder, {}, fmt))
    base_ms, base_label = None, ""
    for label, folder, settings, served in [] if args.no_batch1 else runs:
        try:
            ready, per_token = startup_and_batch1(folder, **settings)
        except Exception:  # noqa: BLE001 - recorded, the run goes on
            record("batch1", f"{args.shape} {label}", "failed", note=traceback.format_exc()[-1200:])
            continue
        floor_b = floor_bytes(folder, served, base)
        floor = floor_b / bandwidth
        if base_ms is None:
            base_ms, base_label = per_token, label
        speed = f", {base_ms / per_token:.3f}x {base_label}"
        record("batch1", f"{args.shape} {label}", round(per_token * 1e3, 3), "ms/token",
               f"floor {floor * 1e3:.3f} ms ({floor_b / 1e9:.2f} GB) -> {floor / per_token:.1%} "
               f"of floor{speed}; start-up {ready:.1f}s")
        (args.out / "published_bench.json").write_text(json.dumps(RESULTS, indent=1))
    wanted = set(filter(None, args.offline.split(",")))
    for label, folder, settings, _ in runs:
        if label in wanted:
            record_offline(f"{args.shape} {label}", folder, args.out / f"offline-{label.replace(' ', '-')}.json",
                           settings["quantization"]["method"] if settings else None)
    print_results(args.out / "published_bench.json")

if __name__ == "__main__":
    main()
