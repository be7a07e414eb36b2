"""Owns the model and its paged KV cache; turns a scheduled batch into logits."""

from __future__ import annotations

import torch

from ferrum.engine.scheduler import ScheduledSequence
from ferrum.engine.sequence import Sequence
from ferrum.models.attention import AttentionBatch, PrefillSegment
from ferrum.models.config import ModelConfig
from ferrum.models.llama import KVCache, LlamaForCausalLM


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, device: str) -> None:
        self.block_size = block_size
        self.device = torch.device(device)
        if self.device.type == "cpu" and next(model.parameters()).dtype == torch.bfloat16:
            from ferrum.backends.cpu_kernels import has_native_bf16, pack_linears

            if has_native_bf16():
                pack_linears(model)
        self.model = model
        cfg = model.config
        dtype = model.embed_tokens.weight.dtype
        slots = num_blocks * block_size
        self.kv_caches: list[KVCache] = [
            (
                torch.zeros(slots, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=self.device),
                torch.zeros(slots, cfg.num_kv_heads, cfg.head_dim, dtype=dtype, device=self.device),
            )
            for _ in range(cfg.num_layers)
        ]

    @staticmethod
    def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        bs, table = self.block_size, seq.block_table
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSequence]) -> tuple[torch.Tensor, list[Sequence]]:
        """Runs one forward pass. Returns logits [B, V] for the sequences that
        finish their pending tokens this step (they get a new token), in order."""
        decodes = [s for s in scheduled if s.is_decode]
        prefills = [s for s in scheduled if not s.is_decode]

        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []

        for s in decodes:
            seq = s.seq
            pos = seq.num_computed_tokens
            input_ids.append(seq.token_at(pos))
            positions.append(pos)
            slot_mapping.extend(self._slots(seq, pos, pos + 1))
            sample_rows.append(len(input_ids) - 1)
            sample_seqs.append(seq)

        decode_slots = decode_mask = None
        if decodes:
            contexts = [s.seq.num_computed_tokens + 1 for s in decodes]
            longest = max(contexts)
            padded = [self._slots(s.seq, 0, n) + [0] * (longest - n) for s, n in zip(decodes, contexts)]
            decode_slots = torch.tensor(padded, dtype=torch.long, device=self.device)
            lengths = torch.tensor(contexts, device=self.device)
            decode_mask = (torch.arange(longest, device=self.device)[None, :] < lengths[:, None])[:, None, None, :]

        segments: list[PrefillSegment] = []
        for s in prefills:
            seq, past, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            start = len(input_ids)
            input_ids.extend(seq.tokens(past, past + n))
            positions.extend(range(past, past + n))
            slot_mapping.extend(self._slots(seq, past, past + n))
            context = None
            if past:
                context = torch.tensor(self._slots(seq, 0, past + n), dtype=torch.long, device=self.device)
            segments.append(PrefillSegment(start, n, past, context))
            if past + n == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sample_seqs.append(seq)

        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        batch = AttentionBatch(
            rope=self.model.rotary(pos, self.model.embed_tokens.weight.dtype),
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.long, device=self.device),
            num_decode=len(decodes),
            decode_slots=decode_slots,
            decode_mask=decode_mask,
            prefills=tuple(segments),
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        hidden = self.model(ids, self.kv_caches, batch)

        for s in scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
        if not sample_rows:
            return torch.empty(0, self.model.config.vocab_size), []
        rows = torch.tensor(sample_rows, device=self.device)
        logits = self.model.compute_logits(hidden[rows])
        return logits.cpu(), sample_seqs

    def release(self) -> None:
        """Drops the KV cache and the model (the memory returns to the allocator)."""
        self.kv_caches = []
        self.model = None  # type: ignore[assignment]
