"""torch_paged: attention over the paged KV cache in plain PyTorch, for every device (the CPU's
path). Each step writes the new k and v into their slots (index_copy_), then gathers every
sequence's cached k and v by slot and runs SDPA: decodes together (padded to the longest context,
masked), each prefill on its own (causal, after its cached tokens). A layer with a sliding window
gathers only the keys inside it (its queries' band of the mask)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from ferrum.backends.device import Device
from ferrum.models.attention.layout import FP8_MAX, KVCache, KVCacheLayout
from ferrum.models.attention.packed_step import PackedStep, host_ints
from ferrum.models.layers.rotary import RotaryEmbedding, apply_rotary

if TYPE_CHECKING:
    from ferrum.models.attention.layer import Attention


@dataclass(frozen=True)
class PrefillSegment:
    start: int  # first row of this sequence's tokens in the packed batch
    length: int  # new tokens this step
    past: int  # tokens already in the cache before this step
    context_slots: torch.Tensor | None  # slots of the keys its queries see, the cached then its own; None: past == 0
    mask: torch.Tensor | None  # [length, keys] True where a query sees a key; None: causal over its own tokens


@dataclass(frozen=True)
class ContextView:
    """The cached keys one window's queries read in a step (every key of each sequence without a window)."""

    decode_slots: torch.Tensor | None  # [num_decode, longest] slots to read, padded
    decode_mask: torch.Tensor | None  # [num_decode, 1, 1, longest] True where a slot is real
    prefills: tuple[PrefillSegment, ...]


def window_start(position: int, window: int | None) -> int:
    """The first key position a query at `position` sees: itself and the window - 1 before it."""
    return 0 if window is None else max(0, position - window + 1)


