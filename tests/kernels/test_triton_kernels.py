"""The GPU path's Triton kernels (ferrum.kernels) against plain-torch references.

On a machine without CUDA they run in Triton's interpreter (TRITON_INTERPRET=1, set before
triton is imported), so CI checks the same kernel code the GPU runs; on a GPU they run compiled.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import ON_GPU, use_interpreter

use_interpreter()
from ferrum.kernels import greedy, ngram, norm, paged_attention, rope  # noqa: E402  (after the interpreter is chosen)

DEVICE = "cuda" if ON_GPU else "cpu"
# bf16 on the GPU; numpy (the interpreter) has no bf16, so CPU runs check the same kernels in fp16
DTYPE = torch.bfloat16 if ON_GPU else torch.float16


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def reference_attention(q, k, v, past, window=0):
    """q: [n, H, D] at positions past..past+n-1; k, v: [past+n, KV, D]. float64, causal; with a window,
    each query sees its last `window` keys."""
    n, heads, dim = q.shape
    group = heads // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,mhd->hnm", q.double(), k) / dim**0.5
    mask = torch.ones(n, past + n, dtype=torch.bool).tril(past)
    if window:
        mask &= ~torch.ones(n, past + n, dtype=torch.bool).tril(past - window)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.einsum("hnm,mhd->nhd", scores.softmax(-1), v)


def scattered_cache(seqs_kv, num_blocks, page, kv_heads, dim, gen):
    """Writes each sequence's k/v into randomly chosen, non-contiguous pages of a fresh cache."""
    k_cache = torch.randn(num_blocks * page, kv_heads, dim, generator=gen).to(DTYPE)  # poison
    v_cache = torch.randn(num_blocks * page, kv_heads, dim, generator=gen).to(DTYPE)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for k, v in seqs_kv:
        pages = [order.pop() for _ in range(-(-k.shape[0] // page))]
        tables.append(pages)
        for pos in range(k.shape[0]):
            slot = pages[pos // page] * page + pos % page
            k_cache[slot], v_cache[slot] = k[pos], v[pos]
    width = max(len(t) for t in tables)
    table_tensor = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return k_cache.to(DEVICE), v_cache.to(DEVICE), table_tensor.to(DEVICE)


@pytest.mark.parametrize("splits,block_n", [(1, 32), (1, 64), (3, 32), (3, 64), (16, 32), (16, 64), (32, 32)])
@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 64), (4, 4, 128), (6, 2, 64)])
def test_paged_decode_matches_reference(heads, kv_heads, dim, splits, block_n):
    gen = torch.Generator().manual_seed(heads * dim)
    page = 16
    lengths = [1, 17, 200, 5]  # with 16 splits most of a short sequence's splits are empty
    kv = [(torch.randn(n, kv_heads, dim, generator=gen).to(DTYPE),
           torch.randn(n, kv_heads, dim, generator=gen).to(DTYPE)) for n in lengths]
    k_cache, v_cache, tables = scattered_cache(kv, 40, page, kv_heads, dim, gen)
    q = torch.randn(len(lengths), heads, dim, generator=gen).to(DTYPE)
    out = paged_attention.paged_decode(q.to(DEVICE), k_cache, v_cache, tables,
                          torch.tensor(lengths, dtype=torch.int32, device=DEVICE), page, dim**-0.5, splits,
                          block_n=block_n)
    for b, n in enumerate(lengths):
        ref = reference_attention(q[b : b + 1], kv[b][0], kv[b][1], past=n - 1)
        assert rel_err(out[b : b + 1].cpu(), ref) < 1e-2


def ints(values):
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def prefill_tiles(shapes: list[tuple[int, int]]) -> tuple[list[int], list[int], list[int]]:
    """(q_start, tile_seq, tile_m) of the prefill kernel for sequences of (past, new) tokens, packed."""
    q_start, tile_seq, tile_m, row = [], [], [], 0
    for i, (_, n) in enumerate(shapes):
        q_start.append(row)
        row += n
        for m0 in range(0, n, paged_attention.PREFILL_BLOCK_M):
            tile_seq.append(i)
            tile_m.append(m0)
    return q_start, tile_seq, tile_m


@pytest.mark.parametrize("heads,kv_heads,dim", [(8, 2, 64), (4, 2, 128)])
def test_paged_prefill_with_cached_context_matches_reference(heads, kv_heads, dim):
    """Three sequences in one packed batch: a whole prompt, a chunk after 40 cached tokens, and one
    token after 9 (a decode handled by the prefill kernel in a mixed step)."""
    gen = torch.Generator().manual_seed(7 + dim)
    page = 16
    shapes = [(0, 70), (40, 33), (9, 1)]  # (past, new)
    kv = [(torch.randn(p + n, kv_heads, dim, generator=gen).to(DTYPE),
           torch.randn(p + n, kv_heads, dim, generator=gen).to(DTYPE)) for p, n in shapes]
    k_cache, v_cache, tables = scattered_cache(kv, 40, page, kv_heads, dim, gen)
    qs = [torch.randn(n, heads, dim, generator=gen).to(DTYPE) for _, n in shapes]
    q = torch.cat(qs)
    q_start, tile_seq, tile_m = prefill_tiles(shapes)
    out = paged_attention.paged_prefill(q.to(DEVICE), k_cache, v_cache, tables, ints(tile_seq), ints(tile_m),
                                        ints(q_start), ints([n for _, n in shapes]), ints([p for p, _ in shapes]),
                                        page, dim**-0.5).cpu()
    for i, (p, n) in enumerate(shapes):
        ref = reference_attention(qs[i], kv[i][0], kv[i][1], past=p)
        assert rel_err(out[q_start[i] : q_start[i] + n], ref) < 1e-2


def _poisoned(tables: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, firsts: list[int], page: int):
    """The table entries of blocks wholly before each sequence's first key (given back by the engine under a
    sliding window) pointed at a block of NaNs: the kernels may not read them."""
    poison = min(set(range(k_cache.shape[0] // page)) - set(tables.flatten().tolist()))  # a block nobody holds
    k_cache[poison * page : (poison + 1) * page] = float("nan")
    v_cache[poison * page : (poison + 1) * page] = float("nan")
    tables = tables.clone()
    for b, first in enumerate(firsts):
        tables[b, : first // page] = poison
    return tables


@pytest.mark.parametrize("splits", [1, 3])
def test_paged_decode_with_a_sliding_window(splits):
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, dim, page, window = 4, 2, 64, 16, 40
    lengths = [1, 39, 41, 200]
    kv = [(torch.randn(n, kv_heads, dim, generator=gen).to(DTYPE),
           torch.randn(n, kv_heads, dim, generator=gen).to(DTYPE)) for n in lengths]
    k_cache, v_cache, tables = scattered_cache(kv, 24, page, kv_heads, dim, gen)
    tables = _poisoned(tables, k_cache, v_cache, [max(0, n - window) for n in lengths], page)
    q = torch.randn(len(lengths), heads, dim, generator=gen).to(DTYPE)
    out = paged_attention.paged_decode(q.to(DEVICE), k_cache, v_cache, tables,
                                       torch.tensor(lengths, dtype=torch.int32, device=DEVICE), page, dim**-0.5,
                                       splits, block_n=16, window=window).cpu()
    assert not out.isnan().any()
    for b, n in enumerate(lengths):
        ref = reference_attention(q[b : b + 1], kv[b][0], kv[b][1], past=n - 1, window=window)
        assert rel_err(out[b : b + 1], ref) < 1e-2


def test_paged_prefill_with_a_sliding_window():
    """A whole prompt longer than the window, a chunk after cached tokens past the window, a decode."""
    gen = torch.Generator().manual_seed(12)
    heads, kv_heads, dim, page, window = 4, 2, 64, 16, 24
    shapes = [(0, 70), (60, 33), (50, 1)]  # (past, new)
    kv = [(torch.randn(p + n, kv_heads, dim, generator=gen).to(DTYPE),
           torch.randn(p + n, kv_heads, dim, generator=gen).to(DTYPE)) for p, n in shapes]
    k_cache, v_cache, tables = scattered_cache(kv, 24, page, kv_heads, dim, gen)
    tables = _poisoned(tables, k_cache, v_cache, [max(0, p - window + 1) for p, _ in shapes], page)
    qs = [torch.randn(n, heads, dim, generator=gen).to(DTYPE) for _, n in shapes]
    q_start, tile_seq, tile_m = prefill_tiles(shapes)
    out = paged_attention.paged_prefill(torch.cat(qs).to(DEVICE), k_cache, v_cache, tables, ints(tile_seq),
                                        ints(tile_m), ints(q_start), ints([n for _, n in shapes]),
                                        ints([p for p, _ in shapes]), page, dim**-0.5, window=window).cpu()
    assert not out.isnan().any()
    for i, (p, n) in enumerate(shapes):
        ref = reference_attention(qs[i], kv[i][0], kv[i][1], past=p, window=window)
        assert rel_err(out[q_start[i] : q_start[i] + n], ref) < 1e-2


def test_rms_norm_and_fused_residual_match_hf_order():
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(5, 96, generator=gen) * 3).to(DTYPE)
    res = torch.randn(5, 96, generator=gen).to(DTYPE)
    w = (1 + 0.1 * torch.randn(96, generator=gen)).to(DTYPE)

    def hf(h):
        hf32 = h.float()
        normed = hf32 * torch.rsqrt(hf32.pow(2).mean(-1, keepdim=True) + 1e-5)
        return w * normed.to(DTYPE)

    out, none = norm.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-5)
    assert none is None
    assert rel_err(out.cpu(), hf(x)) < 4e-3
    summed = x + res
    out, new_res = norm.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-5, residual=res.to(DEVICE))
    assert torch.equal(new_res.cpu(), summed)
    assert rel_err(out.cpu(), hf(summed)) < 4e-3


def test_silu_and_mul():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(3, 2 * 1500, generator=gen).to(DTYPE)
    gate, up = x.float().chunk(2, dim=-1)
    ref = torch.nn.functional.silu(gate) * up
    assert rel_err(norm.silu_and_mul(x.to(DEVICE)).cpu(), ref) < 1e-2


@pytest.mark.parametrize(("qk_norm", "heads", "kv_heads"), [(False, 4, 2), (True, 4, 2), (False, 9, 3)])
def test_rope_and_store_writes_rotated_k_and_v_into_slots(qk_norm, heads, kv_heads):
    """(9 and 3 heads, SmolLM2's: the kernel's tile of a part's heads is masked past them.)"""
    gen = torch.Generator().manual_seed(3)
    dim, tokens = 64, 6
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen).to(DTYPE)
    positions = torch.tensor([0, 1, 2, 7, 30, 31])
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    freqs = torch.outer(torch.arange(64).float(), inv)
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos(), emb.sin()
    slots = torch.tensor([5, 9, 0, 33, 12, 2])
    k_cache = torch.zeros(40, kv_heads, dim, dtype=DTYPE)
    v_cache = torch.zeros(40, kv_heads, dim, dtype=DTYPE)
    qn = (1 + 0.1 * torch.randn(dim, generator=gen)).to(DTYPE) if qk_norm else None
    kn = (1 + 0.1 * torch.randn(dim, generator=gen)).to(DTYPE) if qk_norm else None

    def dev(t):
        return None if t is None else t.to(DEVICE)

    kc, vc = k_cache.to(DEVICE), v_cache.to(DEVICE)
    q = rope.rope_and_store(dev(qkv), dev(positions), dev(cos), dev(sin), dev(slots), kc, vc,
                          heads, kv_heads, dim, dev(qn), dev(kn), 1e-6).cpu()

    def norm(x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(DTYPE)

    def rotate(x):
        c, s = cos[positions][:, None].double(), sin[positions][:, None].double()
        x = x.double()
        half = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1)
        return x * c + half * s

    ref_q = qkv[:, : heads * dim].view(tokens, heads, dim)
    ref_k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    ref_v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    if qk_norm:
        ref_q, ref_k = norm(ref_q, qn), norm(ref_k, kn)
    assert rel_err(q, rotate(ref_q)) < 1e-2
    assert rel_err(kc.cpu()[slots], rotate(ref_k)) < 1e-2
    assert torch.equal(vc.cpu()[slots], ref_v)
    untouched = torch.ones(40, dtype=torch.bool)
    untouched[slots] = False
    assert not kc.cpu()[untouched].any() and not vc.cpu()[untouched].any()


@pytest.mark.parametrize(("qk_norm", "splits", "window", "fp8"),
                         [(True, 1, 0, False), (True, 3, 0, False), (False, 3, 0, False), (True, 3, 20, False),
                          (True, 3, 0, True)])
def test_decode_with_rope_folded_in_equals_rope_then_decode(qk_norm, splits, window, fp8):
    """paged_decode_rope (the fused chain's attention for Qwen3-style per-head norms) against rope_and_store
    then paged_decode: the same keys written into the same slots, and the same output. Rows of lengths 1,
    19 and 45: the new key in the first, a middle and the last split, behind and inside the window; and
    over an fp8 cache (its scales)."""
    gen = torch.Generator().manual_seed(5)
    heads, kv_heads, dim, page = 8, 2, 64, 16
    lengths = [1, 19, 45]
    old = [(torch.randn(n - 1, kv_heads, dim, generator=gen).to(DTYPE),
            torch.randn(n - 1, kv_heads, dim, generator=gen).to(DTYPE)) for n in lengths]
    full = [(torch.cat([k, torch.zeros(1, kv_heads, dim, dtype=DTYPE)]),
             torch.cat([v, torch.zeros(1, kv_heads, dim, dtype=DTYPE)])) for k, v in old]
    k_cache, v_cache, tables = scattered_cache(full, 12, page, kv_heads, dim, gen)
    scales = torch.tensor([0.02, 0.03], device=DEVICE) if fp8 else None
    if fp8:
        k_cache = (k_cache.float() / 0.02).to(torch.float8_e4m3fn)
        v_cache = (v_cache.float() / 0.03).to(torch.float8_e4m3fn)
    pages = tables.cpu().tolist()
    slots = ints([pages[b][(n - 1) // page] * page + (n - 1) % page for b, n in enumerate(lengths)]).long()
    positions = ints([n - 1 for n in lengths]).long()
    lens = ints(lengths)
    qkv = torch.randn(len(lengths), (heads + 2 * kv_heads) * dim, generator=gen).to(DTYPE).to(DEVICE)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.outer(torch.arange(64).float(), inv).repeat(1, 2)
    cos, sin = emb.cos().to(DEVICE), emb.sin().to(DEVICE)
    qn = (1 + 0.1 * torch.randn(dim, generator=gen)).to(DTYPE).to(DEVICE) if qk_norm else None
    kn = (1 + 0.1 * torch.randn(dim, generator=gen)).to(DTYPE).to(DEVICE) if qk_norm else None
    kc_ref, vc_ref = k_cache.clone(), v_cache.clone()
    q = rope.rope_and_store(qkv, positions, cos, sin, slots, kc_ref, vc_ref, heads, kv_heads, dim, qn, kn, 1e-6,
                            kv_scale=scales)
    ref = paged_attention.paged_decode(q, kc_ref, vc_ref, tables, lens, page, dim**-0.5, splits, block_n=16,
                                       window=window, kv_scale=scales)
    out = paged_attention.paged_decode_rope(qkv, heads, positions, cos, sin, slots, k_cache, v_cache, tables, lens,
                                            page, dim**-0.5, splits, qn, kn, 1e-6, block_n=16, window=window,
                                            kv_scale=scales)
    written = slots.cpu()
    assert rel_err(k_cache.cpu()[written].float(), kc_ref.cpu()[written].float()) < (2e-2 if fp8 else 2e-3)
    assert torch.equal(v_cache.cpu()[written].float(), vc_ref.cpu()[written].float())
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(k_cache.cpu()[untouched].float(), kc_ref.cpu()[untouched].float())
    assert torch.equal(v_cache.cpu()[untouched].float(), vc_ref.cpu()[untouched].float())
    assert rel_err(out.cpu(), ref.cpu()) < (1e-2 if fp8 else 2e-3)


def test_greedy_advance_picks_argmax_and_moves_one_token_on():
    """The in-graph step of a greedy burst: argmax (first index on ties, as torch.argmax) recorded
    at row `step` and fed back as the next input; positions, lengths and KV slots move one on."""
    gen = torch.Generator().manual_seed(11)
    rows, vocab, page = 3, 5000, 16
    logits = torch.randn(rows, vocab, generator=gen)
    logits[1, 4000] = logits[1, 17] = 50.0  # a tie across chunks: the first index wins
    logits[2, 130] = logits[2, 131] = 60.0  # a tie inside one chunk
    tables = torch.tensor([[7, 3, 0], [2, 9, 4], [5, 0, 0]], dtype=torch.int32)
    positions = torch.tensor([15, 31, 2])  # row 0 crosses into its second block
    tokens = torch.zeros(4, rows, dtype=torch.long, device=DEVICE)
    step = torch.tensor([2], device=DEVICE)
    ids = torch.zeros(rows, dtype=torch.long, device=DEVICE)
    pos, lens = positions.to(DEVICE), (positions + 1).to(DEVICE)
    slots = torch.zeros(rows, dtype=torch.long, device=DEVICE)
    greedy.greedy_advance(logits.to(DEVICE), tokens, step, ids, pos, lens, slots, tables.to(DEVICE), page,
                      torch.tensor([rows], device=DEVICE))
    want = logits.argmax(dim=-1)
    assert want.tolist()[1:] == [17, 130]
    assert tokens[2].cpu().tolist() == want.tolist() and ids.cpu().tolist() == want.tolist()
    assert not tokens[[0, 1, 3]].any() and step.item() == 3
    assert pos.cpu().tolist() == [16, 32, 3] and lens.cpu().tolist() == [17, 33, 4]
    # position 32 is in the third block of row 1 (block 4); row 2 stays in its first (block 5)
    assert slots.cpu().tolist() == [3 * page + 0, 4 * page + 0, 5 * page + 3]
    # a graph's padding rows (from num_real on) stay put: positions past the table never come
    greedy.greedy_advance(logits.to(DEVICE), tokens, step, ids, pos, lens, slots, tables.to(DEVICE), page,
                      torch.tensor([2], device=DEVICE))
    assert pos.cpu().tolist() == [17, 33, 3] and lens.cpu().tolist() == [18, 34, 4] and step.item() == 4
    assert tokens[3].cpu().tolist() == want.tolist()[:2] + [0]


# -- an fp8 (e4m3) KV cache --------------------------------------------------------------------------------


def fp8_cache(cache: torch.Tensor, scale: float) -> torch.Tensor:
    """`cache` stored as an fp8 cache holds it: over its scale, saturated, rounded to e4m3."""
    return (cache.float() / scale).clamp(-448, 448).to(torch.float8_e4m3fn)


def dequantized(cache: torch.Tensor, scale: float) -> torch.Tensor:
    return cache.float() * scale


HOPPER = ON_GPU and torch.cuda.get_device_capability() >= (9, 0)


if HOPPER:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, globaltimer

    @triton.jit
    def _late_writer(SRC_K, SRC_V, KC, VC, SLOTS, delay_ns, W: tl.constexpr):
        """Lets the next kernel launch at once, then after `delay_ns` copies row t of SRC_K / SRC_V
        (W elements: a slot's kv heads) into cache slot SLOTS[t]."""
        gdc_launch_dependents()
        t = tl.program_id(0)
        start = globaltimer()
        while globaltimer() - start < delay_ns:
            pass
        w = tl.arange(0, W)
        slot = tl.load(SLOTS + t).to(tl.int64)
        tl.store(KC + slot * W + w, tl.load(SRC_K + t * W + w))
        tl.store(VC + slot * W + w, tl.load(SRC_V + t * W + w))


@pytest.mark.skipif(not HOPPER, reason="programmatic dependent launch needs a GPU of compute capability 9.0+")
@pytest.mark.parametrize("splits", [1, 4])
def test_paged_decode_under_pdl_reads_the_keys_the_step_wrote(splits):
    """A prompt chunk replayed a row a token (DecodeGraphs.run_rows) or a draft's rows: each row reads keys
    that the kernel launched before it wrote in the same step. Under PDL the decode kernel starts while
    that kernel still runs (here: a writer that lets it launch at once and writes 2 ms later); every row
    must still see every key the step wrote."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, dim, page, past, n = 8, 2, 64, 16, 37, 12
    k = torch.randn(past + n, kv_heads, dim, generator=gen).to(DTYPE)
    v = torch.randn(past + n, kv_heads, dim, generator=gen).to(DTYPE)
    stale_k, stale_v = k.clone(), v.clone()
    stale_k[past:], stale_v[past:] = 0, 0  # the chunk's keys not yet written
    k_cache, v_cache, tables = scattered_cache([(stale_k, stale_v)], 8, page, kv_heads, dim, gen)
    pages = tables[0].tolist()
    slots = torch.tensor([pages[p // page] * page + p % page for p in range(past, past + n)], device=DEVICE)
    q = torch.randn(n, heads, dim, generator=gen).to(DTYPE)
    src_k, src_v = k[past:].to(DEVICE).contiguous(), v[past:].to(DEVICE).contiguous()
    q, lens, tables = q.to(DEVICE), ints(list(range(past + 1, past + n + 1))), tables.expand(n, -1).contiguous()
    out = torch.empty_like(q)

    def step() -> None:  # as the engine replays it: in a CUDA graph, the two kernels' PDL edge kept
        _late_writer[(n,)](src_k, src_v, k_cache, v_cache, slots, 2_000_000, W=kv_heads * dim, launch_pdl=True)
        paged_attention.paged_decode(q, k_cache, v_cache, tables, lens, page, dim**-0.5, splits, out=out, pdl=True)

    step()  # compiles both
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    ref = reference_attention(q.cpu(), k, v, past=past)
    for _ in range(3):
        k_cache[slots], v_cache[slots] = 0, 0
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out.cpu(), ref) < 1e-2


@pytest.mark.parametrize("splits", [1, 3])
def test_paged_decode_reads_an_fp8_cache(splits):
    """Against the reference over the dequantized values (the kernel's own error) and over the values
    before quantizing: the cache's error (e4m3 keeps 3 mantissa bits, each value within 1/16 of itself;
    scores of spread 3 sharpen it: measured 6.8%, bound 10%)."""
    gen = torch.Generator().manual_seed(11)
    heads, kv_heads, dim, page = 8, 2, 64, 16
    lengths = [1, 40, 200]
    kv = [(torch.randn(n, kv_heads, dim, generator=gen).to(DTYPE) * 3,
           torch.randn(n, kv_heads, dim, generator=gen).to(DTYPE)) for n in lengths]
    k_cache, v_cache, tables = scattered_cache(kv, 20, page, kv_heads, dim, gen)
    scales = torch.tensor([0.02, 0.005])
    kc, vc = fp8_cache(k_cache, 0.02), fp8_cache(v_cache, 0.005)
    q = torch.randn(len(lengths), heads, dim, generator=gen).to(DTYPE)
    out = paged_attention.paged_decode(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), tables,
                                       torch.tensor(lengths, dtype=torch.int32, device=DEVICE), page, dim**-0.5,
                                       splits, kv_scale=scales.to(DEVICE)).cpu()
    table_rows = tables.cpu()
    for b, n in enumerate(lengths):
        slots = [int(table_rows[b, p // page]) * page + p % page for p in range(n)]
        k_dq, v_dq = dequantized(kc.cpu()[slots], 0.02), dequantized(vc.cpu()[slots], 0.005)
        assert rel_err(out[b : b + 1], reference_attention(q[b : b + 1], k_dq, v_dq, past=n - 1)) < 1e-2
        assert rel_err(out[b : b + 1], reference_attention(q[b : b + 1], kv[b][0], kv[b][1], past=n - 1)) < 0.1


def test_paged_prefill_reads_an_fp8_cache():
    gen = torch.Generator().manual_seed(12)
    heads, kv_heads, dim, page = 4, 2, 64, 16
    shapes = [(0, 40), (24, 9)]  # (past, new)
    kv = [(torch.randn(p + n, kv_heads, dim, generator=gen).to(DTYPE),
           torch.randn(p + n, kv_heads, dim, generator=gen).to(DTYPE)) for p, n in shapes]
    k_cache, v_cache, tables = scattered_cache(kv, 12, page, kv_heads, dim, gen)
    kc, vc = fp8_cache(k_cache, 0.01).cpu(), fp8_cache(v_cache, 0.01).cpu()
    qs = [torch.randn(n, heads, dim, generator=gen).to(DTYPE) for _, n in shapes]

    out = paged_attention.paged_prefill(torch.cat(qs).to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), tables,
                                        ints([0, 1]), ints([0, 0]), ints([0, 40]), ints([40, 9]), ints([0, 24]),
                                        page, dim**-0.5, kv_scale=torch.tensor([0.01, 0.01], device=DEVICE)).cpu()
    table_rows = tables.cpu()
    for i, ((p, n), start) in enumerate(zip(shapes, (0, 40), strict=True)):
        slots = [int(table_rows[i, t // page]) * page + t % page for t in range(p + n)]
        ref = reference_attention(qs[i], dequantized(kc[slots], 0.01), dequantized(vc[slots], 0.01), past=p)
        assert rel_err(out[start : start + n], ref) < 1e-2


def test_rope_and_store_writes_an_fp8_cache_over_its_scales():
    """The same k and v as into a cache of the activations' dtype, each over its scale, rounded to
    e4m3 as torch rounds (values compared: the interpreter may write -0 as 0)."""
    gen = torch.Generator().manual_seed(13)
    heads, kv_heads, dim, tokens = 4, 2, 64, 5
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 4).to(DTYPE).to(DEVICE)
    positions = torch.tensor([0, 3, 9, 20, 63], device=DEVICE)
    emb = torch.outer(torch.arange(64).float(), 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))).repeat(1, 2)
    cos, sin = emb.cos().to(DEVICE), emb.sin().to(DEVICE)
    slots = torch.tensor([4, 8, 15, 0, 30], device=DEVICE)
    plain = [torch.zeros(32, kv_heads, dim, dtype=DTYPE, device=DEVICE) for _ in range(2)]
    fp8 = [torch.zeros(32, kv_heads, dim, dtype=torch.float8_e4m3fn, device=DEVICE) for _ in range(2)]
    scales = torch.tensor([0.01, 0.02], device=DEVICE)
    q_plain = rope.rope_and_store(qkv, positions, cos, sin, slots, *plain, heads, kv_heads, dim)
    q_fp8 = rope.rope_and_store(qkv, positions, cos, sin, slots, *fp8, heads, kv_heads, dim, kv_scale=scales)
    assert torch.equal(q_plain, q_fp8)
    for which, (ours, ref) in enumerate(zip(fp8, plain, strict=True)):
        assert torch.equal(ours.float().cpu(), fp8_cache(ref, float(scales[which])).float().cpu())
    assert (fp8[0].float().abs() == 448).any()  # some keys over 448 x 0.01: saturated, not NaN
    assert not fp8[0].float().isnan().any()
    with pytest.raises(ValueError, match="kv_scale"):
        rope.rope_and_store(qkv, positions, cos, sin, slots, *fp8, heads, kv_heads, dim)


@pytest.mark.skipif(not ON_GPU, reason="long contexts: GPU only (the interpreter takes minutes per thousand keys)")
@pytest.mark.parametrize("context", [4096, 32768, 131072])
def test_fp8_cache_attention_at_long_contexts(context):
    """Decode attention over an fp8 cache against the same keys and values in bf16, at 4k, 32k and 128k
    tokens (Llama-3.1's longest), with a needle: one key that matches the query, whose value must come
    through (an fp8 cache losing long contexts is a known failure: the softmax's sums here stay float32
    over every slice). Bound: 5% relative error of the output, the needle's value within 5%."""
    gen = torch.Generator(device="cuda").manual_seed(context)
    heads, kv_heads, dim, page = 32, 8, 128, 16
    k = torch.randn(context, kv_heads, dim, device="cuda", generator=gen).to(DTYPE)
    v = torch.randn(context, kv_heads, dim, device="cuda", generator=gen).to(DTYPE)
    q = torch.randn(1, heads, dim, device="cuda", generator=gen).to(DTYPE)
    needle = context // 3
    k[needle] = (q[0].view(kv_heads, heads // kv_heads, dim)[:, 0] * 4).to(DTYPE)  # each group's first head
    scales = torch.tensor([k.abs().max().item() * 2 / 448, v.abs().max().item() * 2 / 448], device="cuda")
    kc, vc = fp8_cache(k, float(scales[0])), fp8_cache(v, float(scales[1]))
    table = torch.arange(context // page, dtype=torch.int32, device="cuda")[None]
    lens = torch.tensor([context], dtype=torch.int32, device="cuda")
    splits = paged_attention.decode_splits(1, kv_heads, torch.cuda.get_device_properties(0).multi_processor_count)
    ref = paged_attention.paged_decode(q, k, v, table, lens, page, dim**-0.5, splits, block_n=32)
    out = paged_attention.paged_decode(q, kc, vc, table, lens, page, dim**-0.5, splits, block_n=32, kv_scale=scales)
    assert rel_err(out.float(), ref.float()) < 0.05
    first = torch.arange(kv_heads, device="cuda") * (heads // kv_heads)
    assert rel_err(out[0, first].float(), v[needle].float()) < 0.05


@pytest.mark.parametrize("k", [1, 3])
def test_drafted_burst_kernels_draft_as_the_host_proposer_and_keep_the_greedy_prefix(k: int):
    """draft_rows (a drafted burst's prompt lookup on the device) against NgramProposer on random histories of
    few distinct tokens (matches of every length): its draft where the host has one, the last token past it;
    the rows' ids, positions, KV slots and lengths. accept keeps the leading drafts equal to the choices,
    appends the choices and moves the length on. k 1 too: a large batch drafts fewer than the configured k."""
    import numpy as np

    from ferrum.engine.speculative.proposer import NgramProposer

    rng = np.random.default_rng(0)
    host = NgramProposer(2, 4)
    page, batch = 4, 3
    for _ in range(12):
        history = rng.integers(0, int(rng.integers(2, 5)), size=(batch, 40))
        lens = rng.integers(1, 30, size=batch)
        tables = torch.stack([torch.randperm(64)[:10] for _ in range(batch)])
        drafts = torch.zeros(batch, k, dtype=torch.long, device=DEVICE)
        vec = torch.zeros(4, 16, dtype=torch.long, device=DEVICE)
        step = torch.ones(1, dtype=torch.long, device=DEVICE)
        t_lens = torch.tensor(lens, device=DEVICE)
        t_history = torch.tensor(history, device=DEVICE)
        ngram.draft_rows(t_history, t_lens, tables.to(DEVICE), drafts, vec, step, page, k, 2, 4)
        assert step.item() == 0
        for b in range(batch):
            n = int(lens[b])
            expected = host._draft(history[b, :n].astype(np.int64), k)
            expected += [int(history[b, n - 1])] * (k - len(expected))
            assert drafts[b].tolist() == expected
            rows = slice(b * (k + 1), (b + 1) * (k + 1))
            positions = list(range(n - 1, n + k))
            assert vec[0, rows].tolist() == [int(history[b, n - 1])] + expected
            assert vec[1, rows].tolist() == positions
            assert vec[2, rows].tolist() == [int(tables[b, p // page]) * page + p % page for p in positions]
            assert vec[3, rows].tolist() == [p + 1 for p in positions]
        # the choices: each sequence's drafts, then one more, with sequence 1's second refused
        chosen = torch.cat([drafts, drafts[:, :1] + 1], 1)
        chosen[1, 1] += 1
        chosen = chosen.reshape(-1)
        out = torch.zeros(batch, k + 2, dtype=torch.long, device=DEVICE)
        before = t_lens.clone()
        ngram.accept(chosen, drafts, t_history, t_lens, out)
        for b in range(batch):
            c = chosen[b * (k + 1) : (b + 1) * (k + 1)].tolist()
            kept = next((j for j in range(k) if c[j] != int(drafts[b, j])), k)
            assert kept == (1 if b == 1 else k)
            assert out[b].tolist() == c + [kept + 1]
            assert int(t_lens[b]) == int(before[b]) + kept + 1
            assert t_history[b, int(before[b]) : int(before[b]) + k + 1].tolist() == c
