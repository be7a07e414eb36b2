"""Attention over the paged KV cache.

The cache of one layer is two tensors [num_slots, num_kv_heads, head_dim]; a token at position p
of a sequence lives in slot block_table[p // page] * page + p % page (ferrum.models.attention.layout).
An fp8 cache's values are read as they lie and widened in registers to float16, which holds every e4m3
value and which the hardware converts to two values an instruction (bfloat16 takes three instructions a
value); q and the softmax's weights go to float16 for the two dot products (bf16's q exactly, in range),
the k scale joins the softmax's scale and the v scale multiplies the output once (ferrum.kernels.kv_fp8).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ferrum.kernels.kv_fp8 import cache_scale, cache_value, scales_arg
from ferrum.kernels.pdl import pdl_launch, pdl_mode, pdl_wait


@triton.jit
def _attend_pages(q: tl.tensor, KC: tl.tensor, VC: tl.tensor, table: tl.tensor, begin: tl.tensor,
                  end: tl.tensor, kvh: tl.tensor, stride_kc: tl.tensor, stride_kh: tl.tensor,
                  qk_scale: tl.tensor, qpos: tl.tensor, window: tl.tensor,
                  ROWS: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr, PRECISION: tl.constexpr) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """Online-softmax attention of q [ROWS, D] over one sequence's cached keys begin .. end-1 (`table`
    points at its block-table row; with CAUSAL, row i sees keys up to position qpos[i], and with a
    window > 0 only the last `window` of them). Returns the running max and sum (base 2) and the
    unnormalised output."""
    m = tl.full([ROWS], float("-inf"), tl.float32)
    sums = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    for start in range(begin, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = n < end
        off = _kv_offsets(table, n, valid, kvh, stride_kc, stride_kh, D, PAGE)
        k = tl.load(KC + off, mask=valid[:, None], other=0.0)
        keep = valid[None, :]
        if CAUSAL:
            keep = keep & (n[None, :] <= qpos[:, None]) & ((window == 0) | (n[None, :] > qpos[:, None] - window))
        m, sums, acc = _softmax_step(q, k, VC + off, valid, keep, m, sums, acc, qk_scale, PRECISION)
    return m, sums, acc


@triton.jit
def _kv_offsets(table: tl.tensor, n: tl.tensor, valid: tl.tensor, kvh: tl.tensor, stride_kc: tl.tensor,
                stride_kh: tl.tensor, D: tl.constexpr, PAGE: tl.constexpr) -> tl.tensor:
    """Offsets of the k (or v) rows of cache positions n [BLOCK_N] in one kv head: [BLOCK_N, D]."""
    page = tl.load(table + n // PAGE, mask=valid, other=0)
    slot = page.to(tl.int64) * PAGE + n % PAGE
    return slot[:, None] * stride_kc + kvh * stride_kh + tl.arange(0, D)[None, :]


@triton.jit
def _softmax_step(q: tl.tensor, k: tl.tensor, v: tl.tensor, valid: tl.tensor, keep: tl.tensor, m: tl.tensor,
                  sums: tl.tensor, acc: tl.tensor, qk_scale: tl.tensor,
                  PRECISION: tl.constexpr) -> tuple[tl.tensor, tl.tensor, tl.tensor]:
    """One block of keys k [BLOCK_N, D] into the running max m, sums and output acc of q's rows
    (v: the block's values, or pointers to load them from, masked by valid; keep: which scores
    count). A block where a row keeps nothing leaves that row as it was. k and v (an fp8 cache's too)
    are widened to q's dtype (float16 over an fp8 cache)."""
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=PRECISION) * qk_scale
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing kept yet: no -inf - -inf
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    sums = sums * alpha + tl.sum(p, axis=1)
    if v.dtype.is_ptr():
        v = tl.load(v, mask=valid[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=PRECISION)
    return m_new, sums, acc


@triton.jit
def _roped(ROWS: tl.tensor, mask: tl.tensor, d: tl.tensor, pos: tl.tensor, COS: tl.tensor, SIN: tl.tensor,
           stride_cs: tl.tensor, NW: tl.tensor, eps: tl.tensor, ty: tl.constexpr, D: tl.constexpr,
           QK_NORM: tl.constexpr) -> tl.tensor:
    """The heads whose rows start at ROWS ([R, 1] pointers; `mask` [R, 1]), RMS-normed per head (QK_NORM,
    weight NW) and rotated at position `pos`, [R, D] in dtype `ty`: rounded as ferrum.kernels.rope's
    _rotated, each dim with its partner (d + D/2 mod D) loaded alongside."""
    half: tl.constexpr = D // 2
    partner = (d + half) % D
    x = tl.load(ROWS + d[None, :], mask=mask, other=0.0).to(tl.float32)
    xp = tl.load(ROWS + partner[None, :], mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        rstd = (1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps))[:, None]
        x = ((x * rstd).to(ty).to(tl.float32) * tl.load(NW + d).to(tl.float32)[None, :]).to(ty).to(tl.float32)
        xp = ((xp * rstd).to(ty).to(tl.float32) * tl.load(NW + partner).to(tl.float32)[None, :]).to(ty).to(tl.float32)
    c = tl.load(COS + pos * stride_cs + d % half).to(ty).to(tl.float32)[None, :]
    s = tl.load(SIN + pos * stride_cs + d % half).to(ty).to(tl.float32)[None, :]
    sign = tl.where(d < half, -1.0, 1.0)[None, :]
    return (x * c + sign * (xp * s)).to(ty)


# The block-table width changes from step to step: no specialising on it (a fresh compile mid-serving)
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(Q: tl.tensor, KC: tl.tensor, VC: tl.tensor, KVS: tl.tensor, OUT: tl.tensor, PART_ACC: tl.tensor,
                   PART_ML: tl.tensor, TABLES: tl.tensor, LENS: tl.tensor, scale: tl.tensor, window: tl.tensor,
                   step_keys: tl.tensor, stride_qt: tl.tensor, stride_qh: tl.tensor, stride_kc: tl.tensor,
                   stride_kh: tl.tensor, stride_bt: tl.tensor, stride_ot: tl.tensor, stride_oh: tl.tensor,
                   G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr,
                   PDL: tl.constexpr = 0, POS: tl.tensor = None, COS: tl.tensor = None, SIN: tl.tensor = None,
                   SLOTS: tl.tensor = None, QNW: tl.tensor = None, KNW: tl.tensor = None, eps: tl.tensor = 0.0,
                   stride_cs: tl.tensor = 0, ROPE: tl.constexpr = False, QK_NORM: tl.constexpr = False) -> None:
    """One program per (sequence, kv head, split): its G query heads against one slice of the
    sequence's cache (of its last `window` keys where window > 0). With one split the result is final;
    with several, each writes its partial (running max, sum, unnormalised output) for
    _decode_reduce_kernel to combine. (Combining them in the last program to finish, counted with an
    atomic, measured slower on an H100: 6.7 vs 4.5 us for a 512-token context at batch 1,
    scripts/gemv_bench.py.)

    With PDL, the lengths, block tables and the k/v of every key but a row's last `step_keys` are read
    before the wait: the kernels before this one write only this step's keys and q, and a step's rows
    write at most `step_keys` (the call's rows) keys of any one sequence (one in a decode; a prompt chunk's
    or a draft's rows write theirs, which later rows of the chunk read: DecodeGraphs.run_rows, verify
    steps). The lengths and tables come from before the step (host copies, or the last step's
    _advance_kernel, which a plain kernel at the start of each step waits for).

    ROPE: Q is the step's q/k/v projection [B, (H + 2 KV) D], not yet rotated, each row one decode of its
    own sequence (step_keys 1): every program norms (QK_NORM) and rotates its q heads itself, and the
    program whose slice holds the row's new key (position length - 1) rotates its k head, writes k and v
    into the row's slot and reads them back from there as any other key (after a barrier: the block's
    own writes). That is the rope kernel (ferrum.kernels.rope) folded into this one."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(LENS + b)
    first = tl.where(window > 0, tl.maximum(length - window, 0), 0)  # the first key the query sees
    part = tl.cdiv(tl.cdiv(length - first, SPLITS), BLOCK_N) * BLOCK_N
    begin = first + split * part
    end = tl.minimum(begin + part, length)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    gmask = g < G
    table = TABLES + b * stride_bt
    n = begin + tl.arange(0, BLOCK_N)  # the first block of keys
    valid = n < end
    off = _kv_offsets(table, n, valid, kvh, stride_kc, stride_kh, D, PAGE)
    if PDL > 0 or ROPE:
        new = n >= length - step_keys  # keys this step may have written: read once the kernels before are done
        old = (valid & ~new)[:, None]
        k = tl.load(KC + off, mask=old, other=0.0)
        v = tl.load(VC + off, mask=old, other=0.0)
        pdl_wait(PDL)
        if ROPE:
            last = length - 1
            if (begin <= last) & (last < end):  # this program's slice holds the row's new key: write it
                num_heads = tl.num_programs(1) * G
                row = Q + b * stride_qt
                kr = _roped(row + (num_heads + kvh) * D, tl.full([1, 1], 1, tl.int1), d, tl.load(POS + b), COS,
                            SIN, stride_cs, KNW, eps, Q.dtype.element_ty, D, QK_NORM)
                slot = tl.load(SLOTS + b).to(tl.int64) * stride_kc + kvh * stride_kh + d[None, :]
                tl.store(KC + slot, cache_value(kr, KC, KVS, 0))
                vr = tl.load(row + (num_heads + tl.num_programs(1) + kvh) * D + d[None, :])
                tl.store(VC + slot, cache_value(vr, VC, KVS, 1))
                tl.debug_barrier()  # the block's writes above visible to all its threads' loads below
        now = (valid & new)[:, None]
        k = tl.where(now, tl.load(KC + off, mask=now, other=0.0), k)
        v = tl.where(now, tl.load(VC + off, mask=now, other=0.0), v)
    else:
        k = tl.load(KC + off, mask=valid[:, None], other=0.0)
        v = tl.load(VC + off, mask=valid[:, None], other=0.0)
    q_rows = Q + b * stride_qt + (kvh * G + g)[:, None] * stride_qh
    if ROPE:
        q = _roped(q_rows, gmask[:, None], d, tl.load(POS + b), COS, SIN, stride_cs, QNW, eps, Q.dtype.element_ty, D,
                   QK_NORM)
    else:
        q = tl.load(q_rows + d[None, :], mask=gmask[:, None], other=0.0)
    if KC.dtype.element_ty == tl.float8e4nv:  # the dot products in float16 (the module's docstring)
        q = q.to(tl.float16)
    qk_scale = scale * 1.4426950408889634 * cache_scale(KC, KVS, 0)
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    sums = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    m, sums, acc = _softmax_step(q, k, v, valid, valid[None, :], m, sums, acc, qk_scale, PRECISION)
    for start in range(begin + BLOCK_N, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = n < end
        off = _kv_offsets(table, n, valid, kvh, stride_kc, stride_kh, D, PAGE)
        k = tl.load(KC + off, mask=valid[:, None], other=0.0)
        m, sums, acc = _softmax_step(q, k, VC + off, valid, valid[None, :], m, sums, acc, qk_scale, PRECISION)
    heads = kvh * G + g
    acc = acc * cache_scale(VC, KVS, 1)
    if SPLITS == 1:
        out = acc / sums[:, None]
        tl.store(OUT + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=gmask[:, None])
    else:
        num_heads = tl.num_programs(1) * G
        row = (b * num_heads + heads) * SPLITS + split  # [B, H, SPLITS] partials
        tl.store(PART_ACC + row[:, None] * D + d[None, :], acc, mask=gmask[:, None])
        tl.store(PART_ML + row * 2, m, mask=gmask)
        tl.store(PART_ML + row * 2 + 1, sums, mask=gmask)


@triton.jit
def _decode_reduce_kernel(PART_ACC: tl.tensor, PART_ML: tl.tensor, OUT: tl.tensor, stride_ot: tl.tensor,
                          stride_oh: tl.tensor, D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                          PDL: tl.constexpr = 0) -> None:
    pdl_wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    num_heads = tl.num_programs(1)
    sp = tl.arange(0, BLOCK_S)
    smask = sp < SPLITS
    row = (b * num_heads + h) * SPLITS + sp
    m = tl.load(PART_ML + row * 2, mask=smask, other=float("-inf"))
    sums = tl.load(PART_ML + row * 2 + 1, mask=smask, other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.where(smask & (sums > 0), tl.exp2(m - m_all), 0.0)  # empty splits (m = -inf) weigh nothing
    d = tl.arange(0, D)
    acc = tl.load(PART_ACC + row[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(sums * w, axis=0)
    tl.store(OUT + b * stride_ot + h * stride_oh + d, out.to(OUT.dtype.element_ty))


def _dot_precision(q: torch.Tensor) -> str:
    """float32 models get float32 dot products (Triton's default for them is tf32)."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def decode_splits(batch: int, kv_heads: int, num_sms: int, max_splits: int = 32) -> int:
    """Splits of each sequence's cache so that small and middling batches still fill the GPU (about
    four programs per multiprocessor: each program's loop over its slice is latency-bound); large
    batches need none. At most `max_splits` (KernelConfig.max_decode_splits; 32 by default: at
    batch 1 on an H100 the 1B decode graph with 32 splits ran 4-6 us faster than with 16 in two A/B
    runs of 1.07 ms, level in a third)."""
    return max(1, min(max_splits, -(-4 * num_sms // (batch * kv_heads))))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, page: int, scale: float, splits: int = 1,
                 out: torch.Tensor | None = None, block_n: int = 64, num_warps: int = 4,
                 pdl: bool = False, kv_scale: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """q: [B, H, D], one query token per sequence; context_lens[b] >= 1 tokens in the cache;
    block_n: cache tokens per step of each program's loop; kv_scale: an fp8 cache's k and v scales;
    window: the layer's sliding window (the query sees its last `window` keys), None for all."""
    out = torch.empty_like(q) if out is None else out
    _decode(q, q.shape[1], k_cache, v_cache, block_tables, context_lens, page, scale, splits, out, block_n,
            num_warps, pdl, kv_scale, window, q.shape[0], {})
    return out


def paged_decode_rope(qkv: torch.Tensor, num_heads: int, positions: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor, slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, context_lens: torch.Tensor, page: int, scale: float,
                      splits: int = 1, q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                      eps: float = 1e-6, block_n: int = 64, num_warps: int = 4, pdl: bool = False,
                      kv_scale: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """Decode attention straight from the q/k/v projection qkv [B, (H + 2 KV) D], each row the one new token
    of its own sequence (at positions[b] = context_lens[b] - 1, its k and v going to slot slots[b]): q and k
    normed per head (q_norm, k_norm: Qwen3) and rotated, k and v written into the cache, then attention as
    paged_decode: the rope kernel (ferrum.kernels.rope.rope_and_store) folded in (_decode_kernel's ROPE).
    Not for rows of which several belong to one sequence (a row would not see the others' keys).
    Returns the output [B, H, D]."""
    batch = qkv.shape[0]
    dim = k_cache.shape[2]
    assert qkv.stride(1) == 1 and qkv.shape[1] == (num_heads + 2 * k_cache.shape[1]) * dim
    assert (q_norm is None) == (k_norm is None)
    out = torch.empty(batch, num_heads, dim, dtype=qkv.dtype, device=qkv.device)
    rope = {"POS": positions, "COS": cos, "SIN": sin, "SLOTS": slots,
            "QNW": q_norm if q_norm is not None else qkv, "KNW": k_norm if k_norm is not None else qkv,
            "eps": eps, "stride_cs": cos.stride(0), "ROPE": True, "QK_NORM": q_norm is not None}
    _decode(qkv, num_heads, k_cache, v_cache, block_tables, context_lens, page, scale, splits, out, block_n,
            num_warps, pdl, kv_scale, window, 1, rope, stride_qh=dim)
    return out


def _decode(q: torch.Tensor, heads: int, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
            context_lens: torch.Tensor, page: int, scale: float, splits: int, out: torch.Tensor, block_n: int,
            num_warps: int, pdl: bool, kv_scale: torch.Tensor | None, window: int | None, step_keys: int,
            rope: dict[str, object], stride_qh: int | None = None) -> None:
    """Launches _decode_kernel (and with splits, _decode_reduce_kernel) into `out` [B, H, D]."""
    batch, dim = out.shape[0], out.shape[2]
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    part_acc = part_ml = out
    if splits > 1:
        part_acc = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(batch, heads, splits, 2, dtype=torch.float32, device=q.device)
    _decode_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, scales_arg(kv_scale, k_cache), out, part_acc, part_ml, block_tables, context_lens, scale,
        window or 0, step_keys, q.stride(0), q.stride(1) if stride_qh is None else stride_qh, k_cache.stride(0),
        k_cache.stride(1), block_tables.stride(0), out.stride(0), out.stride(1),
        G=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=dim, PAGE=page, BLOCK_N=block_n, SPLITS=splits,
        PRECISION=_dot_precision(out), PDL=pdl_mode(pdl), num_warps=num_warps, num_stages=2, **rope,
        **pdl_launch(pdl),
    )
    if splits > 1:
        _decode_reduce_kernel[(batch, heads)](
            part_acc, part_ml, out, out.stride(0), out.stride(1),
            D=dim, SPLITS=splits, BLOCK_S=max(2, triton.next_power_of_2(splits)), PDL=pdl_mode(pdl), num_warps=1,
            **pdl_launch(pdl),
        )


@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(Q: tl.tensor, KC: tl.tensor, VC: tl.tensor, KVS: tl.tensor, OUT: tl.tensor, TABLES: tl.tensor,
                    TILE_SEQ: tl.tensor, TILE_M: tl.tensor, Q_START: tl.tensor, Q_LEN: tl.tensor,
                    PAST: tl.tensor, scale: tl.tensor, window: tl.tensor, stride_qt: tl.tensor, stride_qh: tl.tensor,
                    stride_kc: tl.tensor, stride_kh: tl.tensor, stride_bt: tl.tensor, stride_ot: tl.tensor,
                    stride_oh: tl.tensor,
                    G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr) -> None:
    """One program per (tile of BLOCK_M new tokens of one sequence, query head). Query i of a
    sequence sits at position past + i and sees the cached keys 0 .. past + i (its own included), or
    with a window > 0 the last `window` of them."""
    tile = tl.program_id(0)
    h = tl.program_id(1)
    kvh = h // G
    s_idx = tl.load(TILE_SEQ + tile)
    m0 = tl.load(TILE_M + tile)
    q_start = tl.load(Q_START + s_idx)
    q_len = tl.load(Q_LEN + s_idx)
    past = tl.load(PAST + s_idx)
    rows = m0 + tl.arange(0, BLOCK_M)
    rmask = rows < q_len
    d = tl.arange(0, D)
    q = tl.load(Q + (q_start + rows)[:, None] * stride_qt + h * stride_qh + d[None, :], mask=rmask[:, None], other=0.0)
    if KC.dtype.element_ty == tl.float8e4nv:  # the dot products in float16 (the module's docstring)
        q = q.to(tl.float16)
    end = past + tl.minimum(m0 + BLOCK_M, q_len)
    begin = tl.where(window > 0, tl.maximum(past + m0 - window + 1, 0), 0)  # the first key the tile's first row sees
    m, sums, acc = _attend_pages(q, KC, VC, TABLES + s_idx * stride_bt, begin, end, kvh, stride_kc, stride_kh,
                                 scale * 1.4426950408889634 * cache_scale(KC, KVS, 0), past + rows, window, BLOCK_M, D,
                                 PAGE, BLOCK_N, True, PRECISION)
    out = acc * cache_scale(VC, KVS, 1) / sums[:, None]
    tl.store(OUT + (q_start + rows)[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(OUT.dtype.element_ty), mask=rmask[:, None])


PREFILL_BLOCK_M = 64


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  tile_seq: torch.Tensor, tile_m: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor,
                  past: torch.Tensor, page: int, scale: float, out: torch.Tensor | None = None,
                  kv_scale: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
    """q: [T, H, D] packed new tokens of several sequences (their k/v already in the cache).
    Tiles (tile_seq, tile_m) cover each sequence's new tokens in steps of PREFILL_BLOCK_M; only the
    rows of tiled sequences are written; window: the layer's sliding window, None for all keys."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    out = torch.empty_like(q) if out is None else out
    _prefill_kernel[(tile_seq.shape[0], heads)](
        q, k_cache, v_cache, scales_arg(kv_scale, k_cache), out, block_tables, tile_seq, tile_m, q_start, q_len, past,
        scale, window or 0,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        G=heads // kv_heads, D=dim, PAGE=page, BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=64,
        PRECISION=_dot_precision(q), num_warps=4, num_stages=2,
    )
    return out
