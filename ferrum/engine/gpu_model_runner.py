"""The model runner for CUDA devices: paged KV cache, Triton attention, CUDA graphs for decode.

Decode steps (every scheduled sequence adds one token) replay a CUDA graph captured for the
smallest batch-size bucket that holds them: the inputs are copied into the graph's static
buffers, padded rows point at a spare "trash" KV block, and the graph computes the logits of
every row. Other steps (prefills, chunks, mixed batches) run eagerly: their decode rows through the
decode kernel, their prompts through the prefill kernel, the step padded to a token-count bucket
that start-up has already run once. Logits stay on the device for sampling.

Each decode graph ends with the greedy choice of every row, written where the next replay reads
its input (one position on): greedy bursts (launch_greedy / read_greedy) replay a graph several
times in a row with no host work between, and copy the chosen ids back once. Batches of 1-4 run
the fused matrix-vector path (LlamaForCausalLM.decode_logits_fused).
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from ferrum.engine.sampling_params import SamplingParams
from ferrum.engine.scheduler import ScheduledSequence
from ferrum.engine.sequence import Sequence
from ferrum.models import triton_gemv, triton_kernels
from ferrum.models.attention import KVCache
from ferrum.models.gpu_attention import PrefillTiles, TritonAttentionBatch
from ferrum.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GreedyBurst:
    """Greedy decode iterations queued on the device: their ids land in host rows start..start+steps."""

    done: torch.cuda.Event
    start: int
    steps: int
    num_seqs: int


def eager_bucket(num_tokens: int) -> int:
    """Token count an eager step is padded to: a multiple of 16 up to 256, then of 256."""
    step = 16 if num_tokens <= 256 else 256
    return -(-num_tokens // step) * step


def eager_buckets(max_tokens: int) -> list[int]:
    return sorted({eager_bucket(n) for n in [*range(16, 257, 16), *range(512, max_tokens + 256, 256)]})


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Buckets for decode graphs: 1, 2, 4, 8, then every 16 up to max_num_seqs (and it)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class GPUModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        num_blocks: int,
        block_size: int,
        device: str,
        max_num_seqs: int,
        max_model_len: int,
        use_cuda_graphs: bool = True,
        max_burst: int = 16,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.page = block_size
        cfg = model.config
        self.dtype = model.embed_tokens.weight.dtype
        self.trash_block = num_blocks  # one block past the allocator's: padded graph rows write here
        self.trash_slot = num_blocks * block_size
        slots = (num_blocks + 1) * block_size
        self.kv_caches: list[KVCache] = [
            (
                torch.zeros(slots, cfg.num_kv_heads, cfg.head_dim, dtype=self.dtype, device=self.device),
                torch.zeros(slots, cfg.num_kv_heads, cfg.head_dim, dtype=self.dtype, device=self.device),
            )
            for _ in range(cfg.num_layers)
        ]
        self.max_blocks = -(-max_model_len // block_size)
        self.max_num_seqs = max_num_seqs
        self.max_burst = max(1, max_burst)  # greedy decodes per burst (padding rows do not move)
        cuda = self.device.type == "cuda"  # elsewhere only in tests, with Triton's interpreter
        self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count if cuda else 1
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._graph_sizes: list[int] = []
        if use_cuda_graphs:
            self._allocate_static_inputs()
            self._capture_graphs()

    @torch.inference_mode()
    def warm_up_eager(self, max_tokens: int) -> None:
        """Runs one eager step at every padded token count up to max_tokens, so that serving meets
        no GEMM shape (and no kernel) for the first time."""
        started = time.perf_counter()
        probe = Sequence("warm-up", [0, 0], SamplingParams(max_tokens=1), 0.0)
        probe.block_table = [self.trash_block]
        for size in eager_buckets(max_tokens):
            probe.num_computed_tokens = 0
            self._run_eager([ScheduledSequence(probe, 2)], pad_to=size)
        torch.cuda.synchronize(self.device)
        log.info("warmed up eager steps of up to %d tokens in %.1fs", max_tokens, time.perf_counter() - started)

    @staticmethod
    def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
        return 2 * config.num_layers * config.num_kv_heads * config.head_dim * dtype.itemsize

    # -- one step ---------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSequence]) -> tuple[torch.Tensor, list[Sequence]]:
        """Runs one forward pass; returns device logits [B, V] (float32) for the sequences that
        get a new token this step, in order."""
        if all(s.is_decode for s in scheduled) and self.graphs and len(scheduled) <= self.max_num_seqs:
            seqs = [s.seq for s in scheduled]
            logits = self._decode_with_graph(seqs)
        else:
            logits, seqs = self._run_eager(scheduled)
        for s in scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens
        return logits, seqs

    def _decode_with_graph(self, seqs: list[Sequence]) -> torch.Tensor:
        size = self._load_graph_inputs(seqs)
        graph, logits = self.graphs[size]
        graph.replay()
        return logits[: len(seqs)]

    @torch.inference_mode()
    def launch_greedy(self, seqs: list[Sequence], steps: int, continue_at: list[int] | None = None) -> GreedyBurst:
        """Queues `steps` greedy decode iterations of `seqs` (each replay's argmax is the next one's
        input, positions and slots advanced on the device) and the copy of the chosen ids to the
        host; returns at once. `continue_at`: the same sequences carry on at these positions from
        where the last burst left the device's inputs (their block tables and first KV slots are
        uploaded again: the blocks may be new), so the host may queue the next burst before it has
        looked at the last one's tokens. The caller has grown every block table to hold the burst;
        num_computed_tokens is left to the caller (a sequence may stop part-way through)."""
        assert steps <= self.max_burst, steps
        n = len(seqs)
        if continue_at is not None:
            size = self._burst_size
            self._load_tables(seqs, continue_at)
            start = self.max_burst - self._burst_start  # the other half of the token rows
            self.s_step.fill_(start)
        else:
            size = self._load_graph_inputs(seqs)
            start = 0
        graph = self.graphs[size][0]
        for _ in range(steps):
            graph.replay()
        # whole rows: a contiguous copy stays asynchronous (a strided one goes through pageable memory)
        self.h_tokens[start : start + steps].copy_(self.s_tokens[start : start + steps], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._burst_start, self._burst_size = start, size
        return GreedyBurst(done, start, steps, n)

    def read_greedy(self, burst: GreedyBurst) -> list[list[int]]:
        """Waits for a burst; its chosen ids, [steps][sequences]."""
        burst.done.synchronize()
        return self.h_tokens_np[burst.start : burst.start + burst.steps, : burst.num_seqs].tolist()

    def _load_tables(self, seqs: list[Sequence], positions: list[int]) -> None:
        """Block tables and the KV slot of each sequence's next position, for a continued burst."""
        self._staging_free()
        slots, page, n = self.h_vec_np[2], self.page, len(seqs)
        for i, (seq, p) in enumerate(zip(seqs, positions)):
            slots[i] = seq.block_table[p // page] * page + p % page
        self._upload_tables(seqs, n)
        self.s_slots[:n].copy_(self.h_vec[2, :n], non_blocking=True)
        self._staged_now()

    def _upload_tables(self, seqs: list[Sequence], rows: int) -> None:
        """The block tables of `seqs` into the first `rows` rows of the graphs' table (rows past the
        sequences point at the trash block), through a pinned staging block as wide as the
        longest table: a contiguous source keeps the copy asynchronous and small."""
        width = max(len(seq.block_table) for seq in seqs)
        staging = self.h_tables[: rows * width].view(rows, width)
        host = staging.numpy()
        for i, seq in enumerate(seqs):
            host[i, : len(seq.block_table)] = seq.block_table
        host[len(seqs) :, 0] = self.trash_block
        self.s_tables[:rows, :width].copy_(staging, non_blocking=True)

    def _load_graph_inputs(self, seqs: list[Sequence]) -> int:
        """Fills the graphs' static inputs for a decode of `seqs`; returns the bucket size."""
        n = len(seqs)
        size = next(s for s in self._graph_sizes if s >= n)
        page = self.page
        self._staging_free()
        vec = self.h_vec_np[:, :size]  # rows: token ids, positions, slots, context lengths
        vec[0] = 0
        vec[1] = 0
        vec[2] = self.trash_slot
        vec[3] = 1
        for i, seq in enumerate(seqs):
            p = seq.num_computed_tokens
            table = seq.block_table
            vec[0, i] = seq.token_at(p)
            vec[1, i] = p
            vec[2, i] = table[p // page] * page + p % page
            vec[3, i] = p + 1
        # whole rows (contiguous): an asynchronous copy; the columns past `size` are not read
        self.s_vec.copy_(self.h_vec, non_blocking=True)
        self._upload_tables(seqs, size)  # padded rows stay at position 0 of the trash block
        self.s_step.zero_()
        self.s_num_real.fill_(n)
        self._staged_now()
        return size

    def _run_eager(
        self, scheduled: list[ScheduledSequence], pad_to: int = 0
    ) -> tuple[torch.Tensor, list[Sequence]]:
        # decodes first: their rows go through the grouped decode kernel (one pass over each
        # sequence's cache per kv head), the rest through the prefill kernel
        scheduled = [s for s in scheduled if s.is_decode] + [s for s in scheduled if not s.is_decode]
        num_decode = sum(1 for s in scheduled if s.is_decode)
        page = self.page
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        q_start: list[int] = []
        q_len: list[int] = []
        past: list[int] = []
        tile_seq: list[int] = []
        tile_m: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        width = max(len(s.seq.block_table) for s in scheduled)
        tables = np.zeros((len(scheduled), width), dtype=np.int32)
        for i, s in enumerate(scheduled):
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            table = seq.block_table
            tables[i, : len(table)] = table
            q_start.append(len(ids))
            q_len.append(n)
            past.append(start)
            ids.extend(seq.tokens(start, start + n))
            positions = range(start, start + n)
            pos.extend(positions)
            slots.extend(table[p // page] * page + p % page for p in positions)
            if i >= num_decode:
                for m0 in range(0, n, triton_kernels.PREFILL_BLOCK_M):
                    tile_seq.append(i)
                    tile_m.append(m0)
            if start + n == seq.num_tokens:
                sample_rows.append(len(ids) - 1)
                sample_seqs.append(seq)
        # pad the step to a bucket of token counts: a handful of GEMM shapes, all met at start-up
        # (a new shape costs cuBLAS a kernel choice and a module load mid-serving)
        pad = max(pad_to, eager_bucket(len(ids))) - len(ids)
        ids.extend([0] * pad)
        pos.extend([0] * pad)
        slots.extend([self.trash_slot] * pad)
        dev = self.device

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32).to(dev, non_blocking=True)

        batch = TritonAttentionBatch(
            positions=torch.tensor(pos, dtype=torch.long).to(dev, non_blocking=True),
            cos_table=self.model.rotary.cos_table,
            sin_table=self.model.rotary.sin_table,
            slot_mapping=torch.tensor(slots, dtype=torch.long).to(dev, non_blocking=True),
            block_tables=torch.from_numpy(tables).to(dev, non_blocking=True),
            page=page,
            context_lens=ints([p + 1 for p in past[:num_decode]]) if num_decode else None,
            tiles=PrefillTiles(ints(tile_seq), ints(tile_m), ints(q_start), ints(q_len), ints(past)) if tile_seq else None,
            num_decode=num_decode,
        )
        hidden = self.model(torch.tensor(ids, dtype=torch.long).to(dev, non_blocking=True), self.kv_caches, batch)
        if not sample_rows:
            return torch.empty(0, self.model.config.vocab_size, device=dev), []
        rows = torch.tensor(sample_rows, dtype=torch.long).to(dev, non_blocking=True)
        return self.model.compute_logits(hidden.index_select(0, rows)), sample_seqs

    # -- CUDA graphs -----------------------------------------------------------------------
    def _allocate_static_inputs(self) -> None:
        """Device buffers the graphs read, and pinned host twins they are filled from (one copy for the
        four per-row vectors, one for the block tables: both asynchronous)."""
        n, dev = self.max_num_seqs, self.device
        self.s_vec = torch.zeros(4, n, dtype=torch.long, device=dev)
        self.s_vec[2] = self.trash_slot
        self.s_vec[3] = 1
        self.s_ids, self.s_pos, self.s_slots, self.s_lens = self.s_vec.unbind(0)
        self.s_tables = torch.full((n, self.max_blocks), self.trash_block, dtype=torch.int32, device=dev)
        self.h_vec = self.s_vec.cpu().pin_memory()  # columns past a graph's rows: padding (trash slot, length 1)
        self.h_tables = torch.zeros(n * self.max_blocks, dtype=torch.int32).pin_memory()  # staging, see _upload_tables
        self.h_vec_np = self.h_vec.numpy()
        # greedy bursts: each replay writes its argmax into row s_step of s_tokens (two halves: a
        # burst queued behind another writes the other half), for the first s_num_real rows
        self.s_tokens = torch.zeros(2 * self.max_burst, n, dtype=torch.long, device=dev)
        self.h_tokens = torch.zeros(2 * self.max_burst, n, dtype=torch.long).pin_memory()
        self.h_tokens_np = self.h_tokens.numpy()
        self.s_step = torch.zeros(1, dtype=torch.long, device=dev)
        self.s_num_real = torch.zeros(1, dtype=torch.long, device=dev)
        self._burst_start, self._burst_size = 0, 1
        # recorded after each upload from the pinned staging above: the host must not refill it
        # before the last upload ran (a burst may be queued behind one still running)
        self._staged = torch.cuda.Event()

    def _staged_now(self) -> None:
        self._staged.record()

    def _staging_free(self) -> None:
        self._staged.synchronize()  # long done in practice: the uploads run first in their burst

    def _decode_forward(self, size: int) -> torch.Tensor:
        batch = TritonAttentionBatch(
            positions=self.s_pos[:size],
            cos_table=self.model.rotary.cos_table,
            sin_table=self.model.rotary.sin_table,
            slot_mapping=self.s_slots[:size],
            block_tables=self.s_tables[:size],
            page=self.page,
            context_lens=self.s_lens[:size],
            tiles=None,
            decode_splits=triton_kernels.decode_splits(size, self.model.config.num_kv_heads, self.num_sms),
        )
        if size <= triton_gemv.MAX_ROWS:  # weight-read bound: fused matrix-vector kernels
            logits = self.model.decode_logits_fused(self.s_ids[:size], self.kv_caches, batch)
        else:
            logits = self.model.compute_logits(self.model(self.s_ids[:size], self.kv_caches, batch))
        # in the graph, after the logits: the greedy choice is recorded and becomes the next replay's
        # input one position on (launch_greedy replays on; _decode_with_graph reloads the inputs)
        triton_kernels.greedy_advance(logits, self.s_tokens, self.s_step, self.s_ids[:size], self.s_pos[:size],
                                      self.s_lens[:size], self.s_slots[:size], self.s_tables[:size], self.page,
                                      self.s_num_real)
        return logits

    @torch.inference_mode()
    def _capture_graphs(self) -> None:
        started = time.perf_counter()
        sizes = graph_batch_sizes(self.max_num_seqs)
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in reversed(sizes):  # largest first: the smaller graphs reuse its pool
                self._decode_forward(size)  # warm-up: compiles the kernels, sets up cuBLAS
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    logits = self._decode_forward(size)
                pool = graph.pool()
                self.graphs[size] = (graph, logits)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self._graph_sizes = sizes
        log.info("captured %d decode CUDA graphs (batch 1..%d) in %.1fs", len(sizes), self.max_num_seqs,
                 time.perf_counter() - started)

    def release(self) -> None:
        """Drops the graphs, the KV cache and the model so that the device memory can be freed."""
        self.graphs.clear()
        self._graph_sizes = []
        self.kv_caches = []
        self.model = None  # type: ignore[assignment]
        for name in ("s_vec", "s_ids", "s_pos", "s_slots", "s_lens", "s_tables", "s_tokens", "s_step", "s_num_real"):
            self.__dict__.pop(name, None)
        gc.collect()
        if torch.cuda.is_available():
            # cuBLAS keeps a workspace per stream it ran on (the capture stream's too) until told
            clear_workspaces = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear_workspaces is not None:
                clear_workspaces()
            torch.cuda.empty_cache()
