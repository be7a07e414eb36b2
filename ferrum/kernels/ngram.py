"""Drafted bursts on the device (ferrum.engine.draft_bursts): prompt lookup and greedy acceptance as two
kernels, one program per sequence, so that an iteration is these two launches around a decode graph's replay.

    draft_rows  the tokens after the most recent earlier occurrence of the longest suffix n-gram of the
                sequence's tokens (n from max_n down to min_n, NgramProposer's rule), k of them, the positions
                past its tokens or with no occurrence filled with its last token; then the graph's inputs for
                its k + 1 rows: ids (the last token, then the draft), positions, KV slots, context lengths
    accept      the leading draft tokens equal to the rows' greedy choices are kept; the choices are appended
                to the sequence's tokens (those past the kept ones and the one after them are overwritten by
                the next iteration), its length moves on by the kept ones plus one, and the iteration's
                choices and count are written out for the host
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["stride_h", "stride_t", "page", "min_n"])  # one compilation for every burst
def _draft_rows_kernel(HIST: tl.tensor, LENS: tl.tensor, TABLES: tl.tensor, DRAFTS: tl.tensor, VEC: tl.tensor,
                       STEP: tl.tensor, stride_h: tl.tensor, stride_t: tl.tensor, stride_v: tl.tensor,
                       page: tl.tensor, min_n: tl.tensor, K: tl.constexpr, KP: tl.constexpr, MAXN: tl.constexpr,
                       BLOCK: tl.constexpr) -> None:
    b = tl.program_id(0)
    h = HIST + b * stride_h
    n = tl.load(LENS + b)
    best = tl.full([], -1, tl.int64)
    for start in range(0, n - 1, BLOCK):  # occurrences end before the last token: one token at least follows
        e = start + tl.arange(0, BLOCK).to(tl.int64)
        alive = e < n - 1
        run = tl.zeros([BLOCK], tl.int64)
        for u in tl.static_range(MAXN):  # tokens in common, counted back from e and from the last token
            ok = alive & (e >= u)
            token = tl.load(h + e - u, mask=ok, other=-1)
            alive = ok & (token == tl.load(h + tl.maximum(n - 1 - u, 0)))
            run += alive.to(tl.int64)
        key = tl.where(run >= min_n, run * 1099511627776 + e, -1)  # 2^40: by length, then the most recent
        best = tl.maximum(best, tl.max(key, axis=0))
    first = tl.where(best >= 0, best % 1099511627776 + 1, n)
    j = tl.arange(0, KP).to(tl.int64)
    rows = j <= K
    last = tl.load(h + n - 1)
    at = first + j - 1  # row j > 0 holds draft token j - 1
    inside = (j >= 1) & rows & (at < n)
    token = tl.where(inside, tl.load(h + at, mask=inside, other=0), last)
    tl.store(DRAFTS + b * K + j - 1, token, mask=(j >= 1) & rows)
    row = b * (K + 1) + j
    position = n - 1 + j
    block = tl.load(TABLES + b * stride_t + position // page, mask=rows, other=0)
    tl.store(VEC + row, token, mask=rows)
    tl.store(VEC + stride_v + row, position, mask=rows)
    tl.store(VEC + 2 * stride_v + row, block * page + position % page, mask=rows)
    tl.store(VEC + 3 * stride_v + row, position + 1, mask=rows)
    if b == 0:
        tl.store(STEP, 0)


@triton.jit(do_not_specialize=["stride_h", "stride_o"])
def _accept_kernel(CHOSEN: tl.tensor, DRAFTS: tl.tensor, HIST: tl.tensor, LENS: tl.tensor, OUT: tl.tensor,
                   stride_h: tl.tensor, stride_o: tl.tensor, K: tl.constexpr, KP: tl.constexpr) -> None:
    b = tl.program_id(0)
    j = tl.arange(0, KP).to(tl.int64)
    rows = j <= K
    chosen = tl.load(CHOSEN + b * (K + 1) + j, mask=rows, other=-1)
    drafted = tl.load(DRAFTS + b * K + j, mask=j < K, other=-2)
    kept = tl.min(tl.where((drafted == chosen) & (j < K), K, j), axis=0)  # the first refused position
    n = tl.load(LENS + b)
    tl.store(HIST + b * stride_h + n + j, chosen, mask=rows)
    tl.store(OUT + b * stride_o + j, chosen, mask=rows)
    tl.store(OUT + b * stride_o + K + 1, kept + 1)
    tl.store(LENS + b, n + kept + 1)


def draft_rows(history: torch.Tensor, lens: torch.Tensor, tables: torch.Tensor, drafts: torch.Tensor,
               vec: torch.Tensor, step: torch.Tensor, page: int, k: int, min_n: int, max_n: int) -> None:
    """history [B, W] int64 (each row's first lens[b] tokens real, room past them for k + 1 more), lens [B]
    int64, tables [B, T] int64 block tables; writes drafts [B, k] and, for row b * (k + 1) + j, vec[0] (ids),
    vec[1] (positions), vec[2] (KV slots), vec[3] (context lengths) of a decode graph's inputs [4, rows+];
    step [1] = 0."""
    batch = history.shape[0]
    _draft_rows_kernel[(batch,)](history, lens, tables, drafts, vec, step, history.stride(0), tables.stride(0),
                                 vec.stride(0), page, min_n, K=k, KP=triton.next_power_of_2(k + 1), MAXN=max_n,
                                 BLOCK=512)


def accept(chosen: torch.Tensor, drafts: torch.Tensor, history: torch.Tensor, lens: torch.Tensor,
           out: torch.Tensor) -> None:
    """chosen [B * (k + 1)] int64, each row's greedy choice; drafts [B, k]: out [B, >= k + 2] gets each
    sequence's k + 1 choices and how many of them it gains (the kept drafts, plus one); history and lens move
    on."""
    batch, k = drafts.shape
    _accept_kernel[(batch,)](chosen, drafts, history, lens, out, history.stride(0), out.stride(0), K=k,
                             KP=triton.next_power_of_2(k + 1))
