"""What rounding the decode GEMV's inputs to int8 costs in quality (KernelConfig.gemv_int4.int8_inputs), on
the demo model's real weights, on the CPU:

    python scripts/int8_inputs_quality.py [--model models/SmolLM2-135M-Instruct] [--group 128]

At one row the CUDA decode chain's int4 products (q/k/v, o, gate/up, down; the head when it is quantized)
take x rounded to int8 with one step a 32-input chunk (its largest magnitude / 127), and each product is
then exact (tests/kernels/test_quant_kernels.py::test_int4_gemv_with_int8_inputs). This script applies
that rounding to every such product's input in HF transformers' float32 Llama, on the weights int4
quantized and dequantized as the loader does, at every position of a fixed text (as if each token were
decoded), and prints the perplexity and the top-1 agreement with the unquantized model for: the
unquantized weights, int4, int4 with int8 inputs, and both again with the head quantized. Then the roundings
of int4's products of many rows on the int8 tensor cores (KernelConfig.int4_w8a8_rows: the weight
requantized to int8 per output channel, x to int8 per row; each alone; and scripts/w4a8_bench.py's
alternatives: both in fp8 e4m3, x to int8 per chunk of 64 or 192 inputs).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from ferrum.weights.quantization.arith import dequantize, quantize  # noqa: E402
from ferrum.weights.quantization.scheme import QuantScheme  # noqa: E402

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def int8_chunks(x: torch.Tensor, chunk: int = 32) -> torch.Tensor:
    """x [..., K] rounded to int8 with one step a chunk of inputs (max|chunk| / 127): of 32, as the GEMV rounds it."""
    chunks = x.float().reshape(*x.shape[:-1], -1, chunk)
    amax = chunks.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return ((chunks * inv).round() * (amax / 127.0)).reshape(x.shape).to(x.dtype)


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] rounded to int8 with one step a row (max|row| / 127), as quant_matmul's W8A8 products round it."""
    amax = x.float().abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return ((x.float() * inv).round() * (amax / 127.0)).to(x.dtype)


def fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] rounded to float8 e4m3 with one scale a row (max|row| / 448), as the fp8 W8A8 products round it."""
    amax = x.float().abs().amax(-1, keepdim=True).clamp_min(1e-12)
    return ((x.float() * (448.0 / amax)).to(torch.float8_e4m3fn).float() * (amax / 448.0)).to(x.dtype)


def int8_channels(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] rounded to int8 with one step an output channel (max|row| / 127): an int4 weight as the
    int4 W8A8 path (quant_matmul.requantize_int4) hands it to the int8 tensor cores."""
    return int8_rows(w)


def scored(model, ids: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-likelihood of each token but the first, top-1 prediction at each position) over windows of `window`
    tokens, each scoring the tokens past the previous window's half."""
    nll, top = [], []
    stride = window // 2
    start = 0
    with torch.no_grad():
        while True:
            end = min(start + window, ids.numel())
            logits = model(ids[start:end][None]).logits[0].float()
            first = 0 if start == 0 else window - stride
            logp = torch.log_softmax(logits[first:-1], dim=-1)
            nll.append(-logp.gather(1, ids[start + first + 1:end, None])[:, 0])
            top.append(logits[first:-1].argmax(-1))
            if end == ids.numel():
                break
            start += stride
    return torch.cat(nll), torch.cat(top)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct")
    parser.add_argument("--text", type=Path, default=ROOT / "tests" / "data" / "perplexity.txt")
    parser.add_argument("--group", type=int, default=128)
    parser.add_argument("--window", type=int, default=512)
    args = parser.parse_args()
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    ids = torch.tensor(Tokenizer.from_file(str(args.model / "tokenizer.json")).encode(args.text.read_text()).ids)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    linears = {name: mod for name, mod in model.named_modules() if name.rsplit(".", 1)[-1] in PROJECTIONS}
    head = model.lm_head
    originals = {name: mod.weight.data.clone() for name, mod in linears.items()}
    head_weight = head.weight.data.clone()  # (tied to the embedding in this model: untied below when quantized)
    scheme = QuantScheme("int4", args.group)

    def int4(w: torch.Tensor) -> torch.Tensor:
        return dequantize(quantize(w, scheme), torch.float32)

    quantized = {name: int4(w) for name, w in originals.items()}
    quantized_head = int4(head_weight)
    requantized = {name: int8_channels(w) for name, w in quantized.items()}
    as_fp8 = {name: fp8_rows(w) for name, w in quantized.items()}
    # int8 inputs on the projections (False, "chunks" or "rows"); on the head too (quantized)
    state: dict[str, bool | str] = {"inputs": False, "head": False}

    def rounded(which: str):
        def hook(_module, args):
            if not state[which]:
                return None
            how = {"rows": int8_rows, "fp8": fp8_rows, "g64": lambda x: int8_chunks(x, 64),
                   "g192": lambda x: int8_chunks(x, 192)}.get(str(state["inputs"]), int8_chunks)
            return (how(args[0]),)
        return hook

    hooks = [mod.register_forward_pre_hook(rounded("inputs")) for mod in linears.values()]
    hooks.append(head.register_forward_pre_hook(rounded("head")))  # a bf16 head is a bf16 GEMV: x as it is
    rows = {}
    base: tuple[torch.Tensor, torch.Tensor] | None = None  # the first row's (nll, top-1)
    for label, weights, head_int4, int8_inputs in (
            ("float32", "float32", False, False), ("int4", "int4", False, False),
            ("int4, int8 inputs", "int4", False, True), ("int4 head int4", "int4", True, False),
            ("int4 head int4, int8 inputs", "int4", True, True),
            ("int4 as int8 channels, int8 rows", "int4-int8", False, "rows"),
            ("int4 as int8 channels", "int4-int8", False, False), ("int4, int8 rows", "int4", False, "rows"),
            ("int4 as fp8 channels, fp8 rows", "int4-fp8", False, "fp8"),
            ("int4, int8 chunks of 64", "int4", False, "g64"), ("int4, int8 chunks of 192", "int4", False, "g192")):
        for name, mod in linears.items():
            stored = {"int4": quantized, "int4-int8": requantized, "int4-fp8": as_fp8}
            mod.weight.data = stored.get(weights, originals)[name]
        head.weight = torch.nn.Parameter(quantized_head if head_int4 else head_weight)
        state["inputs"], state["head"] = int8_inputs, int8_inputs and head_int4
        nll, top = scored(model, ids, args.window)
        base = base or (nll, top)
        ppl = math.exp(nll.mean().item())
        agree = torch.eq(top, base[1]).float().mean().item()
        rows[label] = {"perplexity": ppl, "ratio": ppl / math.exp(base[0].mean().item()), "top1_agreement": agree}
        print(f"{label:<30} perplexity {ppl:8.4f}  x{rows[label]['ratio']:.4f}  top-1 agreement {agree:.1%}",
              flush=True)
    for hook in hooks:
        hook.remove()
    print(json.dumps({"tokens": ids.numel(), "group": args.group, "rows": rows}))


if __name__ == "__main__":
    main()
