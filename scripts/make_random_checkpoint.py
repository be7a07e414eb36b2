"""Writes a random-weight checkpoint with a real model's shapes, as an HF model folder.

For machines that cannot download weights (the GPU benchmark machine): the shapes, dtype and
file layout are those of the real model, so load times, memory, bandwidth and throughput are
the real model's; only the numbers in the tensors are random. The tokenizer is synthetic: one
word "t<id>" per token id (whitespace-separated), with the model's vocabulary size, so that any
token id round-trips through text.

    python scripts/make_random_checkpoint.py --shape llama-3.2-1b --out /tmp/llama-3.2-1b [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ferrum.tokenizer.synthetic import write_synthetic_tokenizer  # noqa: E402  (this checkout's ferrum)

SHAPES: dict[str, dict] = {
    "llama-3.2-1b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=128256,
        tie_word_embeddings=True, rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_scaling=dict(rope_type="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        hidden_act="silu", attention_bias=False, mlp_bias=False,
    ),
    "llama-3.1-8b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, intermediate_size=14336,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        tie_word_embeddings=False, rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        hidden_act="silu", attention_bias=False, mlp_bias=False,
    ),
    "llama-3.1-70b": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=8192, intermediate_size=28672,
        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, head_dim=128, vocab_size=128256,
        tie_word_embeddings=False, rope_theta=500000.0, max_position_embeddings=131072, rms_norm_eps=1e-5,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=8192),
        hidden_act="silu", attention_bias=False, mlp_bias=False,
    ),
    "qwen3-0.6b": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024, intermediate_size=3072,
        num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
        tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=40960, rms_norm_eps=1e-6,
        hidden_act="silu", attention_bias=False,
    ),
    # mixtures of experts: every layer sparse
    "qwen3-30b-a3b": dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144,
        moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        vocab_size=151936, tie_word_embeddings=False, rope_theta=1000000.0, max_position_embeddings=40960,
        rms_norm_eps=1e-6, hidden_act="silu", attention_bias=False, use_sliding_window=False,
    ),
    "mixtral-8x7b": dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=4096, intermediate_size=14336,
        num_local_experts=8, num_experts_per_tok=2, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=8, head_dim=128, vocab_size=32000, tie_word_embeddings=False, rope_theta=1000000.0,
        max_position_embeddings=32768, rms_norm_eps=1e-5, hidden_act="silu", sliding_window=None,
    ),
}

SHARD_BYTES = 5 * 2**30


def tensor_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    h, d = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c["vocab_size"], h), "model.norm.weight": (h,)}
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, q),
        }
        shapes |= mlp_shapes(c, p)
        if c["model_type"] in ("qwen3", "qwen3_moe"):
            shapes |= {p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)}
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (c["vocab_size"], h)
    return shapes


def mlp_shapes(c: dict, p: str) -> dict[str, tuple[int, ...]]:
    """A layer's MLP: a dense gated MLP, or a mixture's router and experts (their checkpoint names)."""
    h, i = c["hidden_size"], c["intermediate_size"]
    if c["model_type"] == "qwen3_moe":
        e, i = c["num_experts"], c["moe_intermediate_size"]
        block, names = p + "mlp.", ("gate_proj", "up_proj", "down_proj")
    elif c["model_type"] == "mixtral":
        e, block, names = c["num_local_experts"], p + "block_sparse_moe.", ("w1", "w3", "w2")
    else:
        return {p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                p + "mlp.down_proj.weight": (h, i)}
    shapes: dict[str, tuple[int, ...]] = {block + "gate.weight": (e, h)}
    for n in range(e):
        shapes |= {f"{block}experts.{n}.{names[0]}.weight": (i, h), f"{block}experts.{n}.{names[1]}.weight": (i, h),
                   f"{block}experts.{n}.{names[2]}.weight": (h, i)}
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator, device: str) -> torch.Tensor:
    if len(shape) == 1:  # norms: around 1, as trained models have them
        t = 1.0 + 0.05 * torch.randn(shape, generator=gen, device=device)
    else:
        t = 0.02 * torch.randn(shape, generator=gen, device=device)
    return t.to(torch.bfloat16)


def _nbytes(shape: tuple[int, ...]) -> int:
    n = 2  # bf16
    for d in shape:
        n *= d
    return n


def plan_files(shapes: dict[str, tuple[int, ...]]) -> dict[str, list[str]]:
    """File name -> its tensors, in order, each file up to SHARD_BYTES (HF's naming)."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        if size and size + _nbytes(shape) > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += _nbytes(shape)
    if len(groups) == 1:
        return {"model.safetensors": groups[0]}
    return {f"model-{n:05d}-of-{len(groups):05d}.safetensors": g for n, g in enumerate(groups, 1)}


def device_for(device: str, n: int) -> str:
    """The device file n's tensors are drawn on: "cuda" spreads the files over every GPU."""
    if device == "cuda" and torch.cuda.device_count() > 1:
        return f"cuda:{n % torch.cuda.device_count()}"
    return device


def write_file(path: Path, shapes: dict[str, tuple[int, ...]], seed: int, device: str) -> None:
    """One safetensors file of random tensors (its own generator, so files can be written in any order)."""
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {name: random_tensor(name, shape, gen, device).cpu() for name, shape in shapes.items()}
    save_file(tensors, str(path), metadata={"format": "pt"})


TILE_BYTES = 64 * 2**20


def write_file_tiled(path: Path, shapes: dict[str, tuple[int, ...]], seed: int, device: str) -> None:
    """As write_file, but every matrix repeats one 64 MiB block of random numbers (norms are drawn
    whole): no number drawn past the first block, so a 141 GB checkpoint takes the time of writing
    it. The file is safetensors as its format note has it: a little-endian u64 header length, the
    JSON header (dtype, shape, data offsets), the raw bytes."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    draws = random_tensor("tile", (TILE_BYTES // 2,), gen, "cpu") - 1.0  # 1-D draws are norm-like: around 0 now
    tile = (draws * 0.4).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()  # std 0.02, as random_tensor's
    header: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in shapes.items():
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + _nbytes(shape)]}
        offset += _nbytes(shape)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for name, shape in shapes.items():
            if len(shape) == 1:
                f.write(random_tensor(name, shape, gen, "cpu").view(torch.uint8).numpy().tobytes())
                continue
            left = _nbytes(shape)
            while left:
                chunk = min(left, len(tile))
                f.write(tile[:chunk])
                left -= chunk


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiled", action="store_true",
                        help="every matrix repeats one 64 MiB random block: a 70B checkpoint in the time of "
                             "writing it (the numbers only need to be random-looking for timings)")
    parser.add_argument("--workers", type=int, default=1,
                        help="files written in parallel, one process each (on GPUs: spread over every GPU); "
                             "each holds one file of up to 5 GiB twice")
    parser.add_argument("--tokenizer-from", type=Path, metavar="FOLDER",
                        help="a real model folder whose tokenizer (and chat template) to use instead of the synthetic "
                             "one; the vocabulary size and BOS/EOS ids follow it (for grammars, which need real text)")
    args = parser.parse_args()
    started = time.perf_counter()
    shape = dict(SHAPES[args.shape])
    ids = {"bos_token_id": shape["vocab_size"] - 2, "eos_token_id": shape["vocab_size"] - 1}
    if args.tokenizer_from is not None:
        real = json.loads((args.tokenizer_from / "config.json").read_text())
        shape["vocab_size"] = real["vocab_size"]
        ids = {k: real[k] for k in ("bos_token_id", "eos_token_id")}
    config = dict(shape, torch_dtype="bfloat16", **ids)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(ids))
    if args.tokenizer_from is None:
        write_synthetic_tokenizer(out, config["vocab_size"])
    else:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
            if (args.tokenizer_from / name).is_file():
                (out / name).write_bytes((args.tokenizer_from / name).read_bytes())

    shapes = tensor_shapes(config)
    files = plan_files(shapes)
    writer = write_file_tiled if args.tiled else write_file
    jobs = [(out / name, {t: shapes[t] for t in names}, args.seed * 100003 + n, device_for(args.device, n))
            for n, (name, names) in enumerate(files.items())]
    if args.workers > 1 and len(jobs) > 1:  # a file a process: a 70B checkpoint in minutes, not an hour
        import multiprocessing

        with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
            pool.starmap(writer, jobs)
    else:
        for job in jobs:
            writer(*job)
    total = sum(_nbytes(shape) for shape in shapes.values())
    if len(files) > 1:
        weight_map = {t: name for name, names in files.items() for t in names}
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    print(f"{args.shape}: {total / 1e9:.2f} GB of bf16 weights in {len(files)} file(s) at {out} "
          f"({time.perf_counter() - started:.1f}s)")


if __name__ == "__main__":
    main()
