"""The served model's quantization setting (the YAML `quantization:` section, `FERRUM_QUANTIZATION`,
`--quantization`) as a QuantizationConfig, or None when the weights are served unquantized:

    quantization: int4               # a method alone, with its defaults
    quantization:
      method: int4                   # int8 | int4 | fp8 (on load) | gptq | awq | compressed-tensors | gguf
                                     # | auto | none
      group_size: 128                # int4: inputs per scale (a power of two >= 16)
      symmetric: false               # int4: zero fixed at 0 when true (int8 and fp8 are always symmetric)
      skip: [lm_head]                # linear layers kept in the serving dtype (embeddings never quantized)

A published format's name (vLLM's --quantization names) says what the checkpoint must already be; a
checkpoint stored quantized is served in its own format without the setting. `auto`, the server's
default (ferrum.config.loader), lets the engine choose for its device (ferrum.engine.auto_quantization).
`method: none` turns quantization off whatever the other keys say (`--quantization none` over a file
that quantizes). Refused and unknown methods are named (ferrum.weights.quantization.scheme).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from ferrum.weights.quantization.scheme import AUTO, METHODS, PUBLISHED, QuantizationConfig, QuantizationConfigError

QUANTIZATION_KEYS: frozenset[str] = frozenset(f.name for f in fields(QuantizationConfig))
OFF = "none"
VALID_METHODS = ", ".join((*METHODS, *PUBLISHED, AUTO, OFF))


def is_off(method: object) -> bool:
    """Whether `method` turns quantization off: none (any case), false, or null."""
    return method is None or method is False or (isinstance(method, str) and method.strip().lower() == OFF)


def quantization_config(raw: Mapping[str, Any]) -> QuantizationConfig | None:
    """The `quantization:` section's keys as a QuantizationConfig, None for `method: none` (or no
    section); QuantizationConfigError naming the key or value otherwise."""
    unknown = sorted(str(key) for key in raw if key not in QUANTIZATION_KEYS)
    if unknown:
        raise QuantizationConfigError(
            f"unknown quantization key(s): {', '.join(unknown)}; valid keys: {', '.join(sorted(QUANTIZATION_KEYS))}"
        )
    if "method" not in raw:
        if raw:
            raise QuantizationConfigError(
                f"quantization: {', '.join(sorted(map(str, raw)))} given without a method; "
                f"set quantization.method ({VALID_METHODS})"
            )
        return None
    if is_off(raw["method"]):
        return None
    symmetric = raw.get("symmetric")
    if symmetric is not None and not isinstance(symmetric, bool):
        raise QuantizationConfigError(f"quantization.symmetric must be true or false, got {symmetric!r}")
    try:
        return QuantizationConfig(**raw)
    except TypeError as exc:
        raise QuantizationConfigError(f"quantization: {exc}") from None
