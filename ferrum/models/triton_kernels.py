"""Triton kernels for the GPU path: fused norms, rope + KV-cache write, paged attention.

Imported only where tensors live on a GPU (or under TRITON_INTERPRET=1 in tests).
Numerics follow HF transformers' bf16 order of operations: reductions in float32,
results rounded to the activation dtype where HF rounds them.

The KV cache of one layer is two tensors [num_slots, num_kv_heads, head_dim]; a
token at position p of a sequence lives in slot block_table[p // page] * page + p % page.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

LOG2E = 1.4426950408889634


# -- programmatic dependent launch --------------------------------------------------------------

# On Hopper and later, each kernel of a decode step is launched while the one before it still runs
# (programmatic dependent launch): it issues the loads that do not depend on that kernel (its
# weights), then waits for it (griddepcontrol.wait: the earlier kernel complete, its writes
# visible) before reading or writing anything else. The launch latency and the first weight loads
# hide behind the previous kernel's tail. Mode 1 lets the next kernel launch once every program of
# this one has issued those loads, mode 2 once every program is past its wait; 0 turns it off.
def _pdl_setting() -> int:
    value = os.environ.get("FERRUM_PDL", "1").strip()
    if value not in ("0", "1", "2"):
        raise ValueError(f"FERRUM_PDL must be 0 (off), 1 or 2, not {value!r}")
    return int(value)


PDL_MODE = _pdl_setting()


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def pdl_mode(t: torch.Tensor) -> int:
    """The PDL mode for kernels on t's device: PDL_MODE on a CUDA device of compute capability 9.0
    or later, else 0."""
    if PDL_MODE == 0 or t.device.type != "cuda":
        return 0
    return PDL_MODE if _capability(t.device.index or 0) >= (9, 0) else 0


def pdl_launch(mode: int) -> dict:
    """Extra launch arguments for a kernel that calls pdl_wait(mode)."""
    return {"launch_pdl": True} if mode else {}


@triton.jit
def pdl_wait(PDL: tl.constexpr):
    """Called once by every program of a kernel launched with pdl_launch(PDL), after the loads that
    do not depend on the kernel before and before anything that does."""
    if PDL == 1:
        gdc_launch_dependents()
    if PDL > 0:
        gdc_wait()
    if PDL == 2:
        gdc_launch_dependents()


# -- norms and activations ----------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(X, R, W, OUT, ROUT, stride_x, stride_r, stride_o, stride_ro, n, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = (x.to(tl.float32) + tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32))
        x = x.to(OUT.dtype.element_ty)  # HF adds residuals in the activation dtype
        tl.store(ROUT + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
    normed = (xf * rstd).to(OUT.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (w * normed).to(OUT.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """RMSNorm of x (or of x + residual, which is also returned as the new residual)."""
    rows, n = x.shape
    out = torch.empty_like(x)
    rout = torch.empty_like(x) if residual is not None else None
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(rows,)](
        x, residual if residual is not None else x, weight, out, rout if rout is not None else out,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
        rout.stride(0) if rout is not None else 0, n, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=8 if block >= 4096 else 4,
    )
    return out, rout


@triton.jit
def _silu_and_mul_kernel(X, OUT, stride_x, stride_o, n, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(X + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(OUT.dtype.element_ty).to(tl.float32)
    tl.store(OUT + row * stride_o + cols, (act * u).to(OUT.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2 * n] (gate then up) -> silu(gate) * up: [T, n]."""
    rows, n2 = x.shape
    n = n2 // 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block = 1024
    _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](x, out, x.stride(0), out.stride(0), n, BLOCK=block)
    return out


# -- rope and the KV-cache write ------------------------------------------------------------


