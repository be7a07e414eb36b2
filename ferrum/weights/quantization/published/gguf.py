"""GGUF files' quantized tensors (llama.cpp's block formats) through the seam.

A GGUF model is served from the file itself (ferrum.weights.formats.gguf reads it; the model folder's
config.json is derived from its metadata, with `quantization_config` {"quant_method": "gguf",
"architecture", "tensor_types": {HF tensor name: ggml type}}). Each tensor is stored as raw blocks,
uint8 [rows, bytes per row]:

    Q4_0   blocks of 32: d float16, 16 bytes of codes (byte j: input j low nibble, input j + 16 high);
           w = d * (q - 8)
    Q4_1   blocks of 32: d, m float16, 16 bytes as Q4_0;  w = d * q + m
    Q4_K   super-blocks of 256: d, dmin float16, 12 bytes of eight 6-bit scales sc and mins m, 128 bytes of
           codes (each 32 bytes: one sub-block of 32 in the low nibbles, the next in the high);
           w = d * sc * q - dmin * m
    Q8_0   blocks of 32: d float16, 32 int8;  w = d * q
    Q5_0   blocks of 32: d float16, the 32 fifth bits, 16 bytes of low nibbles as Q4_0;  w = d * (q - 16)
    Q6_K   super-blocks of 256: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales sc, d;
           w = d * sc * (q - 32) in sub-blocks of 16
    Q5_1   blocks of 32: d, m float16, the 32 fifth bits, 16 bytes of low nibbles as Q4_0;  w = d * q + m
    Q5_K   super-blocks of 256: d, dmin, 12 bytes of scales and mins as Q4_K, 32 bytes of fifth bits
           (bit s of byte l: sub-block s's input l), 128 bytes of low nibbles as Q4_K;
           w = d * sc * q - dmin * m

are repacked at load into the seam's int4 with groups of 32: Q4_0 symmetric with float16 scales (exact),
Q4_1 with float32 scales and zero = offset + 8 * scale (the scales exact; the zero exact unless the
offset and 8 * scale lie more than 2^13 apart in magnitude, then rounded to float32: the log counts
such groups), Q4_K with its own factors (`QuantScheme.sub_scales`: the 6-bit sc and m a group of 32,
d and dmin a super-block, in float32; the kernels form the same float32 scale and zero, 4.75 bits a
weight against 6 as float32 scales and zeros); Q8_0, Q5_0 and Q6_K into int8 with a float32 scale per group of 32 (Q6_K:
16) (exact; Q6_K's 6.56 bits a weight become 10); Q5_1 and Q5_K into int8 with a float32 scale and
zero per group of 32 (`offsets`: codes q - 16, zero = offset + 16 * scale, rounded to float32 where
float32 does not hold the sum, counted in the log; 5.5-6 bits a weight become 10). A fused projection
whose parts are in different types (Q4_K_M: attn_v in Q6_K, attn_q / attn_k in Q4_K) takes int8 with a
float32 scale per group of the smallest group and a zero where a part has one (`common_scheme`; each
part widened exactly, ferrum.weights.quantization.published.base.widen). The embeddings are
dequantized at load to the model's dtype (`dense`). A file with tensors of other types (Q2_K, Q3_K,
the IQ types...) is refused at start-up, naming a tensor, the types and what would run it: their
block formats have no kernels here, and serving them dequantized would take 4-8x the memory they
were chosen to save. llama.cpp stored the rows of attn_q / attn_k of llama files in another order;
they are put back (`hf_row_order`).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from ferrum.weights.gguf_names import gguf_tensor_name, hf_row_order, hf_tensor_name
from ferrum.weights.quantization.published.base import (
    DenseTensor,
    PublishedFormat,
    Repacked,
    TensorInfo,
    expect,
    pack_int4_rows,
)
from ferrum.weights.quantization.scheme import QuantizationConfigError, QuantScheme
from ferrum.weights.quantization.tensor import QuantizedTensor

__all__ = ["GgufFormat", "decode_int4_blocks"]

log = logging.getLogger(__name__)

# type -> (inputs per block, bytes per block)
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q4_K": (256, 144), "Q8_0": (32, 34), "Q5_0": (32, 22),
          "Q6_K": (256, 210), "Q5_1": (32, 24), "Q5_K": (256, 176)}
REPACKED = tuple(BLOCKS)
RUN_TYPES = ("F32", "F16", "BF16", *REPACKED)  # a tensor of another type is refused by name (GgufFormat)
INT8_GROUPS = {"Q8_0": 32, "Q5_0": 32, "Q6_K": 16}  # types served as int8 with a scale per group of this many
OFFSET_GROUPS = {"Q5_1": 32, "Q5_K": 32}  # types served as int8 with a scale and a zero per group of this many


def _f16(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The float16 at byte `start` of each block [B, bytes], as float32 [B]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16)[:, 0].float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Code bytes [B, S, 16 or 32] (a run of one sub-block's low nibbles, then its high ones) -> [B, S, 2 * len]."""
    return torch.cat((qs & 0xF, qs >> 4), dim=-1)


