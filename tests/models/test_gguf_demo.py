"""The demo model served from its own Q4_1 GGUF (`ferrum serve --model SmolLM2-135M-Instruct.Q4_1.gguf`)
against folders converted from the same file, all through the API in float32: 32 fixed prompts' greedy
continuations (64 tokens, EOS ignored) and the perplexity of a fixed text from the prompt logprobs
(scripts/perplexity.py).

The GGUF path serves the file's own values (its int4 groups of 32 repacked exactly, float32 scales
and zeros). A folder converted to float32 (`scripts/prepare_demo_model.py --dtype float32`) holds the
same values, so the two differ only in the order of roundings: measured on an AMD EPYC, 2026-11-25,
identical outputs on 32 of 32 prompts (the issue asks 90%). The bf16 folder `make` writes holds the
values rounded to bf16, so that model differs by that rounding as a bf16 and a float32 run of one model
do: 23 of 32 (72%; the bound below is what this model's rounding allows), perplexity 13.909 against
13.897 (1.0009x), within the issue's 1.01x; against the float32 folder 13.909 both.

And the served model's logits against HF transformers loading the same GGUF (its own dequantization,
float32): equal to float32 rounding, since the repack is exact.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from tests.live_server import MODEL_DIR, ROOT, live_server
from tests.models.test_quantized_demo import PROMPTS, TEXT

GGUF = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not GGUF.is_file() or not (MODEL_DIR / "model.safetensors").is_file(),
                       reason="demo model files not present (make model)"),
]
BOUND_IDENTICAL = 0.9  # against the same values (the float32 folder): measured 32 of 32
BOUND_IDENTICAL_BF16 = 0.6  # against the bf16 folder: measured 0.72
BOUND_PERPLEXITY = 1.01


def served(model: Path, *flags: str) -> tuple[list[str], float]:
    """The greedy continuations of PROMPTS and the perplexity of TEXT, from `ferrum serve --model model`, with
    a float32 KV cache: what is compared is the weights each file gives, and an int8 cache (quantization auto's
    on AVX2 in float32) turns a last-bit difference of a key into a step of its rounding, which parted 18 of
    32 continuations of the GGUF and its float32 folder on an AVX2 EPYC."""
    with live_server("--model", str(model), "--backend", "cpu", "--kv-cache-dtype", "float32", *flags) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        name = client.models.list().data[0].id
        out = client.completions.create(model=name, prompt=PROMPTS, max_tokens=64, temperature=0,
                                        extra_body={"ignore_eos": True})
        texts = [c.text for c in sorted(out.choices, key=lambda c: c.index)]
        done = subprocess.run([sys.executable, str(ROOT / "scripts" / "perplexity.py"), "--url", url, "--file",
                               str(TEXT), "--json"], capture_output=True, text=True, timeout=300, check=True)
        return texts, float(json.loads(done.stdout)["perplexity"])


def test_demo_gguf_serves_as_its_converted_folders(tmp_path: Path) -> None:
    exact = tmp_path / "SmolLM2-135M-Instruct"
    subprocess.run([sys.executable, str(ROOT / "scripts" / "prepare_demo_model.py"), "--out", str(exact), "--gguf",
                    str(GGUF), "--dtype", "float32"], check=True, timeout=600, capture_output=True)
    gguf_texts, gguf_ppl = served(GGUF, "--dtype", "float32")
    for folder, bound in ((exact, BOUND_IDENTICAL), (MODEL_DIR, BOUND_IDENTICAL_BF16)):
        folder_texts, folder_ppl = served(folder, "--dtype", "float32")
        same = sum(a == b for a, b in zip(folder_texts, gguf_texts, strict=True)) / len(PROMPTS)
        ratio = gguf_ppl / folder_ppl
        print(f"gguf vs {folder}: identical outputs {same:.0%} of {len(PROMPTS)}; perplexity {gguf_ppl:.4f} vs "
              f"{folder_ppl:.4f} ({ratio:.4f}x)")
        assert same >= bound, f"{folder}: identical outputs on {same:.0%} of prompts"
        assert abs(ratio - 1.0) <= BOUND_PERPLEXITY - 1.0, f"{folder}: perplexity {gguf_ppl:.4f} vs {folder_ppl:.4f}"


def test_demo_gguf_logits_equal_transformers_on_the_same_file() -> None:
    transformers = pytest.importorskip("transformers")
    import torch

    from ferrum.engine.builder import create_engine
    from ferrum.engine.sampling_params import SamplingParams

    hf = transformers.AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name,
                                                           dtype=torch.float32).eval()
    ids = [1, 504, 3458, 282, 4649, 314, 216, 33, 32, 32, 21, 8714, 284]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    engine = create_engine(str(GGUF), backend="cpu", dtype="float32", max_model_len=256, kv_cache_memory_gb=0.1)
    engine.add_request("gguf", ids, SamplingParams(max_tokens=1, temperature=0, logprobs=20))
    logprobs = []
    while engine.has_work:
        logprobs += [lp for out in engine.step() for lp in out.new_logprobs or ()]
    ref_logprobs = torch.log_softmax(ref, dim=-1)
    assert logprobs[0].token_id == int(ref.argmax())
    for top in logprobs[0].top:  # observed differences ~1e-5
        assert abs(top.logprob - float(ref_logprobs[top.token_id])) < 1e-3, (top, float(ref_logprobs[top.token_id]))