@triton.jit
def _rope_store_kernel(QKV, POS, COS, SIN, SLOTS, QOUT, KC, VC, QNW, KNW,
                       stride_t, stride_qt, stride_qh, stride_cs, stride_kc, stride_kh, eps,
                       H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, QK_NORM: tl.constexpr,
                       PDL: tl.constexpr = 0):
    pdl_wait(PDL)
    t = tl.program_id(0)
    head = tl.program_id(1)  # 0..H-1 q heads, H..H+KV-1 k heads, then v heads
    half = tl.arange(0, D // 2)
    base = QKV + t * stride_t + head * D
    slot = tl.load(SLOTS + t)
    if head >= H + KV:  # v: copied into the cache as it is
        kvh = head - H - KV
        dst = VC + slot * stride_kc + kvh * stride_kh
        tl.store(dst + half, tl.load(base + half))
        tl.store(dst + D // 2 + half, tl.load(base + D // 2 + half))
    else:
        x1 = tl.load(base + half).to(tl.float32)
        x2 = tl.load(base + D // 2 + half).to(tl.float32)
        if QK_NORM:  # Qwen3: per-head RMSNorm before the rotation
            rstd = 1.0 / tl.sqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / D + eps)
            nw = QNW if head < H else KNW
            x1 = (x1 * rstd).to(QOUT.dtype.element_ty).to(tl.float32) * tl.load(nw + half).to(tl.float32)
            x2 = (x2 * rstd).to(QOUT.dtype.element_ty).to(tl.float32) * tl.load(nw + D // 2 + half).to(tl.float32)
            x1 = x1.to(QOUT.dtype.element_ty).to(tl.float32)
            x2 = x2.to(QOUT.dtype.element_ty).to(tl.float32)
        pos = tl.load(POS + t)
        c = tl.load(COS + pos * stride_cs + half).to(QOUT.dtype.element_ty).to(tl.float32)
        s = tl.load(SIN + pos * stride_cs + half).to(QOUT.dtype.element_ty).to(tl.float32)
        y1 = (x1 * c - x2 * s).to(QOUT.dtype.element_ty)
        y2 = (x2 * c + x1 * s).to(QOUT.dtype.element_ty)
        if head < H:
            dst = QOUT + t * stride_qt + head * stride_qh
        else:
            dst = KC + slot * stride_kc + (head - H) * stride_kh
        tl.store(dst + half, y1)
        tl.store(dst + D // 2 + half, y2)


def rope_and_store(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   num_heads: int, num_kv_heads: int, head_dim: int,
                   q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None,
                   eps: float = 1e-6) -> torch.Tensor:
    """qkv: [T, (H + 2 KV) * D]. Rotates q and k (after a per-head norm when given), writes k and v
    into their cache slots, returns q: [T, H, D]."""
    tokens = qkv.shape[0]
    q = torch.empty(tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    pdl = pdl_mode(qkv)
    _rope_store_kernel[(tokens, num_heads + 2 * num_kv_heads)](
        qkv, positions, cos, sin, slots, q, k_cache, v_cache,
        q_norm if q_norm is not None else qkv, k_norm if k_norm is not None else qkv,
        qkv.stride(0), q.stride(0), q.stride(1), cos.stride(0), k_cache.stride(0), k_cache.stride(1), eps,
        H=num_heads, KV=num_kv_heads, D=head_dim, QK_NORM=q_norm is not None, PDL=pdl, num_warps=1, **pdl_launch(pdl),
    )
    return q


# -- paged attention ------------------------------------------------------------------------


@triton.jit
def _attend_pages(q, KC, VC, table, begin, end, kvh, stride_kc, stride_kh, qk_scale, qpos,
                  ROWS: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """Online-softmax attention of q [ROWS, D] over one sequence's cached keys begin .. end-1 (`table`
    points at its block-table row; with CAUSAL, row i sees keys up to position qpos[i]). Returns the
    running max and sum (base 2) and the unnormalised output."""
    m = tl.full([ROWS], float("-inf"), tl.float32)
    l = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, D], tl.float32)
    for start in range(begin, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = n < end
        off = _kv_offsets(table, n, valid, kvh, stride_kc, stride_kh, D, PAGE)
        k = tl.load(KC + off, mask=valid[:, None], other=0.0)
        keep = valid[None, :]
        if CAUSAL:
            keep = keep & (n[None, :] <= qpos[:, None])
        m, l, acc = _softmax_step(q, k, VC + off, valid, keep, m, l, acc, qk_scale, PRECISION)
    return m, l, acc


@triton.jit
def _kv_offsets(table, n, valid, kvh, stride_kc, stride_kh, D: tl.constexpr, PAGE: tl.constexpr):
    """Offsets of the k (or v) rows of cache positions n [BLOCK_N] in one kv head: [BLOCK_N, D]."""
    page = tl.load(table + n // PAGE, mask=valid, other=0)
    slot = page.to(tl.int64) * PAGE + n % PAGE
    return slot[:, None] * stride_kc + kvh * stride_kh + tl.arange(0, D)[None, :]


@triton.jit
def _softmax_step(q, k, v, valid, keep, m, l, acc, qk_scale, PRECISION: tl.constexpr):
    """One block of keys k [BLOCK_N, D] into the running max m, sum l and output acc of q's rows
    (v: the block's values, or pointers to load them from, masked by valid; keep: which scores
    count). A block where a row keeps nothing leaves that row as it was."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing kept yet: no -inf - -inf
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m - m_safe)
    l = l * alpha + tl.sum(p, axis=1)
    if v.dtype.is_ptr():
        v = tl.load(v, mask=valid[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l, acc


# The block-table width changes from step to step: no specialising on it (a fresh compile mid-serving)
@triton.jit(do_not_specialize=["stride_bt"])
def _decode_kernel(Q, KC, VC, OUT, PART_ACC, PART_ML, TABLES, LENS, scale,
                   stride_qt, stride_qh, stride_kc, stride_kh, stride_bt, stride_ot, stride_oh,
                   G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                   BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr = 0):
    """One program per (sequence, kv head, split): its G query heads against one slice of the
    sequence's cache. With one split the result is final; with several, each writes its partial
    (running max, sum, unnormalised output) for _decode_reduce_kernel to combine. (Combining them
    in the last program to finish, counted with an atomic, measured slower on an H100: 6.7 vs 4.5 us
    for a 512-token context at batch 1, scripts/gemv_bench.py.)

    With PDL, the lengths, block tables and the k/v of every token but the newest are read before
    the wait: in a decode step only the kernels before this one write the newest token's k/v and
    q; the lengths and tables come from before the step (host copies, or the last step's
    _advance_kernel, which a plain kernel at the start of each step waits for)."""
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(LENS + b)
    part = tl.cdiv(tl.cdiv(length, SPLITS), BLOCK_N) * BLOCK_N
    begin = split * part
    end = tl.minimum(begin + part, length)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, D)
    gmask = g < G
    table = TABLES + b * stride_bt
    n = begin + tl.arange(0, BLOCK_N)  # the first block of keys
    valid = n < end
    off = _kv_offsets(table, n, valid, kvh, stride_kc, stride_kh, D, PAGE)
    if PDL > 0:
        last = length - 1  # the newest token: its k/v are this step's
        old = (valid & (n < last))[:, None]
        k = tl.load(KC + off, mask=old, other=0.0)
        v = tl.load(VC + off, mask=old, other=0.0)
        last_page = tl.load(table + last // PAGE).to(tl.int64)
        last_off = (last_page * PAGE + last % PAGE) * stride_kc + kvh * stride_kh + d
        pdl_wait(PDL)
        here = (last >= begin) & (last < end) & (last < begin + BLOCK_N)  # in this first block
        new = (n == last)[:, None]
        k = tl.where(new, tl.load(KC + last_off, mask=(d < D) & here, other=0.0)[None, :], k)
        v = tl.where(new, tl.load(VC + last_off, mask=(d < D) & here, other=0.0)[None, :], v)
    else:
        k = tl.load(KC + off, mask=valid[:, None], other=0.0)
        v = tl.load(VC + off, mask=valid[:, None], other=0.0)
    q = tl.load(Q + b * stride_qt + (kvh * G + g)[:, None] * stride_qh + d[None, :], mask=gmask[:, None], other=0.0)
    qk_scale = scale * 1.4426950408889634
    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, D], tl.float32)
    m, l, acc = _softmax_step(q, k, v, valid, valid[None, :], m, l, acc, qk_scale, PRECISION)
    for start in range(begin + BLOCK_N, end, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        valid = n < end
        off = _kv_offsets(table, n, valid, kvh, stride_kc, stride_kh, D, PAGE)
        k = tl.load(KC + off, mask=valid[:, None], other=0.0)
        m, l, acc = _softmax_step(q, k, VC + off, valid, valid[None, :], m, l, acc, qk_scale, PRECISION)
    heads = kvh * G + g
    if SPLITS == 1:
        out = acc / l[:, None]
        tl.store(OUT + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=gmask[:, None])
    else:
        num_heads = tl.num_programs(1) * G
        row = (b * num_heads + heads) * SPLITS + split  # [B, H, SPLITS] partials
        tl.store(PART_ACC + row[:, None] * D + d[None, :], acc, mask=gmask[:, None])
        tl.store(PART_ML + row * 2, m, mask=gmask)
        tl.store(PART_ML + row * 2 + 1, l, mask=gmask)


@triton.jit
def _decode_reduce_kernel(PART_ACC, PART_ML, OUT, stride_ot, stride_oh,
                          D: tl.constexpr, SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_wait(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    num_heads = tl.num_programs(1)
    sp = tl.arange(0, BLOCK_S)
    smask = sp < SPLITS
    row = (b * num_heads + h) * SPLITS + sp
    m = tl.load(PART_ML + row * 2, mask=smask, other=float("-inf"))
    l = tl.load(PART_ML + row * 2 + 1, mask=smask, other=0.0)
    m_all = tl.max(m, axis=0)
    w = tl.where(smask & (l > 0), tl.exp2(m - m_all), 0.0)  # empty splits (m = -inf) weigh nothing
    d = tl.arange(0, D)
    acc = tl.load(PART_ACC + row[:, None] * D + d[None, :], mask=smask[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
    tl.store(OUT + b * stride_ot + h * stride_oh + d, out.to(OUT.dtype.element_ty))


def _dot_precision(q: torch.Tensor) -> str:
    """float32 models get float32 dot products (Triton's default for them is tf32)."""
    return "ieee" if q.dtype == torch.float32 else "tf32"


def decode_splits(batch: int, kv_heads: int, num_sms: int = 132) -> int:
    """Splits of each sequence's cache so that small and middling batches still fill the GPU (about
    four programs per multiprocessor: each program's loop over its slice is latency-bound); large
    batches need none. At most 32 (batch 1 on an H100: 32 splits' graph ran 4-6 us faster than 16
    in two A/B runs of 1.07 ms, level in a third; scripts/gpu_suite.py --phases graphab)."""
    return max(1, min(32, -(-4 * num_sms // (batch * kv_heads))))


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, page: int, scale: float, splits: int = 1,
                 out: torch.Tensor | None = None, block_n: int = 64, num_warps: int = 4) -> torch.Tensor:
    """q: [B, H, D], one query token per sequence; context_lens[b] >= 1 tokens in the cache;
    block_n: cache tokens per step of each program's loop."""
    batch, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    out = torch.empty_like(q) if out is None else out
    part_acc = part_ml = out
    pdl = pdl_mode(q)
    if splits > 1:
        part_acc = torch.empty(batch, heads, splits, dim, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(batch, heads, splits, 2, dtype=torch.float32, device=q.device)
    _decode_kernel[(batch, kv_heads, splits)](
        q, k_cache, v_cache, out, part_acc, part_ml, block_tables, context_lens, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        G=group, BLOCK_G=max(16, triton.next_power_of_2(group)), D=dim, PAGE=page, BLOCK_N=block_n, SPLITS=splits,
        PRECISION=_dot_precision(q), PDL=pdl, num_warps=num_warps, num_stages=2, **pdl_launch(pdl),
    )
    if splits > 1:
        _decode_reduce_kernel[(batch, heads)](
            part_acc, part_ml, out, out.stride(0), out.stride(1),
            D=dim, SPLITS=splits, BLOCK_S=max(2, triton.next_power_of_2(splits)), PDL=pdl, num_warps=1,
            **pdl_launch(pdl),
        )
    return out


@triton.jit(do_not_specialize=["stride_bt"])
def _prefill_kernel(Q, KC, VC, OUT, TABLES, TILE_SEQ, TILE_M, Q_START, Q_LEN, PAST, scale,
                    stride_qt, stride_qh, stride_kc, stride_kh, stride_bt, stride_ot, stride_oh,
                    G: tl.constexpr, D: tl.constexpr, PAGE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    """One program per (tile of BLOCK_M new tokens of one sequence, query head). Query i of a
    sequence sits at position past + i and sees the cached keys 0 .. past + i (its own included)."""
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
    end = past + tl.minimum(m0 + BLOCK_M, q_len)
    m, l, acc = _attend_pages(q, KC, VC, TABLES + s_idx * stride_bt, 0, end, kvh, stride_kc, stride_kh,
                              scale * 1.4426950408889634, past + rows, BLOCK_M, D, PAGE, BLOCK_N, True, PRECISION)
    out = acc / l[:, None]
    tl.store(OUT + (q_start + rows)[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(OUT.dtype.element_ty), mask=rmask[:, None])


PREFILL_BLOCK_M = 64


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                  tile_seq: torch.Tensor, tile_m: torch.Tensor, q_start: torch.Tensor, q_len: torch.Tensor,
                  past: torch.Tensor, page: int, scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, H, D] packed new tokens of several sequences (their k/v already in the cache).
    Tiles (tile_seq, tile_m) cover each sequence's new tokens in steps of PREFILL_BLOCK_M; only the
    rows of tiled sequences are written."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = k_cache.shape[1]
    out = torch.empty_like(q) if out is None else out
    _prefill_kernel[(tile_seq.shape[0], heads)](
        q, k_cache, v_cache, out, block_tables, tile_seq, tile_m, q_start, q_len, past, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), block_tables.stride(0),
        out.stride(0), out.stride(1),
        G=heads // kv_heads, D=dim, PAGE=page, BLOCK_M=PREFILL_BLOCK_M, BLOCK_N=64,
        PRECISION=_dot_precision(q), num_warps=4, num_stages=2,
    )
    return out


# -- greedy decode bursts: the argmax and the next step's inputs, on the device ------------------

ARGMAX_CHUNKS = 32


@triton.jit
def _argmax_chunks_kernel(LOGITS, VALS, IDX, stride_l, V, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                          PDL: tl.constexpr = 0):
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
def _advance_kernel(VALS, IDX, TOKENS, STEP, IDS, POS, LENS, SLOTS, TABLES, NREAL, rows, stride_t, stride_bt,
                    max_blocks, max_steps, PAGE: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_R: tl.constexpr,
                    PDL: tl.constexpr = 0):
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
                   page: int, num_real: torch.Tensor) -> None:
    """After a decode step's logits [B, V], for the first num_real rows: tokens[step] = ids = argmax
    (first index on ties, as torch.argmax); positions and lens += 1; slots = the KV slot of the new
    position. Then step += 1. ids, positions, slots and lens are int64 [B], tables int32
    [B, max_blocks], step and num_real int64 [1]."""
    rows, vocab = logits.shape
    chunk = triton.cdiv(vocab, ARGMAX_CHUNKS)
    vals = torch.empty(rows, ARGMAX_CHUNKS, dtype=torch.float32, device=logits.device)
    idx = torch.empty(rows, ARGMAX_CHUNKS, dtype=torch.int32, device=logits.device)
    pdl = pdl_mode(logits)
    _argmax_chunks_kernel[(rows, ARGMAX_CHUNKS)](logits, vals, idx, logits.stride(0), vocab, CHUNK=chunk,
                                                  BLOCK=1024, PDL=pdl, num_warps=4, **pdl_launch(pdl))
    _advance_kernel[(1,)](vals, idx, tokens, step, ids, positions, lens, slots, tables, num_real, rows, tokens.stride(0),
                          tables.stride(0), tables.shape[1], tokens.shape[0], PAGE=page, CHUNKS=ARGMAX_CHUNKS,
                          BLOCK_R=max(2, triton.next_power_of_2(rows)), PDL=pdl, num_warps=4, **pdl_launch(pdl))
