"""What an int8 KV cache costs the demo model, apart from every other rounding: transformers in float32 with
its keys (after rope) and values quantized per token and head as kv_cache_dtype int8 stores them (int8 at
max|x| / 127), optionally with the keys smoothed per rotary pair by a calibrated scale (max^alpha over a
calibration text, its inverse in the queries). Prints, per setting, the demo's first-token margin on
"What is the capital of France?" ("The" against "L", a near-tie in float32) and the perplexity of
tests/data/perplexity.txt (768 tokens).

    python scripts/kv_int8_margin.py [--model models/SmolLM2-135M-Instruct]

Not a test; transformers is the reference here, as in the correctness tests.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import torch
import transformers.models.llama.modeling_llama as llama
from transformers import AutoModelForCausalLM, AutoTokenizer


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x [..., head_dim] as an int8 cache holds it: round(x / s) * s with s = max|x| / 127 per head."""
    scale = x.abs().amax(-1, keepdim=True).clamp_min(1e-30) / 127
    return (x / scale).round().clamp(-127, 127) * scale


class CacheRounding:
    """Patches the model's rope so that keys come out as the cache would hold them, and its v projections."""

    def __init__(self, model: Any) -> None:
        self.layers = model.config.num_hidden_layers
        self.head_dim = model.config.hidden_size // model.config.num_attention_heads
        self.keys = self.values = False
        self.pair_scale: dict[int, torch.Tensor] | None = None  # per layer [KV, head_dim]: keys / scale rounded
        self.calibration: dict[int, torch.Tensor] | None = None  # per layer [KV, head_dim / 2]: max pair norm
        self._layer = 0
        original = llama.apply_rotary_pos_emb

        def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *args: Any,
                 **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
            q, k = original(q, k, cos, sin, *args, **kwargs)  # [B, heads, T, D]
            layer, self._layer = self._layer, (self._layer + 1) % self.layers
            half = k.shape[-1] // 2
            if self.calibration is not None:
                norm = (k[..., :half] ** 2 + k[..., half:] ** 2).sqrt().amax(2)[0]
                self.calibration[layer] = torch.maximum(self.calibration.get(layer, norm), norm)
            if self.keys:
                scale = self.pair_scale[layer][None, :, None, :] if self.pair_scale is not None else None
                k = int8_rounded(k / scale) * scale if scale is not None else int8_rounded(k)
            return q, k

        llama.apply_rotary_pos_emb = rope
        for block in model.model.layers:
            block.self_attn.v_proj.register_forward_hook(self._values)

    def _values(self, module: Any, inputs: Any, out: torch.Tensor) -> torch.Tensor | None:
        if not self.values:
            return None
        batch, tokens, width = out.shape
        return int8_rounded(out.view(batch, tokens, -1, self.head_dim)).view(batch, tokens, width)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="models/SmolLM2-135M-Instruct")
    parser.add_argument("--text", default="tests/data/perplexity.txt")
    args = parser.parse_args()
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval()
    rounding = CacheRounding(model)
    ids = torch.tensor([tok.encode(open(args.text).read())[:768]])
    chat = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                                 add_generation_prompt=True, tokenize=True, return_dict=False)])
    the, l_token = tok.encode("The")[0], tok.encode("L")[0]
    rounding.calibration = {}
    with torch.no_grad():
        model(ids[:, 256:512])  # calibration: the keys' largest norm per rotary pair
    calibration, rounding.calibration = rounding.calibration, None
    print("| setting | \"The\" - \"L\" | perplexity |\n|---|---|---|")
    settings: list[tuple[str, bool, bool, float | None]] = [
        ("float32 as is", False, False, None), ("keys int8", True, False, None), ("values int8", False, True, None),
        ("keys and values int8", True, True, None), ("the same, keys smoothed (max^0.5)", True, True, 0.5),
        ("the same, keys smoothed (max^1)", True, True, 1.0)]
    for name, keys, values, alpha in settings:
        rounding.keys, rounding.values = keys, values
        rounding.pair_scale = None if alpha is None else {
            layer: torch.cat([norm.clamp_min(1e-6) ** alpha] * 2, -1) for layer, norm in calibration.items()}
        with torch.no_grad():
            first = model(chat).logits[0, -1].log_softmax(-1)
            logprobs = model(ids).logits[0, :-1].log_softmax(-1)
        nll = -logprobs.gather(1, ids[0, 1:, None]).mean().item()
        print(f"| {name} | {first[the] - first[l_token]:+.3f} | {math.exp(nll):.3f} |")


if __name__ == "__main__":
    main()