@dataclass(frozen=True)
class AttentionBatch:
    """One step's attention inputs for the plain-torch path. Which cached keys the queries read depends on
    the layer's window: each window's `ContextView` is built by the first layer that asks for it."""

    rope: tuple[torch.Tensor, torch.Tensor]  # cos, sin for each token's position: [T, 1, head_dim]
    slot_mapping: torch.Tensor  # [T] where each new token's k/v is written
    num_decode: int
    step: PackedStep
    layout: KVCacheLayout
    device: torch.device
    views: dict[int | None, ContextView] = field(default_factory=dict)

    def view(self, window: int | None) -> ContextView:
        if window not in self.views:
            self.views[window] = self._build(window)
        return self.views[window]

    def _build(self, window: int | None) -> ContextView:
        dev, layout, step = self.device, self.layout, self.step
        decodes = step.sequences[: step.num_decode]
        decode_slots = decode_mask = None
        if decodes:
            spans = [(window_start(s.past, window), s.past + 1) for s in decodes]
            longest = max(end - lo for lo, end in spans)
            padded = [layout.slots(s.block_table, lo, end) + [0] * (longest - (end - lo))
                      for s, (lo, end) in zip(decodes, spans, strict=True)]
            decode_slots = torch.tensor(padded, dtype=torch.long, device=dev)
            lengths = torch.tensor([end - lo for lo, end in spans], device=dev)
            decode_mask = (torch.arange(longest, device=dev)[None, :] < lengths[:, None])[:, None, None, :]
        segments = []
        for s in step.sequences[step.num_decode :]:
            lo = window_start(s.past, window)
            context = mask = None
            if s.past:
                context = torch.tensor(layout.slots(s.block_table, lo, s.past + s.length), dtype=torch.long,
                                       device=dev)
            if s.past or (window is not None and s.length > window):
                query = torch.arange(s.past, s.past + s.length, device=dev)[:, None]
                key = torch.arange(lo, s.past + s.length, device=dev)[None, :]
                mask = (key <= query) if window is None else (key <= query) & (key > query - window)
            segments.append(PrefillSegment(s.start, s.length, s.past, context, mask))
        return ContextView(decode_slots, decode_mask, tuple(segments))

    def attend(self, layer: Attention, qkv: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """qkv: [T, q_size + 2 kv_size] -> attention output [T, q_size]; writes k, v to the cache."""
        heads = layer.num_heads + layer.num_kv_heads
        qk = qkv[:, : layer.q_size + layer.kv_size].view(-1, heads, layer.head_dim)
        v = qkv[:, layer.q_size + layer.kv_size :].view(-1, layer.num_kv_heads, layer.head_dim)
        if layer.q_norm is not None and layer.k_norm is not None:
            q, k = qk.split([layer.num_heads, layer.num_kv_heads], dim=1)
            qk = torch.cat([layer.q_norm.norm(q), layer.k_norm.norm(k)], dim=1)
        qk = apply_rotary(qk, *self.rope)  # q and k heads rotated together: one set of ops for both
        q, k = qk.split([layer.num_heads, layer.num_kv_heads], dim=1)
        out = paged_attention(q, k, v, cache[0], cache[1], self.slot_mapping, self.view(layer.window),
                              layer.kv_scale if cache[0].dtype == FP8 else None)
        return out.reshape(-1, layer.q_size)


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    context: ContextView,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KV, D]. Writes k, v to the cache (at slot_mapping) and returns [T, H, D], each
    query attending to the keys `context` says it sees. kv_scale: an fp8 cache's k and v scales ([2] float32):
    k / its scale is stored, the stored value times it read."""
    if kv_scale is not None:
        # as bytes: torch's index ops take no fp8
        k_cache.view(torch.uint8).index_copy_(0, slot_mapping, to_fp8(k, kv_scale[0]).view(torch.uint8))
        v_cache.view(torch.uint8).index_copy_(0, slot_mapping, to_fp8(v, kv_scale[1]).view(torch.uint8))
    else:
        k_cache.index_copy_(0, slot_mapping, k)
        v_cache.index_copy_(0, slot_mapping, v)
    gqa = q.shape[1] != k.shape[1]
    slots = context.decode_slots
    n = 0 if slots is None else slots.shape[0]
    if slots is not None:  # n decodes
        qd = q[:n].unsqueeze(2)  # [n, H, 1, D]
        kd = _gather(k_cache, slots, q.dtype, kv_scale, 0).transpose(1, 2)  # [n, KV, L, D]
        vd = _gather(v_cache, slots, q.dtype, kv_scale, 1).transpose(1, 2)
        decoded = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=context.decode_mask, enable_gqa=gqa)
        if not context.prefills:
            return decoded.squeeze(2)
    out = torch.empty_like(q)
    if n:
        out[:n] = decoded.squeeze(2)

    for seg in context.prefills:
        rows = slice(seg.start, seg.start + seg.length)
        qs = q[rows].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if seg.context_slots is None:  # a whole prompt: its own keys
            ks = k[rows].transpose(0, 1).unsqueeze(0)
            vs = v[rows].transpose(0, 1).unsqueeze(0)
        else:  # [1, KV, keys, D]: the cached keys it sees, then its own
            ks = _gather(k_cache, seg.context_slots, q.dtype, kv_scale, 0).transpose(0, 1).unsqueeze(0)
            vs = _gather(v_cache, seg.context_slots, q.dtype, kv_scale, 1).transpose(0, 1).unsqueeze(0)
        if seg.mask is None:
            o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=gqa)
        else:
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=seg.mask, enable_gqa=gqa)
        out[rows] = o.squeeze(0).transpose(0, 1)
    return out


def _gather(cache: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype, kv_scale: torch.Tensor | None,
            which: int) -> torch.Tensor:
    """cache[slots] for slots of any shape, in `dtype` (an fp8 cache's values times scale `which` of
    kv_scale); index_select is far faster than advanced indexing on CPU."""
    if kv_scale is None:
        return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])
    rows = cache.view(torch.uint8).index_select(0, slots.reshape(-1)).view(FP8)  # as bytes: no fp8 index ops
    return (rows.to(torch.float32) * kv_scale[which]).to(dtype).view(*slots.shape, *cache.shape[1:])


FP8 = torch.float8_e4m3fn


def to_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale as e4m3, saturated at +-448 (a plain cast of a larger value gives NaN)."""
    return (x.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


class TorchPagedAttention:
    name = "torch_paged"

    def __init__(self, device: Device, layout: KVCacheLayout, dtype: torch.dtype | None = None) -> None:
        self.device = device.torch_device
        self.layout = layout
        self.dtype = dtype or layout.dtype  # what the attention computes in: the serving dtype

    def step_inputs(self, step: PackedStep, rotary: RotaryEmbedding) -> AttentionBatch:
        dev = self.device
        positions = host_ints(step.positions).to(dev)
        return AttentionBatch(
            rope=rotary(positions, self.dtype),
            slot_mapping=host_ints(step.slots).to(dev),
            num_decode=step.num_decode,
            step=step,
            layout=self.layout,
            device=dev,
        )
