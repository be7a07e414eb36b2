"""The peer for batch-1 decode on a GPU: gpt-fast (pytorch-labs/gpt-fast, unmodified), its own
model, `quantize.py` handlers and `generate()` with `torch.compile(decode_one_token,
mode="reduce-overhead", fullgraph=True)` as its `--compile` does; random weights of a named shape
(no checkpoint can be downloaded on the GPU machine). Every linear, the output head included, is
quantized, as gpt-fast's quantize.py does.

    python scripts/gptfast_peer.py --gpt-fast DIR --shape llama-3.1-8b --mode bf16|int8|int4 [--groupsize 128]

Prints one JSON line: ms per decoded token (256 tokens after a 128-token prompt, the prefill timed
apart and taken out) and the bytes of every weight one token reads in the format served.
gpt-fast itself is not part of Ferrum: pass the folder of a checkout (its model.py, quantize.py,
generate.py, tokenizer.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

GPT_FAST_NAMES = {"llama-3.1-8b": "llama-3.1-8b", "llama-3.2-1b": "llama-3.2-1b"}


def adapt_int4_pack_api() -> Callable[[], None]:
    """gpt-fast's quantize.py hands `_convert_weight_to_int4pack` int32 codes [N, K]; since torch 2.5
    the op takes them packed two per byte (uint8 [N, K/2], the even input in the high nibble), as
    torchao packs them. Adapt the call while quantizing, not gpt-fast's file (the kernel it runs is
    the same); returns the undo, called before compiling (torch.compile needs the real op)."""
    convert = getattr(torch.ops.aten, "_convert_weight_to_int4pack")  # noqa: B009 - replaced below

    def packed_first(weight: torch.Tensor, inner_k_tiles: int) -> torch.Tensor:
        if weight.dtype == torch.int32:
            weight = ((weight[:, ::2] << 4) | weight[:, 1::2]).to(torch.uint8)
        return convert(weight, inner_k_tiles)

    setattr(torch.ops.aten, "_convert_weight_to_int4pack", packed_first)  # noqa: B010 - an op namespace
    return lambda: setattr(torch.ops.aten, "_convert_weight_to_int4pack", convert)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--gpt-fast", type=Path, required=True)
    p.add_argument("--shape", default="llama-3.1-8b")
    p.add_argument("--mode", choices=["bf16", "int8", "int4"], default="int4")
    p.add_argument("--groupsize", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--new-tokens", type=int, default=256)
    args = p.parse_args()
    sys.path.insert(0, str(args.gpt_fast.resolve()))
    import generate as gf  # type: ignore[import-not-found]  # gpt-fast's
    from model import ModelArgs, Transformer, transformer_configs  # type: ignore[import-not-found]

    name = GPT_FAST_NAMES[args.shape]
    if name not in transformer_configs:  # older checkouts: build from the 1B's numbers
        raise SystemExit(f"gpt-fast has no config {name!r}")
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Transformer(ModelArgs.from_name(name))
    model = model.to_empty(device="cuda").to(torch.bfloat16)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.02)
    if args.mode == "int8":
        from quantize import WeightOnlyInt8QuantHandler  # type: ignore[import-not-found]

        handler = WeightOnlyInt8QuantHandler(model)
        state = handler.create_quantized_state_dict()
        model = handler.convert_for_runtime()
        model.load_state_dict(state, assign=True)
    elif args.mode == "int4":
        from quantize import WeightOnlyInt4QuantHandler  # type: ignore[import-not-found]

        undo = adapt_int4_pack_api()

        handler4 = WeightOnlyInt4QuantHandler(model, args.groupsize)
        state = handler4.create_quantized_state_dict(use_cuda=True)
        undo()
        model = handler4.convert_for_runtime()
        model.load_state_dict(state, assign=True)
    model = model.to("cuda").eval()
    weight_bytes = sum(t.numel() * t.element_size() for n, t in model.state_dict().items()
                       if "tok_embeddings" not in n and "freqs_cis" not in n and "causal_mask" not in n
                       and "kv_cache" not in n)
    gf.decode_one_token = torch.compile(gf.decode_one_token, mode="reduce-overhead", fullgraph=True)
    prompt = torch.randint(0, 1000, (args.prompt_len,), device="cuda", dtype=torch.int)

    def run(new_tokens: int) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.no_grad():
            gf.generate(model, prompt, new_tokens, batch_size=1, interactive=False, draft_model=None,
                        temperature=0.0, top_k=None)
        torch.cuda.synchronize()
        return time.perf_counter() - started

    run(args.new_tokens)  # compile and warm up
    run(args.new_tokens)
    full = min(run(args.new_tokens) for _ in range(3))
    prefill_only = min(run(2) for _ in range(3))
    per_token = (full - prefill_only) / (args.new_tokens - 2)
    print(json.dumps({"peer": "gpt-fast", "shape": args.shape, "mode": args.mode, "groupsize": args.groupsize,
                      "ms_per_token": per_token * 1e3, "weight_bytes_per_token": weight_bytes}), flush=True)


if __name__ == "__main__":
    main()
