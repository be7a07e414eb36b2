"""Drafted bursts: greedy speculative decoding run on the device by itself for several iterations, the
drafting (prompt lookup), the verification and the acceptance all queued without the host in between.

A plain greedy burst (ferrum.engine.cuda_graphs) gives each sequence one token an iteration. A drafted burst
gives it 1 to k + 1. Each iteration is two kernels around a decode graph's replay (ferrum.kernels.ngram):
`draft_rows` drafts k tokens per sequence from its tokens so far (NgramProposer's rule) and writes the graph's
inputs for the sequence's last token and its draft as k + 1 rows (as a host verify step does: each row at its
own position, a layer writing every row's key and value before it attends); the graph gives each row's
greedy choice; `accept` keeps the leading draft tokens that are those choices and the choice after them,
appends them to the sequence's tokens on the device and moves its length on. The refused rows' keys and values
are overwritten by the next iteration's. The chosen ids and the counts come back to the host in one copy at
the end, where the engine appends them one token at a time (stop tokens, stop strings and max_tokens act as
after single steps; a sequence that stopped has the rest of its rows dropped).

The block tables are grown by the caller for k + 1 tokens an iteration (the most a sequence can gain) and
truncated after. Only for batches whose rows fit a captured decode graph: a batch whose k + 1 rows a sequence
would not fit the largest drafts fewer tokens a sequence (64 sequences at k 4 in graphs of up to 256 rows:
3 each), the kernels compiled at start-up for every k up to the configured one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ferrum.engine.cuda_graphs import DecodeGraphs
from ferrum.engine.sampling_params import SamplingParams
from ferrum.engine.sequence import Sequence
from ferrum.kernels.ngram import accept, draft_rows


@dataclass(frozen=True)
class DraftBurst:
    """Drafted iterations queued on the device: `steps` iterations of `num_seqs` sequences, k drafts each."""

    done: torch.cuda.Event
    steps: int
    num_seqs: int
    k: int


class DraftBursts:
    def __init__(self, graphs: DecodeGraphs, k: int, min_n: int, max_n: int) -> None:
        """Up to k drafts a sequence an iteration, from n-grams of max_n down to min_n tokens (the kernels are
        compiled for these, at start-up)."""
        self.graphs = graphs
        self.k, self.min_n, self.max_n = k, min_n, max_n
        self.max_rows = graphs.sizes[-1] if graphs.sizes else 0
        # per iteration and sequence: the k + 1 chosen ids, then how many of them the sequence gains
        room = max(graphs.max_burst, 1) * 2 * max(self.max_rows, 1)
        self.d_out = torch.zeros(room, dtype=torch.long, device=graphs.device)
        self.h_out = torch.zeros(room, dtype=torch.long).pin_memory()
        if self.max_rows >= 2:
            self._warm_up()

    def _warm_up(self) -> None:
        """One drafted iteration of a probe in the spare trash blocks for each k up to the configured one: the
        kernels are compiled and loaded now, not in the first burst (whose time the speculation policy weighs
        drafting by)."""
        for k in range(1, min(self.k, self.max_rows - 1) + 1):
            probe = Sequence("warm-up", [0], SamplingParams(max_tokens=1), 0.0)
            probe.block_table = [self.graphs.trash_block] * (-(-(k + 1) // self.graphs.layout.block_size))
            self.read(self.launch([probe], 1, k))

    @torch.inference_mode()
    def launch(self, seqs: list[Sequence], steps: int, k: int) -> DraftBurst:
        """Queues `steps` drafted iterations of `seqs` (each decoding: its last token not yet computed), k drafts
        a sequence, and returns at once. Needs 1 <= k <= the configured k, len(seqs) * (k + 1) <= max_rows and
        steps <= the graphs' max_burst."""
        g = self.graphs
        assert 1 <= k <= self.k, (k, self.k)
        batch, width = len(seqs), k + 1
        rows = batch * width
        assert rows <= self.max_rows and 1 <= steps <= g.max_burst, (rows, steps)
        device, page = g.device, g.layout.block_size
        size = g.load_tables_only([seq for seq in seqs for _ in range(width)])
        # each sequence's tokens, with room for what the burst may add; its block table
        lens = [seq.num_tokens for seq in seqs]
        history = np.zeros((batch, max(lens) + steps * width + 1), dtype=np.int64)
        table_width = max(len(seq.block_table) for seq in seqs)
        tables = np.full((batch, table_width), g.trash_block, dtype=np.int64)
        for b, seq in enumerate(seqs):
            history[b, : lens[b]] = seq.tokens(0, lens[b])
            tables[b, : len(seq.block_table)] = seq.block_table
        t_history = torch.from_numpy(history).to(device)
        t_lens = torch.tensor(lens, dtype=torch.long).to(device)
        t_tables = torch.from_numpy(tables).to(device)
        drafts = torch.empty(batch, k, dtype=torch.long, device=device)
        stride = -(-(width + 1) // 2) * 2  # an iteration's rows 16-byte aligned: one compiled kernel for all
        out = self.d_out[: steps * batch * stride].view(steps, batch * stride)
        graph = g.graphs[size]
        chosen = g.s_tokens[0, :rows]  # the graph's greedy choice of each row (s_step is 0 at each replay)
        for i in range(steps):
            draft_rows(t_history, t_lens, t_tables, drafts, g.s_vec, g.s_step, page, k, self.min_n, self.max_n)
            graph.replay()
            accept(chosen, drafts, t_history, t_lens, out[i].view(batch, stride))
        self.h_out[: out.numel()].copy_(out.view(-1), non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return DraftBurst(done, steps, batch, k)

    def read(self, burst: DraftBurst) -> list[list[list[int]]]:
        """Waits for a burst; the ids each sequence gained in each iteration, [iteration][sequence][ids]."""
        burst.done.synchronize()
        width = burst.k + 1
        stride = -(-(width + 1) // 2) * 2
        flat = self.h_out[: burst.steps * burst.num_seqs * stride].numpy()
        table = flat.reshape(burst.steps, burst.num_seqs, stride)
        return [[row[: row[width]].tolist() for row in iteration] for iteration in table]
