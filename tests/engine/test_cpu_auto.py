"""`quantization: auto` on the CPU (int4 groups of 32 through the C++ kernels' integer GEMV, the int8
LM head for decode steps), with the KV cache in int8 (what auto picks on AVX512-VNNI; set here on any CPU),
against the same demo model served as stored, in process: the perplexity of
the fixed text (tests/data/perplexity.txt, from prompt logprobs) and the top-1 agreement of the auto
model's next-token predictions with the unquantized model's along the text. Twice: the text prefilled
in one step (products of many rows dequantize the weight: the int4 fit alone), and four tokens a step,
which takes the decode kernels (the decode chain's integer GEMV with its activations rounded to int8
per 32 inputs, and the int8 head).

Bounds, with what was measured on 2026-11-25 (bf16, AMD EPYC Zen 4, 768 tokens of the text): perplexity
ratio <= 1.02 (13.856 -> 13.936 prefilled, 1.006x; 13.877 four tokens a step, 1.0015x: the activations
in two int8 parts; one int8 part gave 14.158, 1.022x), top-1 agreement >= 93% (97.2% and 96.4%). The same
text from the demo GGUF (Q4_1 stored as it ships): 13.793. The int8 KV cache, alone on the bf16 model
(AMD EPYC Zen 5, 2026-11-25): 13.848 prefilled and 13.864 four tokens a step (0.9994x, 1.0014x), top-1
97%; with the rest of auto: 13.905 and 13.936, and with the cache in tiles 13.911 and 13.888
(1.0039x, 1.0022x), top-1 97%.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from ferrum.engine.auto_quantization import resolve_quantization
from ferrum.engine.builder import create_engine
from ferrum.engine.sampling_params import SamplingParams
from ferrum.kernels.cpu.build import compiler
from ferrum.models.config import load_model_config
from ferrum.weights.quantization.scheme import QuantizationConfig
from tests.engines import host_device
from tests.live_server import MODEL_DIR, ROOT

TEXT = ROOT / "tests" / "data" / "perplexity.txt"
pytestmark = [
    pytest.mark.skipif(not (MODEL_DIR / "model.safetensors").is_file(), reason="demo model not present"),
    pytest.mark.skipif(compiler() is None, reason="no C++ compiler to build the CPU kernels with"),
]


def scored(quantization: str | None, step_tokens: int = 1024, kv_cache_dtype: str = "auto"
           ) -> tuple[float, list[int], str, str]:
    engine = create_engine(MODEL_DIR, backend="cpu", dtype="bfloat16", max_model_len=1024, kv_cache_memory_gb=0.1,
                           quantization={"method": quantization} if quantization else None,
                           max_num_batched_tokens=step_tokens, kv_cache_dtype=kv_cache_dtype)
    try:
        ids = engine.tokenizer.encode(TEXT.read_text())[:768]
        engine.add_request("text", ids, SamplingParams(max_tokens=1, prompt_logprobs=1))
        outs = []
        while engine.has_work:
            outs.extend(engine.step())
        logprobs = next(out.prompt_logprobs for out in outs if out.prompt_logprobs is not None)
        picks = [lp.top[0].token_id for lp in logprobs[1:] if lp is not None]
        nll = -sum(lp.logprob for lp in logprobs[1:] if lp is not None) / (len(ids) - 1)
        chosen = engine.weight_load.chosen if engine.weight_load is not None else None
        return math.exp(nll), picks, chosen or "", engine.stats().kv_cache_dtype
    finally:
        engine.release()


@pytest.mark.parametrize("step_tokens", [1024, 4])
def test_auto_on_the_cpu_keeps_the_demo_models_quality(step_tokens: int) -> None:
    plain_ppl, plain_picks, plain_chosen, plain_kv = scored(None)
    auto_ppl, auto_picks, chosen, kv = scored("auto", step_tokens, kv_cache_dtype="int8")
    assert plain_chosen == "" and "int4 (groups of 32" in chosen and "LM head int8" in chosen
    assert (plain_kv, kv) == ("bfloat16", "int8")
    agreement = sum(a == b for a, b in zip(auto_picks, plain_picks, strict=True)) / len(plain_picks)
    print(f"perplexity {plain_ppl:.4f} -> {auto_ppl:.4f} ({auto_ppl / plain_ppl:.4f}x), top-1 {agreement:.3f}")
    assert auto_ppl / plain_ppl <= 1.02
    assert agreement >= 0.93


@pytest.mark.parametrize(("dtype", "params"), [(torch.bfloat16, torch.float16), (torch.float32, None)])
def test_what_auto_picks_for_the_demo_model_by_dtype_and_cache(dtype: torch.dtype, params: torch.dtype | None) -> None:
    """int4 with float16 scales served in 16 bits (float32 ones in float32), where the weights outgrow the
    cache the cores can count on; the KV cache int8 served in 16 bits with AVX512-VNNI, or in float32 with AVX2
    and no VNNI; else bfloat16 served in float32, the serving dtype in 16 bits; as stored where they fit it."""
    device = replace(host_device(), cache_bytes=24 * 2**20, cpu_flags=("avx2", "avx512f", "avx512_vnni"))
    choice = resolve_quantization(QuantizationConfig("auto"), device, load_model_config(MODEL_DIR), True, dtype)
    assert choice.quantization is not None and choice.quantization.scheme.params == params and choice.int8_head
    assert ("float16 scales" in choice.reason) == (params is not None)
    kv = torch.int8 if params is not None else torch.bfloat16
    assert choice.kv_dtype == kv and f"KV cache {str(kv).removeprefix('torch.')}" in choice.reason
    no_vnni = resolve_quantization(QuantizationConfig("auto"), replace(device, cpu_flags=("avx2", "avx512f")),
                                   load_model_config(MODEL_DIR), True, dtype)
    assert no_vnni.kv_dtype == (None if params is not None else torch.int8)
    assert ("AVX2 scores its tiles in 16-bit integers" in no_vnni.reason) == (params is None)
    no_avx2 = resolve_quantization(QuantizationConfig("auto"), replace(device, cpu_flags=("sse4_2",)),
                                   load_model_config(MODEL_DIR), True, dtype)
    assert no_avx2.kv_dtype == (None if params is not None else torch.bfloat16)
    assert resolve_quantization(QuantizationConfig("auto"), replace(device, triton=True),  # Triton reads its cache
                                load_model_config(MODEL_DIR), True, dtype).kv_dtype is None
    fits = replace(device, cache_bytes=600 * 2**20)
    assert resolve_quantization(QuantizationConfig("auto"), fits, load_model_config(MODEL_DIR), True,
                                dtype).quantization is None
