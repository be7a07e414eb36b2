"""CPU: a step of few rows through every decoder layer in one C++ call
(torch.ops.ferrum_cpu.decode_layers), the same kernels in the same order as the layered forward with
the CPU's ops, so equal to it bit for bit. The layered forward makes about ten Python calls per layer
(modules, reshapes, op dispatch); on the demo model (quantization auto, 2 Zen 4 cores) a decode step
took 8.1 ms layered and takes 5.4 ms chained (benchmarks/cpu-kernels.md).

Taken for steps of fewer rows than every projection's CpuKernelsMethod.dense_rows (larger ones
dequantize each weight for one dense product) when every projection of every layer is int4 or int8
storage in the integer GEMV's layout (quantization auto, a published checkpoint served through it), on one rank, with
cpu_paged attention and no per-head q/k norms. `CpuDecodeChain.for_model` says None otherwise.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ferrum.models.layers.mlp import GatedMLP
from ferrum.models.layers.quantized_linear import CpuKernelsMethod, QuantizedLinear
from ferrum.models.llama import DecoderLayer

if TYPE_CHECKING:
    from ferrum.models.attention.cpu_paged import CpuAttentionBatch
    from ferrum.models.attention.layout import KVCache
    from ferrum.models.llama import LlamaForCausalLM

_NONE = torch.empty(0)


def _chained(linear: object) -> bool:
    return (isinstance(linear, QuantizedLinear) and isinstance(linear.method, CpuKernelsMethod) and linear.repacked
            and linear.input_order is None and linear.combine is None and linear.scheme.method in ("int4", "int8")
            and not linear.scheme.offsets)


class CpuDecodeChain:
    def __init__(self, model: LlamaForCausalLM) -> None:
        self.model = model
        self.max_rows = 0  # the most rows of a step it takes: fewer than any projection's dense_rows
        first = model.layers[0]
        assert isinstance(first, DecoderLayer)
        attn = first.self_attn
        self.num_heads, self.num_kv_heads, self.head_dim = attn.num_heads, attn.num_kv_heads, attn.head_dim
        self.eps = first.input_layernorm.eps
        self.norms: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []
        self.layout: list[int] = []
        self.windows: list[int] = []  # each layer's sliding window, 0 for none
        for layer in model.layers:
            assert isinstance(layer, DecoderLayer)
            self.windows.append(layer.self_attn.window or 0)
            self.norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj,
                           layer.mlp.down_proj):
                assert isinstance(linear, QuantizedLinear) and isinstance(linear.method, CpuKernelsMethod)
                dense_rows = linear.method.dense_rows(linear)
                self.max_rows = dense_rows - 1 if not self.max_rows else min(self.max_rows, dense_rows - 1)
                int4 = linear.scheme.method == "int4"
                group = linear.scheme.group_size if int4 or linear.scheme.per_group else 0
                self.weights += [linear.packed, linear.gemv_scale, linear.gemv_offset if int4 else _NONE,
                                 _NONE if linear.bias is None else linear.bias]
                self.layout += [4 if int4 else 8, group, int(bool(getattr(linear, "gemv_zero_point", False))),
                                linear.out_features]
        self.norms.append(model.norm.weight)

    @classmethod
    def for_model(cls, model: LlamaForCausalLM) -> CpuDecodeChain | None:
        if model.tp.size != 1:
            return None
        for layer in model.layers:
            if not isinstance(layer, DecoderLayer) or layer.self_attn.q_norm is not None:
                return None
            if not isinstance(layer.mlp, GatedMLP):  # a mixture of experts: the plain path
                return None
            if layer.input_layernorm.ops.name != "cpu":
                return None
            attn, mlp = layer.self_attn, layer.mlp
            if not all(_chained(m) for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
                return None
            if layer.input_layernorm.eps != model.norm.eps or layer.post_attention_layernorm.eps != model.norm.eps:
                return None
        return cls(model)

    def hidden(self, input_ids: torch.Tensor, kv_caches: list[KVCache], batch: CpuAttentionBatch) -> torch.Tensor:
        """As model(input_ids, kv_caches, batch): the final hidden states [T, hidden]."""
        x = self.model.embed_tokens(input_ids)
        out: torch.Tensor = torch.ops.ferrum_cpu.decode_layers(
            x, self.norms, self.weights, self.layout, [c[0] for c in kv_caches], [c[1] for c in kv_caches],
            batch.positions, batch.rotary.cos_table, batch.rotary.sin_table, batch.slot_mapping, batch.block_tables,
            batch.seq_lens, batch.query_starts, batch.block_size, self.num_heads, self.num_kv_heads, self.head_dim,
            self.eps, self.windows, batch.generated)
        return out
