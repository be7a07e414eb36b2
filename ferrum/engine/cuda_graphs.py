"""Decode steps replayed as CUDA graphs, one per batch-size bucket, and greedy bursts of them.

A decode step (every scheduled sequence adds one token) replays the graph captured for the
smallest bucket that holds its sequences: their inputs are copied into the graphs' static
buffers (padded rows point at a spare "trash" KV block), and the graph computes the logits of
every row into one static buffer shared by all graphs (so that their memory pool holds one graph's
temporaries, not every graph's output). Batches of up to `KernelConfig.fused_decode_rows` run the
fused matrix-vector chain (ferrum.models.fused_decode).

A step of more tokens than sequences (prompt chunks, drafts) that fits the largest graph's rows replays
it too, one row a token (`run_rows`): a short prompt costs one replay, not an eager forward's launches.

Each graph ends with the greedy choice of every row, written where the next replay reads its
input (one position on, ferrum.models.layers.greedy): a greedy burst replays a graph several
times in a row with no host work between and copies the chosen ids back once. A burst may be
queued behind the one still running (`continue_at`), so that the host reads one burst's tokens
while the device computes the next.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as SequenceOf
from dataclasses import dataclass

import torch

from ferrum.engine.runner import StepPlan
from ferrum.engine.sequence import Sequence
from ferrum.models.attention.layout import KVCache, KVCacheLayout
from ferrum.models.attention.triton_paged import TritonPagedAttention
from ferrum.models.fused_decode import FusedDecode
from ferrum.models.layers.greedy import greedy_advance
from ferrum.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphBurst:
    """Greedy decode iterations queued on the device: their ids land in host rows start..start+steps."""

    done: torch.cuda.Event
    start: int
    steps: int
    num_seqs: int


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """Buckets for decode graphs: 1, 2, 4, 8, then every 16 up to max_num_seqs (and it)."""
    sizes = [s for s in (1, 2, 4, 8) if s < max_num_seqs] + list(range(16, max_num_seqs, 16))
    return sorted(set(sizes + [max_num_seqs]))


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[KVCache],
        layout: KVCacheLayout,
        attention: TritonPagedAttention,
        fused: FusedDecode | None,
        fused_rows: int,
        max_num_seqs: int,
        max_blocks: int,
        max_burst: int,
        trash_block: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.layout = layout
        self.attention = attention
        self.fused = fused
        self.fused_rows = fused_rows if fused is not None else 0
        self.max_num_seqs = max_num_seqs
        self.max_blocks = max_blocks
        self.max_burst = max_burst
        self.trash_block = trash_block
        self.trash_slot = trash_block * layout.block_size
        self.device = device
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.sizes: list[int] = []
        self._allocate_static_inputs()

    # -- static buffers ----------------------------------------------------------------------
    def _allocate_static_inputs(self) -> None:
        """Device buffers the graphs read and write, and pinned host twins they are filled from (one
        copy for the four per-row vectors, one for the block tables: both asynchronous)."""
        n, dev = self.max_num_seqs, self.device
        self.s_vec = torch.zeros(4, n, dtype=torch.long, device=dev)
        self.s_vec[2] = self.trash_slot
        self.s_vec[3] = 1
        self.s_ids, self.s_pos, self.s_slots, self.s_lens = self.s_vec.unbind(0)
        self.s_tables = torch.full((n, self.max_blocks), self.trash_block, dtype=torch.int32, device=dev)
        self.s_logits = torch.zeros(n, self.model.config.vocab_size, dtype=torch.float32, device=dev)
        self.h_vec = self.s_vec.cpu().pin_memory()  # columns past a graph's rows: padding (trash slot, length 1)
        self.h_tables = torch.zeros(n * self.max_blocks, dtype=torch.int32).pin_memory()  # see _upload_tables
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

    def static_bytes(self) -> int:
        """Device bytes of the static buffers (outside the graphs' pool)."""
        return sum(t.numel() * t.element_size() for t in (self.s_vec, self.s_tables, self.s_logits, self.s_tokens))

    # -- capture -------------------------------------------------------------------------------
    def _decode_forward(self, size: int) -> torch.Tensor:
        rows = slice(0, size)
        batch = self.attention.decode_graph_inputs(
            self.s_pos[rows], self.s_slots[rows], self.s_tables[rows], self.s_lens[rows], self.model.rotary
        )
        logits = self.s_logits[rows]
        if self.fused is not None and size <= self.fused_rows:  # weight-read bound: the fused chain
            self.fused.logits(self.s_ids[rows], self.kv_caches, batch, into=logits)
        else:
            logits.copy_(self.model.lm_head(self.model(self.s_ids[rows], self.kv_caches, batch)))
        # after the logits: the greedy choice is recorded and becomes the next replay's input one
        # position on (launch_greedy replays on; decode reloads the inputs)
        greedy_advance(logits, self.s_tokens, self.s_step, self.s_ids[rows], self.s_pos[rows], self.s_lens[rows],
                       self.s_slots[rows], self.s_tables[rows], self.layout.block_size, self.s_num_real,
                       pdl=self.attention.pdl)
        return logits

    @torch.inference_mode()
    def capture(self, sizes: list[int]) -> None:
        """Captures one graph per batch size, largest first: the smaller graphs reuse its pool."""
        started = time.perf_counter()
        pool = None
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in sorted(sizes, reverse=True):
                self._decode_forward(size)  # warm-up: compiles the kernels, sets up cuBLAS
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    self._decode_forward(size)
                pool = graph.pool()
                self.graphs[size] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.sizes = sorted(self.graphs)
        log.info("captured %d decode CUDA graphs (batch 1..%d) in %.1fs", len(sizes), max(sizes),
                 time.perf_counter() - started)

    @torch.inference_mode()
    def replay_seconds(self, repeats: int = 3) -> dict[int, float]:
        """Device seconds of one replay of each graph (the least of `repeats`), by its rows, every row
        padding: position 0 of the trash block, so attention over one key. What a decode or verify step of
        that many rows costs before any has been measured (the speculation policy's prior, by which it
        weighs drafting from the first step)."""
        self._staging_free()
        vec = self.h_vec_np
        vec[0], vec[1], vec[2], vec[3] = 0, 0, self.trash_slot, 1
        self.s_vec.copy_(self.h_vec, non_blocking=True)
        self.s_tables.fill_(self.trash_block)
        self.s_num_real.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        seconds: dict[int, float] = {}
        for size in self.sizes:
            best = float("inf")
            for _ in range(repeats + 1):  # the first may load code and data the others find ready
                self.s_step.zero_()
                start.record()
                self.graphs[size].replay()
                end.record()
                end.synchronize()
                best = min(best, start.elapsed_time(end) / 1e3)
            seconds[size] = best
        self._staged.record()
        return seconds

    def holds(self, num_seqs: int) -> bool:
        return bool(self.sizes) and num_seqs <= self.sizes[-1]

    def holds_rows(self, num_rows: int) -> bool:
        """Whether rows of which several may belong to one sequence (a verify step's, a drafted burst's) fit a
        graph that runs them: one past the fused chain's sizes, whose kernels read the older KV cache before
        the kernel before them has written the step's keys and values (programmatic dependent launch), so a
        row would miss the keys of its sequence's rows before it."""
        return bool(self.sizes) and max(num_rows, self.fused_rows + 1) <= self.sizes[-1]

    def _rows_bucket(self, num_rows: int) -> int:
        return next(s for s in self.sizes if s >= max(num_rows, self.fused_rows + 1))

    # -- one decode ------------------------------------------------------------------------------
    def decode(self, seqs: list[Sequence]) -> torch.Tensor:
        """Replays the graph of `seqs`' bucket; their logits [len(seqs), V] on the device."""
        size = self._load_decode(seqs)
        self.graphs[size].replay()
        return self.s_logits[: len(seqs)]

    def run_rows(self, plan: StepPlan) -> torch.Tensor:
        """A step of prompt chunks, drafts and decodes (as packed for an eager step, `plan`) as a decode of
        more rows: each token one row at its own position, with its own context length (the chunk's earlier
        tokens included: a layer writes every row's key and value before it attends), through the graph of
        the rows' bucket. Returns the logits of the plan's sampled rows. Short prompts then cost one replay
        instead of an eager forward's hundreds of launches (host-bound: 18-20 ms for a 13-token chunk of
        the 135M demo model on an H200's host, against under 1 ms of device time)."""
        step = plan.step
        tables = [rows.block_table for rows in step.sequences for _ in range(rows.length)]
        size = self._load_rows(step.input_ids, step.positions, step.slots, tables,
                               self._rows_bucket(len(step.input_ids)))
        self.graphs[size].replay()
        sampled = plan.sample_rows
        if sampled == list(range(len(sampled))):
            return self.s_logits[: len(sampled)]
        index = torch.tensor(sampled, dtype=torch.long).pin_memory().to(self.device, non_blocking=True)
        return self.s_logits.index_select(0, index)

    def _load_decode(self, seqs: list[Sequence]) -> int:
        """The static inputs for one decode row a sequence (its last token, at its next position)."""
        positions = [seq.num_computed_tokens for seq in seqs]
        return self._load_inputs(seqs, positions, [seq.token_at(p) for seq, p in zip(seqs, positions, strict=True)])

    def _load_inputs(self, seqs: list[Sequence], positions: list[int], tokens: list[int], size: int = 0) -> int:
        """Fills the static inputs for one row per entry (a sequence, the position of the token it
        computes, the token) of the graph of `size` (default: the smallest that holds them); returns it."""
        slots = [self.layout.slot(seq.block_table, p) for seq, p in zip(seqs, positions, strict=True)]
        return self._load_rows(tokens, positions, slots, [seq.block_table for seq in seqs], size)

    def _load_rows(self, tokens: list[int], positions: list[int], slots: list[int], tables: list[SequenceOf[int]],
                   size: int = 0) -> int:
        """Fills the static inputs of the graph of `size` (default: the smallest that holds the rows): each
        row's token, position, KV slot and block table, its context length one past its position."""
        n = len(tokens)
        size = size or next(s for s in self.sizes if s >= n)
        self._staging_free()
        vec = self.h_vec_np[:, :size]  # rows: token ids, positions, slots, context lengths
        vec[0] = 0
        vec[1] = 0
        vec[2] = self.trash_slot
        vec[3] = 1
        vec[0, :n] = tokens
        vec[1, :n] = positions
        vec[2, :n] = slots
        vec[3, :n] = vec[1, :n] + 1
        # whole rows (contiguous): an asynchronous copy; the columns past `size` are not read
        self.s_vec.copy_(self.h_vec, non_blocking=True)
        self._upload_tables(tables, size)  # padded rows stay at position 0 of the trash block
        self.s_step.zero_()
        self.s_num_real.fill_(n)
        self._staged.record()
        return size

    def load_tables_only(self, row_seqs: list[Sequence]) -> int:
        """For rows whose other inputs the device writes (a drafted burst, ferrum.engine.draft_bursts): each
        row's block table (its sequence's), every row's ids, positions, slots and lengths the padding's, and
        all of them counted real; returns the bucket size."""
        n = len(row_seqs)
        size = self._rows_bucket(n)
        self._staging_free()
        vec = self.h_vec_np[:, :size]
        vec[0], vec[1], vec[2], vec[3] = 0, 0, self.trash_slot, 1
        self.s_vec.copy_(self.h_vec, non_blocking=True)
        self._upload_tables([seq.block_table for seq in row_seqs], size)
        self.s_num_real.fill_(n)
        self._staged.record()
        return size

    def _load_tables(self, seqs: list[Sequence], positions: list[int]) -> None:
        """Block tables and the KV slot of each sequence's next position, for a continued burst."""
        self._staging_free()
        slots, n = self.h_vec_np[2], len(seqs)
        for i, (seq, p) in enumerate(zip(seqs, positions, strict=True)):
            slots[i] = self.layout.slot(seq.block_table, p)
        self._upload_tables([seq.block_table for seq in seqs], n)
        self.s_slots[:n].copy_(self.h_vec[2, :n], non_blocking=True)
        self._staged.record()

    def _upload_tables(self, tables: list[SequenceOf[int]], rows: int) -> None:
        """Block tables into the first `rows` rows of the graphs' table (rows past them point at the trash
        block), through a pinned staging block as wide as the longest table: a contiguous source keeps the
        copy asynchronous and small."""
        width = max(len(table) for table in tables)
        staging = self.h_tables[: rows * width].view(rows, width)
        host = staging.numpy()
        for i, table in enumerate(tables):
            host[i, : len(table)] = table
        host[len(tables) :, 0] = self.trash_block
        self.s_tables[:rows, :width].copy_(staging, non_blocking=True)

    def _staging_free(self) -> None:
        self._staged.synchronize()  # long done in practice: the uploads run first in their burst

    # -- greedy bursts -------------------------------------------------------------------------
    @torch.inference_mode()
    def launch_greedy(
        self, seqs: list[Sequence], steps: int, continue_at: list[int] | None = None
    ) -> GraphBurst:
        """See ModelRunner.launch_greedy."""
        assert steps <= self.max_burst, steps
        if continue_at is not None:
            size = self._burst_size
            self._load_tables(seqs, continue_at)
            start = self.max_burst - self._burst_start  # the other half of the token rows
            self.s_step.fill_(start)
        else:
            size = self._load_decode(seqs)
            start = 0
        graph = self.graphs[size]
        for _ in range(steps):
            graph.replay()
        # whole rows: a contiguous copy stays asynchronous (a strided one goes through pageable memory)
        self.h_tokens[start : start + steps].copy_(self.s_tokens[start : start + steps], non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._burst_start, self._burst_size = start, size
        return GraphBurst(done, start, steps, len(seqs))

    def read_greedy(self, burst: GraphBurst) -> list[list[int]]:
        """Waits for a burst; its chosen ids, [steps][sequences]."""
        burst.done.synchronize()
        return self.h_tokens_np[burst.start : burst.start + burst.steps, : burst.num_seqs].tolist()

    def release(self) -> None:
        self.graphs.clear()
        self.sizes = []
        self.kv_caches = []
        self.model = None  # type: ignore[assignment]
        for name in ("s_vec", "s_ids", "s_pos", "s_slots", "s_lens", "s_tables", "s_logits", "s_tokens", "s_step",
                     "s_num_real"):
            self.__dict__.pop(name, None)