def decode_int8_blocks(type_name: str, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Raw blocks [B, bytes] of a symmetric type -> (codes int8 [B, inputs per block] in input order,
    scale float32 [B, groups]) with w = q * scale (exact: float16 d times an int8 sub-scale)."""
    b = blocks.shape[0]
    if type_name == "Q8_0":  # d, then 32 int8
        return blocks[:, 2:].contiguous().view(torch.int8), _f16(blocks, 0)[:, None]
    if type_name == "Q5_0":  # d, 32 high bits (uint32), 16 bytes of low nibbles; q - 16
        high = blocks[:, 2:6].contiguous().view(torch.int32)  # bit i: input i's fifth bit
        bits = (high >> torch.arange(32, device=blocks.device, dtype=torch.int32)) & 1
        low = _nibbles(blocks[:, None, 6:22]).reshape(b, 32).to(torch.int32)
        return (low | (bits << 4)).sub_(16).to(torch.int8), _f16(blocks, 0)[:, None]
    # Q6_K: 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d; q - 32 in sub-blocks of 16
    ql = blocks[:, :128].reshape(b, 2, 1, 64) >> torch.tensor([0, 4], device=blocks.device).reshape(1, 1, 2, 1)
    qh = blocks[:, 128:192].reshape(b, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], device=blocks.device).reshape(
        1, 1, 4, 1)
    q = ((ql & 0xF).reshape(b, 8, 32).to(torch.int32) | ((qh & 3).reshape(b, 8, 32).to(torch.int32) << 4)) - 32
    scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
    return q.reshape(b, 256).to(torch.int8), _f16(blocks, 208)[:, None] * scales


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: the eight 6-bit scales and mins of each super-block (bytes 4-15), int32 [B, 8] each."""
    b = blocks.shape[0]
    sm = blocks[:, 4:16].to(torch.int32).reshape(b, 3, 4)
    low, high, mixed = sm[:, 0], sm[:, 1], sm[:, 2]
    sc = torch.cat((low & 0x3F, (mixed & 0x0F) | ((low >> 2) & 0x30)), dim=1)
    mn = torch.cat((high & 0x3F, (mixed >> 4) | ((high >> 2) & 0x30)), dim=1)
    return sc, mn


def decode_offset_blocks(type_name: str, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw blocks [B, bytes] of a 5-bit type with a minimum (Q5_1, Q5_K) -> (codes 0..31 int32 [B, inputs
    per block] in input order, scale and offset float64 [B, groups of 32]) with w = q * scale + offset."""
    b = blocks.shape[0]
    if type_name == "Q5_1":  # d, m, 32 high bits (uint32), 16 bytes of low nibbles
        high = blocks[:, 4:8].contiguous().view(torch.int32)  # bit i: input i's fifth bit
        bits = (high >> torch.arange(32, device=blocks.device, dtype=torch.int32)) & 1
        low = _nibbles(blocks[:, None, 8:24]).reshape(b, 32).to(torch.int32)
        return low | (bits << 4), _f16(blocks, 0).double()[:, None], _f16(blocks, 2).double()[:, None]
    # Q5_K: d, dmin, scales and mins, 32 bytes of fifth bits, 128 bytes of low nibbles
    d, dmin = _f16(blocks, 0).double(), _f16(blocks, 2).double()
    sc, mn = _k_scales(blocks)
    low = _nibbles(blocks[:, 48:176].reshape(b, 4, 32)).reshape(b, 8, 32).to(torch.int32)  # sub-block s = 2c + h
    qh = blocks[:, 16:48].to(torch.int32)
    bits = (qh[:, None, :] >> torch.arange(8, device=blocks.device, dtype=torch.int32)[None, :, None]) & 1
    q = (low | (bits << 4)).reshape(b, 256)
    return q, d[:, None] * sc.double(), -(dmin[:, None] * mn.double())


def decode_int4_blocks(type_name: str, blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Raw blocks [B, bytes] of a 4-bit type -> (codes uint8 [B, inputs per block] in input order,
    scale and offset float64 [B, groups of 32]) with w = q * scale + offset."""
    b = blocks.shape[0]
    if type_name in ("Q4_0", "Q4_1"):
        start = 2 if type_name == "Q4_0" else 4
        d = _f16(blocks, 0).double()
        offset = -8.0 * d if type_name == "Q4_0" else _f16(blocks, 2).double()
        q = _nibbles(blocks[:, None, start:start + 16]).reshape(b, 32)
        return q, d[:, None], offset[:, None]
    d, dmin = _f16(blocks, 0).double(), _f16(blocks, 2).double()
    sc, mn = _k_scales(blocks)
    q = _nibbles(blocks[:, 16:].reshape(b, 4, 32)).reshape(b, 256)
    return q, d[:, None] * sc.double(), -(dmin[:, None] * mn.double())


class GgufFormat(PublishedFormat):
    name = "gguf"
    dense_fallback = True  # llama.cpp's mixes (Q4_K_M: attn_v in Q6_K beside Q4_K q/k) fuse into a dense qkv

    def __init__(self, config: Mapping[str, Any], model_config: Mapping[str, Any]) -> None:
        types = config.get("tensor_types")
        if not isinstance(types, Mapping):
            raise QuantizationConfigError("gguf quantization_config has no tensor_types (derived from the file)")
        self.types: dict[str, str] = {str(k): str(v) for k, v in types.items()}
        self.architecture = str(config.get("architecture", ""))
        self.heads = int(model_config.get("num_attention_heads", 0))
        self.kv_heads = int(model_config.get("num_key_value_heads") or self.heads)
        refused = {name: kind for name, kind in self.types.items() if kind not in RUN_TYPES}
        if refused:
            first = min(refused)
            more = len(refused) - 1
            raise QuantizationConfigError(
                f"GGUF tensor {gguf_tensor_name(first) or first!r} ({first}) is {refused[first]}"
                + (f", and {more} more tensor{'s' if more > 1 else ''} of {', '.join(sorted(set(refused.values())))}"
                   if more else "")
                + f": Ferrum runs GGUF tensors of {', '.join(RUN_TYPES)}. Requantize the model to one of them "
                "(llama.cpp's llama-quantize, e.g. Q4_K_M, best from the original weights), serve its "
                "safetensors folder (with --quantization int4 or int8 for the memory), or run this file with "
                "llama.cpp")

    def describe(self) -> str:
        kinds = sorted(set(self.types.values()))
        return f"gguf ({', '.join(kinds)})"

    def common_scheme(self, schemes: list[QuantScheme | None]) -> QuantScheme | None:
        """Parts repacked into int4 and int8 (llama.cpp's mixes: Q4_K_M's attn_v in Q6_K beside Q4_K q and k)
        share int8 with a float32 scale per group of the smallest group (16 or 32), and a zero where a part
        has one: exact, 12 or 10 bits a weight against the model dtype's 16. A part stored as a float
        tensor has none (the layer is then dequantized)."""
        if any(s is None for s in schemes):
            return None
        known = [s for s in schemes if s is not None]
        group = min(s.group_size for s in known)
        if any(s.group_size % group for s in known):
            return None
        offsets = any(s.offsets or (s.method == "int4" and not s.symmetric) for s in known)
        return QuantScheme("int8", group, per_group=True, offsets=offsets)

    def type_of(self, name: str) -> str | None:
        """The ggml type of HF tensor `name` in the file (None: the file has no such tensor)."""
        return self.types.get(name)

    def scheme(self, module: str, k: int) -> QuantScheme | None:
        kind = self.types.get(f"{module}.weight")
        if kind not in REPACKED or module.split(".")[-1] == "embed_tokens":
            return None
        if kind in INT8_GROUPS:
            return QuantScheme("int8", INT8_GROUPS[kind], per_group=True)
        if kind in OFFSET_GROUPS:
            return QuantScheme("int8", OFFSET_GROUPS[kind], per_group=True, offsets=True)
        if kind == "Q4_K":
            return QuantScheme("int4", 32, sub_scales=True)
        return QuantScheme("int4", 32, kind == "Q4_0", torch.float16 if kind == "Q4_0" else torch.float32)

    def stored_name(self, name: str) -> str:
        return gguf_tensor_name(name) or name

    def checkpoint_name(self, stored: str) -> str | None:
        return hf_tensor_name(stored)

    def unused(self, name: str) -> bool:
        return name == "rope_freqs.weight"  # llama 3's rope scaling, read into config.json's

    def dense(self, name: str, stored: TensorInfo) -> DenseTensor:
        kind = self.types.get(name, "F32")
        shape = tuple(stored[0])
        if kind not in ("F32", "F16", "BF16"):
            size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
            shape = (*shape[:-1], shape[-1] // size[1] * size[0])
        leaf = name.split(".")[-2] if "." in name else name
        permuted = self.architecture == "llama" and leaf in ("q_proj", "k_proj")
        heads = (self.heads if leaf == "q_proj" else self.kv_heads) if permuted else None
        return DenseTensor(shape, None if kind in ("F32", "F16", "BF16") else kind, heads)

    def tensors(self, module: str) -> dict[str, str]:
        return {"blocks": self.stored_name(f"{module}.weight")}

    def check(self, module: str, n: int, k: int, infos: Mapping[str, TensorInfo]) -> list[str]:
        kind = self.types[f"{module}.weight"]
        per, size = BLOCKS[kind]
        problems: list[str] = []
        if k % per:
            return [f"{module}: {k} inputs do not fill {kind} blocks of {per}"]
        expect(problems, infos, self.tensors(module), "blocks", (n, k // per * size), (torch.uint8,))
        return problems

    def repack(self, module: str, n: int, k: int, raw: Mapping[str, torch.Tensor], dtype: torch.dtype) -> Repacked:
        kind = self.types[f"{module}.weight"]
        scheme = self.scheme(module, k)
        assert scheme is not None
        per, size = BLOCKS[kind]
        rows = raw["blocks"]
        order = hf_row_order(self.stored_name(f"{module}.weight"), n, architecture=self.architecture,
                             num_heads=self.heads, num_kv_heads=self.kv_heads)
        if order is not None:
            rows = rows[order.to(rows.device)]
        if kind in INT8_GROUPS:
            q8, scale8 = decode_int8_blocks(kind, rows.reshape(n * (k // per), size))
            parts = {"qweight": q8.reshape(n, k), "scale": scale8.reshape(n, k // INT8_GROUPS[kind]).contiguous()}
            return Repacked(QuantizedTensor(scheme, (n, k), dtype, parts))
        if kind in OFFSET_GROUPS:  # codes q - 16 in int8, zero = offset + 16 * scale
            q5, scale, offset = decode_offset_blocks(kind, rows.reshape(n * (k // per), size))
            scale, offset = scale.reshape(n, k // 32), offset.reshape(n, k // 32)
            parts = {"qweight": (q5 - 16).to(torch.int8).reshape(n, k), "scale": scale.float().contiguous(),
                     "zero": _zero(module, offset + 16.0 * scale, torch.float32)}
            return Repacked(QuantizedTensor(scheme, (n, k), dtype, parts))
        if kind == "Q4_K":  # its own factors: sc, m a group, d, dmin (float16, held in float32) a super-block
            blocks = rows.reshape(n * (k // per), size)
            sc, mn = _k_scales(blocks)
            codes = _nibbles(blocks[:, 16:].reshape(-1, 4, 32)).reshape(n, k)
            parts = {"qweight": pack_int4_rows(codes),
                     "sub_scales": torch.stack((sc, mn), dim=-1).to(torch.uint8).reshape(n, k // 32, 2),
                     "super_scales": blocks[:, :4].contiguous().view(torch.float16).float().reshape(n, k // per, 2)}
            return Repacked(QuantizedTensor(scheme, (n, k), dtype, parts))
        q, scale, offset = decode_int4_blocks(kind, rows.reshape(n * (k // per), size))
        scale, offset = scale.reshape(n, k // 32), offset.reshape(n, k // 32)
        assert scheme.params is not None
        stored_zero = _zero(module, offset + 8.0 * scale, scheme.params)
        parts = {"qweight": pack_int4_rows(q.reshape(n, k)), "scale": scale.to(scheme.params).contiguous(),
                 "zero": stored_zero.contiguous()}
        return Repacked(QuantizedTensor(scheme, (n, k), dtype, parts))


def _zero(module: str, zero: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 zeros [N, groups] stored in `dtype`; where float32 rounds some, the log counts them."""
    stored = zero.to(dtype).contiguous()
    if dtype == torch.float32:
        rounded = int((stored.double() != zero).sum())
        if rounded:
            log.info("%s: %d of %d groups' zeros rounded to float32", module, rounded, zero.numel())
    return stored
