"""Which published format a checkpoint is in, from config.json's `quantization_config` (or an older
folder's quantize_config.json), and how that meets the served model's `--quantization`.

vLLM's --quantization names are accepted for the same meaning (scheme.PUBLISHED, and fp8): they say
what the checkpoint must be, and a checkpoint that is not that is a clear error (`check_requested`).
`fp8` on an unquantized checkpoint quantizes it on load, as in vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferrum.weights.quantization.published.awq import AwqFormat
from ferrum.weights.quantization.published.base import PublishedFormat
from ferrum.weights.quantization.published.compressed_tensors import CompressedTensorsFormat
from ferrum.weights.quantization.published.fp8 import Fp8Format
from ferrum.weights.quantization.published.gguf import GgufFormat
from ferrum.weights.quantization.published.gptq import GptqFormat
from ferrum.weights.quantization.scheme import PUBLISHED_ALIASES, QuantizationConfigError

__all__ = ["checkpoint_format"]

_ALIASES = {**PUBLISHED_ALIASES, "gptq_v2": "gptq"}
_SERVED = ("gptq", "awq", "fp8", "compressed-tensors")
# quant_method values Ferrum does not serve, and what would
_REFUSED = {
    "bitsandbytes": "bitsandbytes' int8/NF4 layouts are not served; vLLM serves them, or quantize the "
                    "full-precision model on load with --quantization int8|int4",
    "mxfp4": "MXFP4 is not served yet (vLLM serves it on Hopper and Blackwell)",
    "modelopt": "NVIDIA ModelOpt checkpoints (NVFP4, FP8) are not served; vLLM and TensorRT-LLM serve them",
    "modelopt_fp4": "NVFP4 is not served; vLLM and TensorRT-LLM serve it on Blackwell",
    "hqq": "HQQ checkpoints are not served; vLLM serves them",
    "eetq": "EETQ checkpoints are not served; TGI serves them",
    "exl2": "EXL2 checkpoints are not served; ExLlamaV2 / TabbyAPI serve them",
    "exl3": "EXL3 checkpoints are not served; ExLlamaV3 / TabbyAPI serve them",
    "aqlm": "AQLM checkpoints are not served; vLLM serves them",
    "quark": "AMD Quark checkpoints are not served; vLLM serves them",
    "torchao": "torchao-serialized checkpoints are not served; vLLM serves them",
    "fbgemm_fp8": "fbgemm FP8 checkpoints are not served yet",
    "higgs": "HIGGS checkpoints are not served",
    "vptq": "VPTQ checkpoints are not served",
    "spqr": "SpQR checkpoints are not served",
    "bitnet": "BitNet checkpoints are not served",
}


def checkpoint_format(quantization_config: Mapping[str, Any] | None, model_config: Mapping[str, Any],
                      where: str) -> PublishedFormat | None:
    """The published format of a checkpoint whose config.json (`model_config`) carries
    `quantization_config` (or whose folder had quantize_config.json, passed here); None when it is
    not quantized. QuantizationConfigError naming `where` and the format for one Ferrum does not run."""
    if not quantization_config:
        return None
    if not isinstance(quantization_config, Mapping):
        raise QuantizationConfigError(f"{where}: quantization_config must be an object, got {quantization_config!r}")
    method = str(quantization_config.get("quant_method", "gptq" if "bits" in quantization_config else "")).lower()
    method = _ALIASES.get(method, method)
    try:
        if method == "gptq":
            return GptqFormat(quantization_config)
        if method == "awq":
            return AwqFormat(quantization_config)
        if method == "compressed-tensors":
            return CompressedTensorsFormat(quantization_config, model_config)
        if method == "fp8":
            return Fp8Format(quantization_config)
        if method == "gguf":
            return GgufFormat(quantization_config, model_config)
    except QuantizationConfigError as exc:
        raise QuantizationConfigError(f"{where}: {exc}") from None
    if method in _REFUSED:
        raise QuantizationConfigError(f"{where}: quantization_config quant_method {method!r}: {_REFUSED[method]}")
    raise QuantizationConfigError(
        f"{where}: quantization_config quant_method {method!r} is not known; Ferrum serves "
        f"{', '.join(_SERVED)} checkpoints, and GGUF files")


def check_requested(requested: str | None, found: PublishedFormat | None, where: str) -> None:
    """QuantizationConfigError where --quantization `requested` (canonical: ferrum's scheme.parse_quantization)
    disagrees with the checkpoint's format `found` (None: unquantized)."""
    if requested is None or (found is None and requested in ("int8", "int4", "fp8")):
        return
    if found is None:
        raise QuantizationConfigError(
            f"{where}: --quantization {requested} expects a {requested} checkpoint, but config.json has no "
            "quantization_config (an unquantized checkpoint: quantize it on load with int8, int4 or fp8)")
    if requested != found.name:
        raise QuantizationConfigError(
            f"{where}: the checkpoint is already quantized ({found.describe()}); --quantization {requested} "
            f"{'would quantize it again' if requested in ('int8', 'int4') else 'names another format'}: "
            f"drop the flag or pass --quantization {found.name}")
