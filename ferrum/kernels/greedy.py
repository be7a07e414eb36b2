"""Greedy decode bursts on the device: each decode graph ends with the argmax of every row, written
where the next replay reads its input, with the row's position, context length and KV slot moved
one token on."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels.pdl import pdl_launch, pdl_mode, pdl_wait

ARGMAX_CHUNKS = 32


@triton.jit
def _argmax_chunks_kernel(LOGITS: tl.tensor, VALS: tl.tensor, IDX: tl.tensor, stride_l: tl.tensor,
                          V: tl.tensor, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                          PDL: tl.constexpr = 0) -> None:
    """Program (row, c): the largest logit of chunk c of the row, and its first index."""
    pdl_wait(PDL)
    row = tl.program_id(0)
    c = tl.program_id(1)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = tl.full([BLOCK], 2**30, tl.int32)
    for start in range(c * CHUNK, tl.minimum((c + 1) * CHUNK, V), BLOCK):
        i = start + tl.arange(0, BLOCK)
        x = tl.load(LOGITS + row * stride_l + i, mask=(i < V) & (i < (c + 1) * CHUNK), other=float("-inf"))
        better = x > best  # strictly: an earlier index keeps a tie
        best_i = tl.where(better, i, best_i)
        best = tl.where(better, x, best)
    top = tl.max(best, axis=0)
    top_i = tl.min(tl.where(best == top, best_i, 2**30), axis=0)
    tl.store(VALS + row * tl.num_programs(1) + c, top)
    tl.store(IDX + row * tl.num_programs(1) + c, top_i)


@triton.jit
def _advance_kernel(VALS: tl.tensor, IDX: tl.tensor, TOKENS: tl.tensor, STEP: tl.tensor, IDS: tl.tensor,
                    POS: tl.tensor, LENS: tl.tensor, SLOTS: tl.tensor, TABLES: tl.tensor, NREAL: tl.tensor,
                    rows: tl.tensor, stride_t: tl.tensor, stride_bt: tl.tensor, max_blocks: tl.tensor,
                    max_steps: tl.tensor, PAGE: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_R: tl.constexpr,
                    PDL: tl.constexpr = 0) -> None:
    """One program for the whole batch: each row's argmax over its chunks becomes TOKENS[step] and
    the next input; its position, context length and KV slot move one token on; step += 1. Rows
    from NREAL on (padding a graph's batch) stay where they are."""
    pdl_wait(PDL)
    r = tl.arange(0, BLOCK_R)
    rmask = (r < rows) & (r < tl.load(NREAL))
    c = tl.arange(0, CHUNKS)
    v = tl.load(VALS + r[:, None] * CHUNKS + c[None, :], mask=rmask[:, None], other=float("-inf"))
    i = tl.load(IDX + r[:, None] * CHUNKS + c[None, :], mask=rmask[:, None], other=2**30)
    top = tl.max(v, axis=1)
    chosen = tl.min(tl.where(v == top[:, None], i, 2**30), axis=1).to(tl.int64)
    step = tl.load(STEP)
    tl.store(TOKENS + step * stride_t + r, chosen, mask=rmask & (step < max_steps))  # replays past the rows: not kept
    tl.store(IDS + r, chosen, mask=rmask)
    pos = tl.load(POS + r, mask=rmask, other=0) + 1
    tl.store(POS + r, pos, mask=rmask)
    tl.store(LENS + r, tl.load(LENS + r, mask=rmask, other=0) + 1, mask=rmask)
    column = tl.minimum(pos // PAGE, max_blocks - 1)  # past the end only on a replay nobody reads
    block = tl.load(TABLES + r * stride_bt + column, mask=rmask, other=0).to(tl.int64)
    tl.store(SLOTS + r, block * PAGE + pos % PAGE, mask=rmask)
    tl.store(STEP, step + 1)


def greedy_advance(logits: torch.Tensor, tokens: torch.Tensor, step: torch.Tensor, ids: torch.Tensor,
                   positions: torch.Tensor, lens: torch.Tensor, slots: torch.Tensor, tables: torch.Tensor,
                   page: int, num_real: torch.Tensor, pdl: bool = False) -> None:
    """After a decode step's logits [B, V], for the first num_real rows: tokens[step] = ids = argmax
    (first index on ties, as torch.argmax); positions and lens += 1; slots = the KV slot of the new
    position. Then step += 1. ids, positions, slots and lens are int64 [B], tables int32
    [B, max_blocks], step and num_real int64 [1]."""
    rows, vocab = logits.shape
    chunk = triton.cdiv(vocab, ARGMAX_CHUNKS)
    vals = torch.empty(rows, ARGMAX_CHUNKS, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, ARGMAX_CHUNKS, dtype=torch.int32, device=logits.device)
    _argmax_chunks_kernel[(rows, ARGMAX_CHUNKS)](logits, vals, idx, logits.stride(0), vocab, CHUNK=chunk,
                                                  BLOCK=1024, PDL=pdl_mode(pdl), num_warps=4, **pdl_launch(pdl))
    _advance_kernel[(1,)](vals, idx, tokens, step, ids, positions, lens, slots, tables, num_real, rows,
                          tokens.stride(0), tables.stride(0), tables.shape[1], tokens.shape[0], PAGE=page,
                          CHUNKS=ARGMAX_CHUNKS, BLOCK_R=max(2, triton.next_power_of_2(rows)), PDL=pdl_mode(pdl),
                          num_warps=4, **pdl_launch(pdl))
