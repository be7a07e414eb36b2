"""An fp8 KV cache's scales: each attention layer stores k / k_scale and v / v_scale as e4m3
(`Attention.kv_scale`), one scale per layer for k and one for v.

Where they come from, in order:
    the checkpoint   a compressed-tensors `kv_cache_scheme` carries each layer's k_scale and v_scale
    measured         otherwise one prompt (CALIBRATION_TEXT) runs through the model at start-up and each
                     layer's scale is HEADROOM x its largest |k| (bounded over rope's angles) or |v|, over
                     e4m3's largest value 448: values up to twice the prompt's largest are held, larger
                     ones saturate
    1.0              where the measurement gives nothing usable (a layer whose k or v were all zero, or
                     not finite), with a warning
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch
from torch import nn

from ferrum.models.attention.layer import Attention
from ferrum.models.attention.layout import FP8_MAX

log = logging.getLogger(__name__)

HEADROOM = 2.0
CALIBRATION_TEXT = (
    "The history of the river town begins with a ferry crossing, a market and a mill. Over two centuries the "
    "town grew into a port: merchants traded grain, timber and wool, and in 1852 a railway bridge replaced the "
    "ferry. Question: what replaced the ferry, and when? Answer: a railway bridge, in 1852.\n\n"
    "def mean(values):\n    total = sum(values)\n    return total / len(values) if values else 0.0\n\n"
    "Ingredients: 2 cups of flour, 1 teaspoon of salt, 3 eggs, 250 ml of milk. Whisk the eggs and the milk, "
    "fold in the flour and the salt, rest the batter for 30 minutes, then cook thin pancakes in a hot pan. "
    "User: Translate 'good morning' into French and Spanish. Assistant: Bonjour; buenos dias. "
    "{\"name\": \"Ada\", \"age\": 36, \"languages\": [\"en\", \"fr\"], \"active\": true}"
)


def calibration_ids(encoded: list[int], vocab_size: int) -> list[int]:
    """The prompt's token ids the model has embeddings for (a tokenizer may know more than the model's
    vocabulary); too few left: ids spread over the vocabulary."""
    ids = [t for t in encoded if t < vocab_size]
    return ids if len(ids) >= 32 else [(i * 7919) % vocab_size for i in range(256)]


def attention_layers(model: nn.Module) -> list[Attention]:
    return [m for m in model.modules() if isinstance(m, Attention)]


def reset_scales(model: nn.Module) -> None:
    """Every layer's kv_scale as float32 ones (the model is built empty in the serving dtype: its buffers
    hold whatever the memory held)."""
    for layer in attention_layers(model):
        layer.kv_scale = torch.ones(2, dtype=torch.float32, device=layer.kv_scale.device)


def scales_from_checkpoint(model: nn.Module) -> bool:
    """Copies each layer's checkpoint k_scale and v_scale into its kv_scale; True when every layer had them."""
    layers = attention_layers(model)
    if not layers or any(layer.k_scale is None or layer.v_scale is None for layer in layers):
        return False
    for layer in layers:
        assert layer.k_scale is not None and layer.v_scale is not None
        pair = torch.stack([layer.k_scale.detach().float().reshape(-1)[0],
                            layer.v_scale.detach().float().reshape(-1)[0]])
        if not bool(torch.isfinite(pair).all()) or bool((pair <= 0).any()):
            raise ValueError(f"the checkpoint's fp8 KV-cache scales must be positive and finite; an attention layer "
                             f"has k_scale {float(pair[0])}, v_scale {float(pair[1])}")
        layer.kv_scale.copy_(pair)
    return True


def measure_scales(model: nn.Module, run: Callable[[list[int]], None], token_ids: list[int]) -> None:
    """Runs `token_ids` through the model (`run`) with every attention layer noting its largest k and v,
    then sets each layer's kv_scale from them (1.0 with a warning where there is nothing usable)."""
    layers = attention_layers(model)
    for layer in layers:
        layer.kv_amax = torch.zeros(2, device=layer.kv_scale.device)
    try:
        run(token_ids)
        amax = [layer.kv_amax.tolist() for layer in layers if layer.kv_amax is not None]
    finally:
        for layer in layers:
            layer.kv_amax = None
    unusable = []
    for i, (layer, (k_max, v_max)) in enumerate(zip(layers, amax, strict=True)):
        scales = []
        for which, value in (("k", k_max), ("v", v_max)):
            if math.isfinite(value) and value > 0:
                scales.append(value * HEADROOM / FP8_MAX)
            else:
                scales.append(1.0)
                unusable.append(f"layer {i} {which} (largest |{which}| {value})")
        layer.kv_scale.copy_(torch.tensor(scales))
    if unusable:
        log.warning("fp8 KV cache: no usable scale measured for %s: 1.0 used there", ", ".join(unusable))
    k_scales, v_scales = ([float(layer.kv_scale[i]) for layer in layers] for i in range(2))
    log.info("fp8 KV cache: scales measured on a %d-token prompt: k %.3g..%.3g, v %.3g..%.3g", len(token_ids),
             *_span(k_scales), *_span(v_scales))


def _span(values: list[float]) -> tuple[float, float]:
    return min(values, default=0.0), max(values, default=0.0)
