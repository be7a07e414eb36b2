"""GPU: the decode of a few rows (up to `KernelConfig.fused_decode_rows`) as a chain of fused
matrix-vector kernels (ferrum.kernels.gemv), each projection with its neighbours fused in: the
norm before it in its prologue, rope and the KV-cache write (q/k/v; with per-head q/k norms, as
Qwen3 has, those in the decode attention kernel instead), or the residual add or silu * mul after it
in its epilogue; a mixture of experts' layer runs its own kernels
(ferrum.kernels.moe: the norm and the router's top k in one, the chosen experts' rows read per pair,
the last of them adding the residual). At these batch sizes a step is a chain of weight reads, and
these kernels read the weights faster than cuBLAS while launching a third as many kernels.
Equal to the layered forward up to rounding order.

Under tensor parallelism (a rank's shard of the model) o_proj's and down_proj's products are
partial sums: rank 0 alone adds the residual (and down_proj's bias) in their epilogues, and the sum
across ranks follows each, so every rank holds partial_0 + partial_1 + ... + residual; the first
layer's rows come from the vocabulary-split embedding (itself a sum), and the LM head's rows of
the vocabulary are gathered. A quantized projection hands the kernels its storage (`gemv_weight`),
sliced by its kind's table (KernelConfig.gemv_table)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ferrum.kernels.config import GemvTable, KernelConfig
from ferrum.kernels.quant_weight import QuantWeight
from ferrum.models.layers.linear import gemv_weight
from ferrum.models.layers.moe import MoE
from ferrum.models.layers.quantized_linear import QuantizedLinear
from ferrum.models.llama import DecoderLayer

if TYPE_CHECKING:
    from ferrum.models.attention.layout import KVCache
    from ferrum.models.attention.triton_paged import TritonAttentionBatch
    from ferrum.models.llama import LlamaForCausalLM


class FusedDecode:
    """`kernels`: the GEMV tables (each projection sliced by its weight's kind's table)."""

    def __init__(self, model: LlamaForCausalLM, kernels: KernelConfig, pdl: bool) -> None:
        self.model = model
        self.kernels = kernels
        self.pdl = pdl  # programmatic dependent launch through the chain (not for its first kernel)
        # the experts' per-pair products: GemvTable()'s slicing (the served bf16 table's whole-K rule for narrow
        # products was measured on the dense projections only), int4 stacks taking x as int8 as the int4 table says
        self.experts_table = GemvTable(int8_inputs=kernels.gemv_int4.int8_inputs)

    @property
    def max_rows(self) -> int:
        """The most rows a step runs through the chain: KernelConfig.fused_decode_rows, or 1 when a
        projection is quantized (the planes' instructions repeat a row: on an H100 the int4 chain at
        4 rows took 4x its 1-row time, where the W4A16 GEMM at 16 rows runs near bf16 cuBLAS); 0 (the
        chain unused) when a layer stores its inputs reordered."""
        quantized = [m for m in self.model.modules() if isinstance(m, QuantizedLinear)]
        if any(m.input_order is not None for m in quantized):
            return 0  # act-order storage: its input is reordered first (QuantizedLinear.forward)
        return min(self.kernels.fused_decode_rows, 1) if quantized else self.kernels.fused_decode_rows

    def weight(self, linear: nn.Module) -> tuple[torch.Tensor | QuantWeight, GemvTable]:
        """What the kernels read of a projection (its weight, or its quantized storage), and its table."""
        weight = gemv_weight(linear)
        return weight, self.kernels.gemv_table(weight.kind if isinstance(weight, QuantWeight) else None)

    def logits(self, input_ids: torch.Tensor, kv_caches: list[KVCache], batch: TritonAttentionBatch,
               into: torch.Tensor | None = None) -> torch.Tensor:
        """The logits (float32) of decoding `input_ids` [M], as compute_logits(forward(...)); into
        `into` [M, vocab] when given."""
        from ferrum.kernels.gemv import gemv, qkv_rope_store

        model, pdl = self.model, self.pdl
        tp = model.tp
        split, lead = tp.size > 1, tp.rank == 0  # the lead rank adds the residual and biases, once
        if split:  # the embedding's rows are split across ranks: a sum of its own
            h, rows = model.embed_tokens(input_ids), None
        else:  # the first layer reads its input rows straight from the embedding table (no gather kernel)
            h, rows = model.embed_tokens.weight, input_ids
        for layer, cache in zip(model.layers, kv_caches, strict=True):
            assert isinstance(layer, DecoderLayer)  # (run while a graph is captured, not at its replays)
            attn, mlp = layer.self_attn, layer.mlp
            norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
            w, table = self.weight(attn.qkv_proj)
            if attn.q_norm is None:  # rope and the cache write in the projection's epilogue
                q = qkv_rope_store(h, w, attn.qkv_proj.bias, norm1.weight, norm1.eps,
                                   batch.positions, batch.cos_table, batch.sin_table, batch.slot_mapping,
                                   cache[0], cache[1], attn.num_heads, attn.num_kv_heads, attn.head_dim, table,
                                   x_rows=rows, pdl=pdl, kv_scale=attn.kv_scale)
                out = batch.attend_stored(attn, q, cache)
            else:  # per-head q/k norms need whole heads: norms, rope and the cache write in the attention kernel
                qkv = gemv(h, w, table, bias=attn.qkv_proj.bias, norm_weight=norm1.weight, eps=norm1.eps,
                           x_rows=rows, pdl=pdl)
                out = batch.attend_decodes(attn, qkv, cache)
            w, table = self.weight(attn.o_proj)
            h = gemv(out, w, table, residual=h if lead else None, residual_rows=rows, pdl=pdl)
            rows = None
            if split:
                h = tp.all_reduce(h)
            if isinstance(mlp, MoE):  # the norm in the router's kernel, then the experts' (summed across ranks)
                h = mlp.decode(h, norm2.weight, norm2.eps, pdl, self.experts_table)
                continue
            w, table = self.weight(mlp.gate_up_proj)
            act = gemv(h, w, table, bias=mlp.gate_up_proj.bias, norm_weight=norm2.weight, eps=norm2.eps, gated=True,
                       pdl=pdl)
            w, table = self.weight(mlp.down_proj)
            h = gemv(act, w, table, bias=mlp.down_proj.bias if lead else None, residual=h if lead else None, pdl=pdl)
            if split:
                h = tp.all_reduce(h)
        w, table = self.weight(model.lm_head)
        if not split:
            return gemv(h, w, table, norm_weight=model.norm.weight, eps=model.norm.eps, out_dtype=torch.float32,
                        pdl=pdl, out=into)
        part = gemv(h, w, table, norm_weight=model.norm.weight, eps=model.norm.eps, out_dtype=torch.float32, pdl=pdl)
        logits = tp.all_gather_last(part)[..., : model.config.vocab_size]
        return logits if into is None else into.copy_(logits)
