"""What a linear layer's weights are stored as: `QuantScheme`, and the served model's choice of it
for every layer: `QuantizationConfig` (YAML's `quantization:` section, `--quantization`).

    int8   symmetric, one scale per output channel: w = q * scale            (q int8)
    int4   groups of `group_size` inputs per output channel (the last one shorter where
           group_size does not divide K), asymmetric (zero fitted) unless `symmetric`:
           w = (q - 8) * scale + zero                                       (q 0..15, two per byte)
    fp8    float8 e4m3, one scale per output channel: w = q * scale         (compute capability 8.9+ on CUDA)

int8 and fp8 may instead keep a float32 scale per group of `group_size` inputs of a row (`per_group`:
published checkpoints' block scales, GGUF's Q8_0, 8-bit GPTQ with groups); on-load quantization keeps
one per row. int8 per group may also keep a float32 zero per group (`offsets`: w = q * scale + zero,
GGUF's Q5_1 and Q5_K, 5-bit codes with a minimum): the layer adds each group's zero times the sum of
its inputs to the symmetric product.

int4's scales and zeros are stored in the model's dtype unless the scheme names `params`: a published
checkpoint's values kept exactly (GPTQ's float16 scales, an integer zero point times its scale in float32).
int4 may instead keep llama.cpp's Q4_K factors as they ship (`sub_scales`, groups of 32): a 6-bit scale sc
and minimum m per group and d and dmin (float16 values, stored in float32) per super-block of 8 groups,
w = d * sc * q - dmin * m (the kernels compute scale = d * sc and zero = 8 * scale - dmin * m per group;
4.75 bits a weight, against 6 for the same values as float32 scales and zeros).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, TypeAlias, cast

import torch

QuantMethod: TypeAlias = Literal["int8", "int4", "fp8"]
METHODS: tuple[QuantMethod, ...] = ("int8", "int4", "fp8")
# names people pass that Ferrum does not run, and why (refused by name, never ignored)
REFUSED_METHODS: dict[str, str] = {
    "bitsandbytes": "bitsandbytes' formats are not supported; use int8, int4 or fp8 (quantized on load)",
    "bnb": "bitsandbytes' formats are not supported; use int8, int4 or fp8 (quantized on load)",
    "nf4": "NF4 (bitsandbytes) is not supported; use int4",
}
# published checkpoint formats (ferrum.weights.quantization.published): `--quantization gptq` says what the
# checkpoint must be (vLLM's meaning); fp8 is both (on load for an unquantized checkpoint)
PUBLISHED: tuple[str, ...] = ("gptq", "awq", "compressed-tensors", "gguf")
PUBLISHED_ALIASES: dict[str, str] = {
    "gptq_marlin": "gptq", "awq_marlin": "awq", "compressed_tensors": "compressed-tensors"}
AUTO = "auto"  # the engine picks for the device (ferrum.engine.auto_quantization)
DEFAULT_GROUP_SIZE = 128
_PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
DEFAULT_SKIP: tuple[str, ...] = ("lm_head",)
SUB_GROUP = 32  # sub_scales: inputs a group (Q4_K's sub-block)
SUPER_GROUPS = 8  # sub_scales: groups a super-block (Q4_K's 256 inputs; ferrum.kernels.planes says the same)


class QuantizationConfigError(ValueError):
    """A quantization setting Ferrum cannot run; names the setting and the accepted values."""


def parse_method(name: object) -> QuantMethod:
    """A method from a config value ("INT4", "int4"); QuantizationConfigError naming refused and
    unknown methods."""
    if not isinstance(name, str):
        raise QuantizationConfigError(f"quantization method must be a string, got {name!r}")
    key = name.strip().lower()
    if key in METHODS:
        return cast(QuantMethod, key)
    if key in REFUSED_METHODS:
        raise QuantizationConfigError(f"quantization method {name!r}: {REFUSED_METHODS[key]}")
    if PUBLISHED_ALIASES.get(key, key) in PUBLISHED:
        raise QuantizationConfigError(f"{name!r} is a checkpoint format, served as int4, int8 or fp8; name one of "
                                      f"{', '.join(METHODS)}")
    raise QuantizationConfigError(f"unknown quantization method {name!r}; valid methods: {', '.join(METHODS)}")


def parse_quantization(name: object) -> str:
    """The served model's --quantization: a method quantized on load, or a published format the
    checkpoint must be in (vLLM's names, canonical spelling); QuantizationConfigError as parse_method."""
    if isinstance(name, str):
        key = name.strip().lower()
        if PUBLISHED_ALIASES.get(key, key) in PUBLISHED:
            return PUBLISHED_ALIASES.get(key, key)
        if key == AUTO:
            return AUTO
    try:
        return parse_method(name)
    except QuantizationConfigError as exc:
        if "unknown" in str(exc):
            raise QuantizationConfigError(
                f"unknown quantization method {name!r}; valid: {', '.join(METHODS)} (quantized on load), "
                f"{', '.join(PUBLISHED)} (the checkpoint's own), {AUTO} (chosen for the device)") from None
        raise


@dataclass(frozen=True)
class QuantScheme:
    """One linear layer's stored format. `group_size`: inputs per scale (int4 only; int8 and fp8
    have one scale per output channel)."""

    method: QuantMethod
    group_size: int = DEFAULT_GROUP_SIZE
    symmetric: bool = False  # int4 only: zero fixed at 0 (int8 and fp8 are always symmetric)
    params: torch.dtype | None = None  # int4 only: the scales' and zeros' dtype; None: the model's
    per_group: bool = False  # int8 / fp8: a scale per group of group_size inputs (int4 always has groups)
    offsets: bool = False  # int8 per_group: a float32 zero per group too, w = q * scale + zero
    # fp8: the checkpoint's static activation scale (its input_scale), kept per output row; the GEMMs that
    # quantize activations (tensor cores, from 17 rows) scale them by it instead of per token
    static_input: bool = False
    # int4: Q4_K's 6-bit sub-scales and minimums per group of 32, d and dmin per super-block of 8 groups
    sub_scales: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", parse_method(self.method))
        if self.per_group and self.method == "int4":
            object.__setattr__(self, "per_group", False)
        if self.offsets and not (self.method == "int8" and self.per_group):
            raise QuantizationConfigError(f"{self.method}: zeros per group (offsets) are for int8 with a scale per "
                                          "group only")
        if self.static_input and self.method != "fp8":
            raise QuantizationConfigError(f"{self.method}: a static input scale is served for fp8 only")
        if self.sub_scales and (self.method != "int4" or self.group_size != SUB_GROUP or self.symmetric
                                or self.params is not None):
            raise QuantizationConfigError(f"{self.method}: sub-scales (Q4_K) are for asymmetric int4 with groups of "
                                          f"{SUB_GROUP} and no params dtype")
        if self.params is not None and (self.method != "int4" or self.params not in _PARAM_DTYPES):
            raise QuantizationConfigError(
                f"{self.method}: params dtype {self.params} is for int4's scales and zeros, one of "
                f"{', '.join(str(d) for d in _PARAM_DTYPES)}")
        if self.grouped:
            g = self.group_size
            if isinstance(g, bool) or not isinstance(g, int) or g < 16 or g & (g - 1):
                raise QuantizationConfigError(f"{self.method} group_size must be a power of two >= 16, got {g!r}")

    @property
    def grouped(self) -> bool:
        """Scales per group of group_size inputs (int4; int8 / fp8 per_group), not per output row."""
        return self.method == "int4" or self.per_group

    def groups(self, in_features: int) -> int:
        """int4's groups a row of `in_features` inputs: ceil(K / group_size), the last one ragged
        (K - (groups - 1) * group_size inputs) where group_size does not divide K."""
        return -(-in_features // self.group_size)

    def check_in_features(self, in_features: int, what: str) -> None:
        """QuantizationConfigError unless layer `what` with `in_features` inputs can be stored in
        this scheme (int4: two inputs a byte, so an even number; any number of groups, the last
        one possibly shorter)."""
        if self.method == "int4" and (in_features < 2 or in_features % 2):
            raise QuantizationConfigError(
                f"{what}: int4 packs two inputs per byte; {in_features} input features is not a positive even number"
            )

    def check_shard(self, in_features: int, what: str) -> None:
        """check_in_features, and for a tensor-parallel shard of the input features: its int4
        groups must be whole (a group never straddles two ranks)."""
        self.check_in_features(in_features, what)
        if self.sub_scales and in_features % (SUB_GROUP * SUPER_GROUPS):
            raise QuantizationConfigError(
                f"{what}: {in_features} input features do not split into Q4_K super-blocks of "
                f"{SUB_GROUP * SUPER_GROUPS} (a super-block would straddle two ranks)"
            )
        if self.grouped and in_features % self.group_size:
            raise QuantizationConfigError(
                f"{what}: {in_features} input features do not split into {self.method} groups of {self.group_size} "
                "(a group would straddle two ranks)"
            )

    def expanded(self) -> QuantScheme:
        """sub_scales: the same weight with each group's scale and zero stored in float32 (exact: d * sc
        takes 17 bits; the zero as the kernels round it), for a tensor-parallel rank whose share of the
        inputs splits a super-block."""
        return QuantScheme("int4", self.group_size, params=torch.float32)

    def supers(self, in_features: int) -> int:
        """sub_scales: the super-blocks of 8 groups a row of `in_features` inputs (the last one possibly short)."""
        return -(-self.groups(in_features) // SUPER_GROUPS)

    def describe(self) -> str:
        if self.sub_scales:
            return f"int4 (group {self.group_size}, Q4_K sub-scales)"
        if self.method == "int4":
            params = f", {str(self.params).removeprefix('torch.')} scales" if self.params is not None else ""
            return f"int4 (group {self.group_size}, {'symmetric' if self.symmetric else 'asymmetric'}{params})"
        if self.offsets:
            return f"{self.method} (group {self.group_size}, with zeros)"
        static = ", static input scale" if self.static_input else ""
        if self.per_group:
            return f"{self.method} (group {self.group_size}{static})"
        return f"{self.method} (static input scale)" if self.static_input else self.method


@dataclass(frozen=True)
class QuantizationConfig:
    """The served model's quantization: `method` for every linear layer except those named in
    `skip` (a layer matches when its name, e.g. "lm_head" or "layers.0.mlp.down_proj", equals an
    entry or ends with "." + entry). Embeddings are never quantized. A published format's name
    (`published`) instead says which format the checkpoint must already be in; fp8 is quantized on
    load, or read as published where the checkpoint is FP8."""

    method: str  # a QuantMethod, or one of PUBLISHED
    group_size: int = DEFAULT_GROUP_SIZE
    symmetric: bool | None = None  # None: the method's default (int8/fp8 symmetric, int4 asymmetric)
    skip: tuple[str, ...] = DEFAULT_SKIP
    params: torch.dtype | None = None  # int4: the scales' and zeros' dtype (None: the model's); not a YAML key

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", parse_quantization(self.method))
        if isinstance(self.skip, str) or not isinstance(self.skip, Iterable):
            raise QuantizationConfigError(f"quantization skip must be a list of layer names, got {self.skip!r}")
        skip = tuple(self.skip)
        if not all(isinstance(s, str) and s for s in skip):
            raise QuantizationConfigError(f"quantization skip must hold non-empty layer names, got {list(skip)!r}")
        object.__setattr__(self, "skip", skip)
        if self.symmetric is False and self.method in ("int8", "fp8"):
            raise QuantizationConfigError(
                f"{self.method} is stored symmetric (one scale per output channel); symmetric: false is for int4"
            )
        if not self.published and not self.auto:
            self.scheme  # noqa: B018 - validates group_size

    @property
    def published(self) -> bool:
        """The method names a published checkpoint format, not a quantization on load."""
        return self.method in PUBLISHED

    @property
    def auto(self) -> bool:
        """The engine chooses for its device once it has it (resolved before the model is built)."""
        return self.method == AUTO

    @property
    def scheme(self) -> QuantScheme:
        if self.published:
            raise QuantizationConfigError(f"{self.method} names a checkpoint format, not a scheme")
        if self.auto:
            raise QuantizationConfigError("quantization auto is resolved for the device before a scheme is asked for")
        return QuantScheme(cast(QuantMethod, self.method), self.group_size, bool(self.symmetric), self.params)

    def scheme_for(self, layer: str) -> QuantScheme | None:
        """The scheme of linear layer `layer` (its module path, e.g. "layers.3.self_attn.qkv_proj"),
        None where it is skipped."""
        for entry in self.skip:
            if layer == entry or layer.endswith("." + entry):
                return None
        return self.scheme

    def describe(self) -> str:
        if self.published or self.auto:
            return self.method
        skipped = f", {', '.join(self.skip)} unquantized" if self.skip else ""
        return self.scheme.describe() + skipped
