"""`quantization: auto` (the server's default): the fastest configuration for the device that stays
within the quantization bounds the tests hold (tests/models/test_quantized*.py, test_cpu_auto.py),
decided once the engine has its `Device`, before the model is built.

    CPU with its C++ kernels    linear layers int4 in groups of 32 (asymmetric), quantized on load,
                                and the LM head int8 in groups of 32; a checkpoint stored quantized
                                (GPTQ, AWQ, GGUF, ...) keeps its own format and gets the int8 LM head.
                                Decode on the CPU streams every weight once a token: int4 reads a
                                quarter of bf16's bytes, and the kernels' integer GEMV reads them at
                                the memory's speed (benchmarks/cpu-kernels.md)
    anything else               served as stored (bf16 GEMMs of GPUs are not bound the same way; the
                                GPU's quantized paths are opt-in: --quantization int4 / int8 / fp8)

`--quantization none` serves every layer in the serving dtype; a named method is used as given.
"""

from __future__ import annotations

from dataclasses import dataclass

from ferrum.backends.device import Device
from ferrum.models.config import ModelConfig
from ferrum.weights.quantization.scheme import QuantizationConfig, QuantScheme

CPU_GROUP = 32  # the CPU kernels' activation block: groups of 32 inputs cost no extra scale loads
CPU_LM_HEAD = QuantScheme("int8", group_size=CPU_GROUP, per_group=True)


@dataclass(frozen=True)
class QuantizationChoice:
    quantization: QuantizationConfig | None  # the linear layers' on-load quantization (None: as stored)
    lm_head: QuantScheme | None = None  # the LM head re-stored in this scheme after loading (a tied one too)
    reason: str = ""  # what auto picked and why (empty when the setting was not auto)


def resolve_quantization(config: QuantizationConfig | None, device: Device, model: ModelConfig,
                         cpu_kernels: bool) -> QuantizationChoice:
    if config is None or not config.auto:
        return QuantizationChoice(config)
    where = f"{device.name} ({device.description})"
    if device.kind != "cpu" or not cpu_kernels:
        why = "its C++ kernels are not built" if device.kind == "cpu" else "GPUs serve as stored unless asked"
        return QuantizationChoice(None, None, f"quantization auto on {where}: weights as stored ({why})")
    widths = {model.hidden_size, model.intermediate_size, model.num_heads * model.head_dim}
    if any(width % CPU_GROUP for width in widths):
        return QuantizationChoice(None, None, f"quantization auto on {where}: weights as stored (the layers' widths "
                                              f"{sorted(widths)} are not all multiples of {CPU_GROUP})")
    head = f"LM head int8 (groups of {CPU_GROUP}) through the CPU kernels' integer GEMV"
    if model.published is not None:
        return QuantizationChoice(None, CPU_LM_HEAD, f"quantization auto on {where}: the checkpoint's own "
                                                     f"{model.published.name} layers, {head}")
    on_load = QuantizationConfig("int4", group_size=CPU_GROUP)
    return QuantizationChoice(on_load, CPU_LM_HEAD,
                              f"quantization auto on {where}: linear layers int4 (groups of {CPU_GROUP}, "
                              f"asymmetric), {head}; --quantization none serves them unquantized")
