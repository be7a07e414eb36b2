"""The CPU's C++ kernels (ferrum.kernels.cpu) against the plain-PyTorch ops they replace: attention over
the paged cache against SDPA over the gathered slots, the norm, silu * mul and rope against
ferrum.models.layers' torch ops (the same roundings, so bf16 results agree exactly), and the build's
cache."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ferrum.kernels.cpu.build import CpuKernelBuildError, compiler, load_cpu_kernels
from ferrum.models.layers.ops import torch_ops
from ferrum.models.layers.rotary import apply_rotary
from ferrum.weights.quantization.scheme import QuantMethod

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C++ compiler to build the CPU kernels with")

CACHE = Path("~/.cache/ferrum/kernels").expanduser()  # the engine's default: one build for the whole run


@pytest.fixture(scope="module")
def ops() -> object:
    load_cpu_kernels(CACHE)
    return torch.ops.ferrum_cpu


def reference_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: list[list[int]],
                        lens: list[int], starts: list[int], block_size: int, window: int = 0) -> torch.Tensor:
    """SDPA over each sequence's gathered slots; with a window, each query sees its last `window` keys."""
    out = torch.empty(q.shape, dtype=torch.float32)
    for b, length in enumerate(lens):
        rows = slice(starts[b], starts[b + 1])
        n = starts[b + 1] - starts[b]
        first = max(0, length - n - window + 1) if window else 0  # the first key any of its queries sees
        slots = torch.tensor([tables[b][p // block_size] * block_size + p % block_size for p in range(first, length)])
        k, v = k_cache[slots].float().transpose(0, 1), v_cache[slots].float().transpose(0, 1)
        query = torch.arange(length - n, length)[:, None]
        key = torch.arange(first, length)[None, :]
        mask = (key <= query) & ((key > query - window) if window else True)
        o = F.scaled_dot_product_attention(q[rows].float().transpose(0, 1), k, v, attn_mask=mask, enable_gqa=True)
        out[rows] = o.transpose(0, 1)
    return out


def scattered_tables(cases: list[tuple[int, int]], num_blocks: int, block_size: int
                     ) -> tuple[list[list[int]], torch.Tensor, list[int], list[int]]:
    """Block tables for (queries, context) cases over blocks 0 .. num_blocks - 1 taken in a random order
    (scattered through the cache): the lists, the int32 table, the context lengths and the query starts."""
    order = torch.randperm(num_blocks).tolist()
    tables: list[list[int]] = []
    lens: list[int] = []
    starts = [0]
    for n, length in cases:
        used = sum(len(t) for t in tables)
        tables.append(order[used : used + -(-length // block_size)])
        lens.append(length)
        starts.append(starts[-1] + n)
    table = torch.zeros(len(cases), max(map(len, tables)), dtype=torch.int32)
    for i, t in enumerate(tables):
        table[i, : len(t)] = torch.tensor(t)
    return tables, table, lens, starts


# (queries, context) per sequence: decodes short and long (split over the keys), a chunk after cached
# tokens, a whole prompt, a one-token prompt
CASES = [(1, 37), (1, 1500), (20, 90), (33, 33), (1, 1)]


def block_major(cache: torch.Tensor, block_size: int) -> torch.Tensor:
    """[slots, KV, W] -> the engine's layout for these kernels, [blocks, KV, block_size, W]."""
    return cache.view(-1, block_size, *cache.shape[1:]).transpose(1, 2).contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 40])  # 40: the kernel's any-head_dim path
@pytest.mark.parametrize("blocks_first", [True, False])
def test_paged_attention_matches_sdpa_over_gathered_slots(ops: object, dtype: torch.dtype, head_dim: int,
                                                           blocks_first: bool) -> None:
    torch.manual_seed(0)
    heads, kv_heads, block_size = 6, 2, 16
    num_blocks = sum(-(-length // block_size) for _, length in CASES) + 3
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    tables, table, lens, starts = scattered_tables(CASES, num_blocks, block_size)
    qkv = torch.randn(starts[-1], (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, : heads * head_dim].view(-1, heads, head_dim)  # a strided view, as the layer passes it
    out = torch.empty(q.shape, dtype=dtype)
    k_in, v_in = (k_cache, v_cache)
    if blocks_first:
        k_in, v_in = block_major(k_cache, block_size), block_major(v_cache, block_size)
    ops.paged_attention(out, q, k_in, v_in, table, torch.tensor(lens, dtype=torch.int32),  # type: ignore[attr-defined]
                        torch.tensor(starts, dtype=torch.int32), block_size, 1 / math.sqrt(head_dim))
    expected = reference_attention(q, k_cache, v_cache, tables, lens, starts, block_size)
    bound = 1e-5 if dtype == torch.float32 else 1.6e-2  # bf16: the output's rounding (values ~1)
    assert (out.float() - expected).abs().max().item() < bound


def int8_cache(x: torch.Tensor) -> torch.Tensor:
    """[slots, KV, D] floats -> int8 rows [slots, KV, D + 4]: values, then their float32 scale."""
    scale = x.float().abs().amax(-1, keepdim=True) / 127
    values = (x.float() / scale.clamp_min(1e-30)).round().to(torch.int8)
    return torch.cat((values, scale.view(torch.int8)), -1)


def dequantized(cache: torch.Tensor) -> torch.Tensor:
    values, scale = cache[..., :-4], cache[..., -4:].contiguous().view(torch.float32)
    return values.float() * scale


def untiled(cache: torch.Tensor, key: bool) -> torch.Tensor:
    """An int8 cache in tiles (common.h), [blocks, KV, block_size, D + 4], as rows [slots, KV, D + 4]: a
    tile's block_size * D value bytes, then block_size float32 scales; keys plus 128 as uint8, each 16
    tokens' by 4 dimensions ([D / 4, 16, 4]), values each 4 tokens' side by side ([D, 4])."""
    blocks, kv, size, width = cache.shape
    dim = width - 4
    tiles = cache.reshape(blocks, kv, size * width)
    data, scales = tiles[..., : size * dim], tiles[..., size * dim :].contiguous().view(torch.float32)
    if key:
        data = data.view(torch.uint8).view(blocks, kv, size // 16, dim // 4, 16, 4).permute(0, 1, 2, 4, 3, 5)
        values = (data.reshape(blocks, kv, size, dim).to(torch.int16) - 128).to(torch.int8)
    else:
        values = data.view(blocks, kv, size // 4, dim, 4).permute(0, 1, 2, 4, 3).reshape(blocks, kv, size, dim)
    rows = torch.cat((values, scales.unsqueeze(-1).view(torch.int8)), -1)
    return rows.transpose(1, 2).reshape(blocks * size, kv, width)


def written_int8(ops: object, k: torch.Tensor, v: torch.Tensor, block_size: int | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """k, v [slots, KV, D] written by rope_write (cos 1, sin 0: no rotation) into int8 caches: in tiles,
    [blocks, KV, block_size, D + 4], or (block_size None) in rows, [slots, KV, D + 4]."""
    slots, kv_heads, dim = k.shape
    shape = (slots, kv_heads, dim + 4) if block_size is None else (slots // block_size, kv_heads, block_size, dim + 4)
    k8, v8 = torch.empty(shape, dtype=torch.int8), torch.empty(shape, dtype=torch.int8)
    qkv = torch.cat((torch.zeros(slots, dim, dtype=k.dtype), k.reshape(slots, -1), v.reshape(slots, -1)), 1)
    ops.rope_write(qkv, torch.zeros(slots, dtype=torch.long), torch.ones(1, dim), torch.zeros(1, dim),  # type: ignore[attr-defined]
                   k8, v8, torch.arange(slots), 1, kv_heads)
    return k8, v8


@pytest.mark.parametrize("head_dim", [64, 128, 40])  # 64, 128: the VNNI path where the CPU has it
@pytest.mark.parametrize("tiles", [True, False])
def test_paged_attention_reads_an_int8_cache(ops: object, head_dim: int, tiles: bool) -> None:
    """Against SDPA over the same cache dequantized: the kernel's roundings (tiles on AVX512-VNNI: the
    queries in two int8 parts, the weights of the values in two uint8 parts; tiles on AVX2 alone: both in
    int16; bf16's output) stay within the output's rounding; and against the unquantized cache, the int8
    cache's cost (random values)."""
    torch.manual_seed(3)
    heads, kv_heads, block_size, cases = 6, 2, 16, [(1, 37), (1, 1500), (20, 90), (33, 33)]
    num_blocks = sum(-(-length // block_size) for _, length in cases) + 2
    k = torch.randn(num_blocks * block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    k8, v8 = written_int8(ops, k, v, block_size if tiles else None)
    k_rows, v_rows = (untiled(k8, True), untiled(v8, False)) if tiles else (k8, v8)
    torch.testing.assert_close(dequantized(k_rows), dequantized(int8_cache(k)), rtol=0, atol=0.03)
    tables, table, lens, starts = scattered_tables(cases, num_blocks, block_size)
    q = torch.randn(starts[-1], heads, head_dim, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    ops.paged_attention(out, q, k8, v8, table, torch.tensor(lens, dtype=torch.int32),  # type: ignore[attr-defined]
                        torch.tensor(starts, dtype=torch.int32), block_size, 1 / math.sqrt(head_dim))
    exact = reference_attention(q, dequantized(k_rows), dequantized(v_rows), tables, lens, starts, block_size)
    assert (out.float() - exact).abs().max().item() < 1.6e-2  # bf16's rounding of values ~1
    unquantized = reference_attention(q, k, v, tables, lens, starts, block_size)
    assert (out.float() - unquantized).abs().max().item() < 0.05
    with pytest.raises(RuntimeError, match="head width"):  # an int8 cache without room for its scales
        ops.paged_attention(out, q, k8[..., :head_dim].contiguous(), v8[..., :head_dim].contiguous(),  # type: ignore[attr-defined]
                            table, torch.tensor(lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
                            block_size, 1.0)
    with pytest.raises(RuntimeError, match="block_size \\(16\\)"):  # blocks of another size
        ops.paged_attention(out, q, k8.view(-1, kv_heads, 8, head_dim + 4), v8.view(-1, kv_heads, 8, head_dim + 4),  # type: ignore[attr-defined]
                            table, torch.tensor(lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
                            block_size, 1.0)


def seven_bit_tiles() -> bool:
    """Whether this build reads generated rows of an int8 cache in 7 bits: AVX2's tiles (no AVX512-VNNI, or the
    x86-64-v3 build of test_the_portable_build_passes_the_kernel_tests)."""
    flags = _cpu_flags()
    return "FERRUM_TEST_MARCH" in os.environ or ("avx2" in flags and not {"avx512_vnni", "avx512bw"} <= flags)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_generated_rows_read_an_int8_cache_with_seven_bit_queries(ops: object, head_dim: int) -> None:
    """`generated` (the sequences whose rows are all generated tokens): on AVX2's tiles their queries and value
    weights are 7 bits, within the reference with the queries so rounded (max|q| / 63) plus each weight's half
    step (at most |v| / 254 where one key dominates a short range); every other sequence's rows equal the call
    without it, bit for bit (prompt rows keep 16 bits). Elsewhere (VNNI) the flag changes nothing."""
    torch.manual_seed(4)
    heads, kv_heads, block_size, cases = 6, 2, 16, [(1, 37), (1, 1500), (20, 90), (3, 33)]
    num_blocks = sum(-(-length // block_size) for _, length in cases) + 2
    k = torch.randn(num_blocks * block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    k8, v8 = written_int8(ops, k, v, block_size)
    tables, table, lens, starts = scattered_tables(cases, num_blocks, block_size)
    q = torch.randn(starts[-1], heads, head_dim, dtype=torch.bfloat16)
    args = (table, torch.tensor(lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32), block_size,
            1 / math.sqrt(head_dim), 0, None, None)
    plain, flagged = torch.empty_like(q), torch.empty_like(q)
    generated = torch.tensor([True, True, False, True])
    ops.paged_attention(plain, q, k8, v8, *args)  # type: ignore[attr-defined]
    ops.paged_attention(flagged, q, k8, v8, *args, generated)  # type: ignore[attr-defined]
    prompt = slice(starts[2], starts[3])
    assert torch.equal(flagged[prompt], plain[prompt])
    if not seven_bit_tiles():
        assert torch.equal(flagged, plain)
        return
    step = q.float().abs().amax(-1, keepdim=True).clamp_min(1e-30) / 63
    q7 = ((q.float() / step).round() * step).to(q.dtype)
    k_rows, v_rows = untiled(k8, True), untiled(v8, False)
    reference = reference_attention(q7, dequantized(k_rows), dequantized(v_rows), tables, lens, starts, block_size)
    rows = torch.cat([torch.arange(starts[i], starts[i + 1]) for i in (0, 1, 3)])
    assert (flagged[rows].float() - reference[rows]).abs().max().item() < 3e-2
    assert not torch.equal(flagged[rows], plain[rows])  # the 7-bit path ran
    with pytest.raises(RuntimeError, match="generated must be bool"):
        ops.paged_attention(flagged, q, k8, v8, *args, generated[:3])  # type: ignore[attr-defined]


@pytest.mark.parametrize("dtype", [torch.int8, torch.bfloat16])
def test_a_head_major_cache_holds_and_reads_as_a_block_major_one(ops: object, dtype: torch.dtype) -> None:
    """KVCacheLayout.allocate's CPU cache stores each kv head's blocks back to back (a transposed view): what
    rope_write writes there and what paged_attention reads back equal the contiguous block-major cache's,
    bit for bit; a cache whose tiles are not contiguous is refused by name."""
    from ferrum.models.attention.layout import KVCacheLayout

    torch.manual_seed(5)
    heads, kv_heads, dim, block_size, num_blocks = 6, 3, 64, 16, 12
    layout = KVCacheLayout(1, kv_heads, dim, dtype, block_size)
    ((k_hm, v_hm),) = layout.allocate(num_blocks, torch.device("cpu"), block_major=True)
    assert not k_hm.is_contiguous() and k_hm.stride(1) == num_blocks * k_hm.stride(0)
    k_bm, v_bm = torch.zeros_like(k_hm).contiguous(), torch.zeros_like(v_hm).contiguous()
    slots = torch.randperm(num_blocks * block_size)[:150]
    qkv = torch.randn(150, (heads + 2 * kv_heads) * dim, dtype=torch.bfloat16)
    positions = torch.arange(150)
    emb = torch.outer(torch.arange(256).float(), 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))).repeat(1, 2)
    for k_cache, v_cache in ((k_hm, v_hm), (k_bm, v_bm)):
        ops.rope_write(qkv.clone(), positions, emb.cos(), emb.sin(), k_cache, v_cache, slots, heads, kv_heads)  # type: ignore[attr-defined]
    assert torch.equal(k_hm, k_bm) and torch.equal(v_hm, v_bm)
    table = torch.randperm(num_blocks)[None, :10].to(torch.int32).contiguous()
    q = torch.randn(1, heads, dim, dtype=torch.bfloat16)
    outs = []
    for k_cache, v_cache in ((k_hm, v_hm), (k_bm, v_bm)):
        out = torch.empty_like(q)
        ops.paged_attention(out, q, k_cache, v_cache, table, torch.tensor([150], dtype=torch.int32),  # type: ignore[attr-defined]
                            torch.tensor([0, 1], dtype=torch.int32), block_size, 1 / math.sqrt(dim))
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and outs[0].abs().sum() > 0
    scrambled = k_bm.transpose(2, 3).contiguous().transpose(2, 3)  # each tile's slots strided
    with pytest.raises(RuntimeError, match="contiguous tiles"):
        ops.paged_attention(out, q, scrambled, scrambled, table, torch.tensor([150], dtype=torch.int32),  # type: ignore[attr-defined]
                            torch.tensor([0, 1], dtype=torch.int32), block_size, 1.0)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float16])
def test_float32_activations_over_a_16_bit_cache(ops: object, cache_dtype: torch.dtype) -> None:
    """kv_cache_dtype bfloat16 under float32 serving (auto's choice on CPUs without bf16 matmuls): rope_write
    rounds k and v into the cache, paged_attention reads it as the float32 kernel reads the same values
    widened (bit for bit), and with the step's own keys a fresh prompt is scored on them as computed."""
    torch.manual_seed(11)
    heads, kv_heads, dim, block_size, num_blocks = 6, 2, 64, 16, 8
    rows = 40
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim)
    emb = torch.outer(torch.arange(64).float(), 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))).repeat(1, 2)
    slots = torch.arange(rows)
    narrow = [torch.zeros(num_blocks, kv_heads, block_size, dim, dtype=cache_dtype) for _ in range(2)]
    wide = [torch.zeros(num_blocks, kv_heads, block_size, dim) for _ in range(2)]
    rotated = qkv.clone()
    ops.rope_write(rotated, torch.arange(rows), emb.cos(), emb.sin(), *narrow, slots, heads, kv_heads)  # type: ignore[attr-defined]
    ops.rope_write(qkv.clone(), torch.arange(rows), emb.cos(), emb.sin(), *wide, slots, heads, kv_heads)  # type: ignore[attr-defined]
    for n, w in zip(narrow, wide, strict=True):
        assert torch.equal(n, w.to(cache_dtype))  # each value rounded to the nearest
    table = torch.arange(num_blocks, dtype=torch.int32)[None]
    lens, starts = torch.tensor([rows], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
    q = rotated[-1:, : heads * dim].view(1, heads, dim)
    out_narrow, out_wide = torch.empty_like(q), torch.empty_like(q)
    ops.paged_attention(out_narrow, q, *narrow, table, lens, starts, block_size, dim**-0.5)  # type: ignore[attr-defined]
    ops.paged_attention(out_wide, q, *(c.to(cache_dtype).float() for c in wide), table, lens, starts,  # type: ignore[attr-defined]
                        block_size, dim**-0.5)
    assert torch.equal(out_narrow, out_wide) and out_narrow.abs().sum() > 0
    # a fresh prompt given its own keys and values: scored on them unrounded, as a float32 cache scores it
    q_all = rotated[:, : heads * dim].view(rows, heads, dim)
    k_own = rotated[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim)
    v_own = rotated[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim)
    prompt_narrow, prompt_wide = torch.empty_like(q_all), torch.empty_like(q_all)
    starts = torch.tensor([0, rows], dtype=torch.int32)
    ops.paged_attention(prompt_narrow, q_all, *narrow, table, lens, starts, block_size, dim**-0.5, 0, k_own, v_own)  # type: ignore[attr-defined]
    ops.paged_attention(prompt_wide, q_all, *wide, table, lens, starts, block_size, dim**-0.5, 0, k_own, v_own)  # type: ignore[attr-defined]
    assert torch.equal(prompt_narrow, prompt_wide)
    with pytest.raises(RuntimeError, match="for float32 q"):
        ops.paged_attention(out_narrow.to(torch.bfloat16), q.to(torch.bfloat16), *(c.to(torch.float16) for c in narrow),  # type: ignore[attr-defined]
                            table, lens, torch.tensor([0, 1], dtype=torch.int32), block_size, 1.0)


@pytest.mark.parametrize("head_dim", [64, 40])  # 64: the VNNI tiles where the CPU has them
@pytest.mark.parametrize("window", [0, 24])
def test_an_int8_cache_given_the_steps_keys_scores_a_fresh_prompt_unquantized(ops: object, head_dim: int,
                                                                              window: int) -> None:
    """Given the step's k and v, a sequence with nothing cached before the step reads its keys and values
    from them (scored as with an unquantized cache); decodes and chunks after cached tokens read every key
    from the int8 cache, their own step's too."""
    torch.manual_seed(5)
    heads, kv_heads, block_size, cases = 6, 2, 16, [(1, 37), (1, 1500), (20, 90), (33, 33), (40, 300)]
    num_blocks = sum(-(-length // block_size) for _, length in cases) + 2
    k = torch.randn(num_blocks * block_size, kv_heads, head_dim, dtype=torch.bfloat16)
    v = torch.randn_like(k)
    k8, v8 = written_int8(ops, k, v, block_size if head_dim % 4 == 0 else None)
    k_rows, v_rows = (untiled(k8, True), untiled(v8, False)) if k8.dim() == 4 else (k8, v8)
    tables, table, lens, starts = scattered_tables(cases, num_blocks, block_size)
    step = torch.tensor([tables[b][p // block_size] * block_size + p % block_size
                         for b, (n, length) in enumerate(cases) for p in range(length - n, length)])
    qkv = torch.randn(starts[-1], (heads + 2 * kv_heads) * head_dim, dtype=torch.bfloat16)
    qkv[:, heads * head_dim :] = torch.cat((k[step].flatten(1), v[step].flatten(1)), 1)
    q = qkv[:, : heads * head_dim].view(-1, heads, head_dim)
    k_step = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(-1, kv_heads, head_dim)
    v_step = qkv[:, (heads + kv_heads) * head_dim :].view(-1, kv_heads, head_dim)
    out = torch.empty(q.shape, dtype=q.dtype)
    ops.paged_attention(out, q, k8, v8, table, torch.tensor(lens, dtype=torch.int32),  # type: ignore[attr-defined]
                        torch.tensor(starts, dtype=torch.int32), block_size, 1 / math.sqrt(head_dim), window,
                        k_step, v_step)
    quantized = reference_attention(q, dequantized(k_rows), dequantized(v_rows), tables, lens, starts, block_size,
                                    window)
    unquantized = reference_attention(q, k, v, tables, lens, starts, block_size, window)
    prompt = slice(starts[3], starts[4])  # (33, 33): nothing cached before it
    assert (out[prompt].float() - unquantized[prompt]).abs().max().item() < 1.6e-2  # bf16's rounding of values ~1
    rest = torch.cat((torch.arange(starts[3]), torch.arange(starts[4], starts[-1])))
    assert (out[rest].float() - quantized[rest]).abs().max().item() < 1.6e-2
    with pytest.raises(RuntimeError, match="k and v both or neither"):
        ops.paged_attention(out, q, k8, v8, table, torch.tensor(lens, dtype=torch.int32),  # type: ignore[attr-defined]
                            torch.tensor(starts, dtype=torch.int32), block_size, 1.0, window, k_step, None)


@pytest.mark.parametrize("cache", ["bfloat16", "float32-any-head-dim", "int8-tiles"])
def test_paged_attention_with_a_sliding_window_reads_only_the_window(ops: object, cache: str) -> None:
    """Each query sees its last `window` keys (HF's sliding window: itself and the window - 1 before it), in
    decodes short and long (split over the keys), chunks after cached tokens and a whole prompt longer than
    the window. The table entries of blocks wholly before a sequence's first query's window point at a
    block of NaNs, as the engine's given-back blocks may hold anything: not one may be read."""
    torch.manual_seed(5)
    dtype = torch.float32 if cache.startswith("float32") else torch.bfloat16
    heads, kv_heads, block_size, window = 4, 2, 16, 100
    head_dim = 40 if cache.startswith("float32") else 64
    cases = [(1, 37), (1, 1500), (20, 300), (70, 200), (1, 101), (17, 117)]
    num_blocks = sum(-(-length // block_size) for _, length in cases) + 1
    poison = num_blocks - 1
    k = torch.randn(num_blocks * block_size, kv_heads, head_dim, dtype=dtype)
    v = torch.randn_like(k)
    tables, table, lens, starts = scattered_tables(cases, num_blocks - 1, block_size)  # the last one: poison
    for i, (n, length) in enumerate(cases):
        table[i, : max(0, length - n - window + 1) // block_size] = poison  # given back: never read
    q = torch.randn(starts[-1], heads, head_dim, dtype=dtype)
    k_in, v_in = block_major(k, block_size), block_major(v, block_size)
    if cache == "int8-tiles":
        k_in, v_in = written_int8(ops, k, v, block_size)
        k, v = dequantized(untiled(k_in, True)), dequantized(untiled(v_in, False))
    for c in (k_in, v_in):
        c[poison] = -1 if c.dtype == torch.int8 else float("nan")  # int8: bytes 0xFF, NaN scales
    out = torch.empty_like(q)
    ops.paged_attention(out, q, k_in, v_in, table, torch.tensor(lens, dtype=torch.int32),  # type: ignore[attr-defined]
                        torch.tensor(starts, dtype=torch.int32), block_size, 1 / math.sqrt(head_dim), window)
    expected = reference_attention(q, k, v, tables, lens, starts, block_size, window)
    assert not out.isnan().any()
    bound = 1e-5 if dtype == torch.float32 else 1.6e-2
    assert (out.float() - expected).abs().max().item() < bound
    whole = reference_attention(q, k, v, tables, lens, starts, block_size)
    assert (whole - expected).abs().max().item() > 0.1  # the window changes the answer


def test_paged_attention_refuses_a_block_table_too_short(ops: object) -> None:
    k_cache = torch.zeros(32, 1, 64)
    q = torch.zeros(1, 1, 64)
    with pytest.raises(RuntimeError, match="block table of 1 blocks"):
        ops.paged_attention(torch.empty_like(q), q, k_cache, k_cache,  # type: ignore[attr-defined]
                            torch.zeros(1, 1, dtype=torch.int32), torch.tensor([17], dtype=torch.int32),
                            torch.tensor([0, 1], dtype=torch.int32), 16, 0.125)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_and_activation_match_the_torch_ops(ops: object, dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    x, residual = torch.randn(5, 96, dtype=dtype) * 3, torch.randn(5, 96, dtype=dtype)
    weight = torch.randn(96, dtype=dtype)
    plain = torch_ops()
    for res in (None, residual):
        normed, summed = ops.rms_norm(x, weight, 1e-5, res)  # type: ignore[attr-defined]
        want_normed, want_summed = plain.rms_norm(x, weight, 1e-5, res)
        assert torch.equal(summed, want_summed)
        torch.testing.assert_close(normed, want_normed, rtol=0, atol=0 if dtype == torch.bfloat16 else 1e-6)
    gate_up = torch.randn(5, 2 * 80, dtype=dtype) * 4
    torch.testing.assert_close(ops.silu_and_mul(gate_up), plain.silu_and_mul(gate_up),  # type: ignore[attr-defined]
                               rtol=0, atol=0 if dtype == torch.bfloat16 else 1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_write_rotates_q_and_k_and_fills_the_slots(ops: object, dtype: torch.dtype) -> None:
    torch.manual_seed(2)
    heads, kv_heads, dim, rows = 4, 2, 32, 3
    positions = torch.tensor([0, 7, 300])
    freqs = torch.outer(torch.arange(512, dtype=torch.float32), 1.0 / 10000 ** (torch.arange(0, dim, 2) / dim))
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, dtype=dtype)
    k_cache, v_cache = torch.zeros(10, kv_heads, dim, dtype=dtype), torch.zeros(10, kv_heads, dim, dtype=dtype)
    slots = torch.tensor([4, 9, 0])
    expected = apply_rotary(qkv[:, : (heads + kv_heads) * dim].view(rows, -1, dim),
                            cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype))
    v = qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim).clone()
    ops.rope_write(qkv, positions, cos, sin, k_cache, v_cache, slots, heads, kv_heads)  # type: ignore[attr-defined]
    rotated = qkv[:, : (heads + kv_heads) * dim].view(rows, -1, dim)
    torch.testing.assert_close(rotated, expected, rtol=0, atol=0 if dtype == torch.bfloat16 else 1e-6)
    assert torch.equal(k_cache[slots], rotated[:, heads:])
    assert torch.equal(v_cache[slots], v)
    with pytest.raises(RuntimeError, match="slot 10 \\(cache of 10\\)"):
        ops.rope_write(qkv, positions, cos, sin, k_cache, v_cache, torch.tensor([1, 2, 10]),  # type: ignore[attr-defined]
                       heads, kv_heads)
    # an int8 cache: each head's values round(x / scale) with scale max|x| / 127, in rows (blocks of 2
    # slots) or in tiles (blocks of 16)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, dtype=dtype)
    v = qkv[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim).clone()
    slots = torch.tensor([4, 9, 17])
    for block_size in (2, 16):
        k8, v8 = (torch.zeros(32 // block_size, kv_heads, block_size, dim + 4, dtype=torch.int8) for _ in range(2))
        ops.rope_write(qkv.clone(), positions, cos, sin, k8, v8, slots, heads, kv_heads)  # type: ignore[attr-defined]
        if block_size == 16:
            k8, v8 = untiled(k8, True), untiled(v8, False)
        else:
            k8, v8 = (c.transpose(1, 2).reshape(32, kv_heads, dim + 4) for c in (k8, v8))  # as [slots, KV, W]
        k = apply_rotary(qkv[:, heads * dim : (heads + kv_heads) * dim].view(rows, kv_heads, dim),
                         cos[positions].unsqueeze(1).to(dtype), sin[positions].unsqueeze(1).to(dtype))
        for cache, want in ((k8, k), (v8, v)):
            scale = cache[slots, :, dim:].contiguous().view(torch.float32)
            torch.testing.assert_close(scale, want.float().abs().amax(-1, keepdim=True) / 127)
            assert ((dequantized(cache[slots]) - want.float()).abs() <= scale / 2 * 1.0001).all()


def test_build_is_cached_and_a_failed_build_leaves_nothing(ops: object, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    library = load_cpu_kernels(CACHE)
    assert library.is_file() and library.parent.parent == CACHE
    assert load_cpu_kernels(CACHE) == library
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails at once
    with pytest.raises(CpuKernelBuildError, match="false failed"):
        load_cpu_kernels(tmp_path / "kernels")
    assert not any(p.is_file() for p in (tmp_path / "kernels").rglob("*"))


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


@pytest.mark.skipif(not {"avx2", "fma", "f16c", "bmi2", "avx512f"} <= _cpu_flags() or "FERRUM_TEST_MARCH" in os.environ,
                    reason="needs a CPU with AVX-512 (an AVX2-only CPU's own build is the AVX2 path)")
def test_the_avx2_build_passes_the_same_tests(tmp_path: Path) -> None:
    """The kernels built for x86-64-v3 (AVX2 and FMA, no AVX-512, no VNNI) pass this module too: the path
    an AVX2-only CPU compiles, which a CPU with AVX-512 never runs otherwise (its int8 GEMV saturated
    maddubs once, unseen)."""
    wrapper = tmp_path / "g++-avx2"
    wrapper.write_text('#!/bin/sh\nfor a; do shift; [ "$a" = -march=native ] && a=-march="$FERRUM_TEST_MARCH"; '
                       'set -- "$@" "$a"; done\nexec g++ "$@"\n')
    wrapper.chmod(0o755)
    env = {**os.environ, "CXX": str(wrapper), "FERRUM_TEST_MARCH": "x86-64-v3"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__,
                           "-k", "not avx2_build and not build_is_cached"],
                          env=env, capture_output=True, text=True, check=False, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout and " skipped" not in done.stdout


def quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the GEMV kernels see it: in blocks of 32 inputs, int8 at scale s = max|x| / 127 plus the
    rounding error's own int8 at s / 254."""
    blocks = x.float().view(x.shape[0], -1, 32)
    amax = blocks.abs().amax(-1, keepdim=True)
    s1 = amax / 127
    q1 = torch.round(blocks * torch.where(amax > 0, 127 / amax, 0))
    rest = blocks - q1 * s1
    q2 = torch.round(rest * torch.where(amax > 0, 254 * 127 / amax, 0)).clamp(-127, 127)
    return (q1 * s1 + q2 * (s1 / 254)).view(x.shape)


@pytest.mark.parametrize(("method", "group", "param_dtype"), [
    ("int4", 32, torch.bfloat16),  # bf16 scales and zeros are exact in float16: kept so
    ("int4", 64, torch.float32),  # float32 scales: kept as float32
    ("int8", 0, torch.float32),
    ("int8", 64, torch.float32),
])
def test_gemv_is_exact_on_quantized_activations(ops: object, method: QuantMethod, group: int,
                                                param_dtype: torch.dtype) -> None:
    """The CPU GEMV (QuantizedLinear's cpu_kernels method, repacked) equals the float product of the
    dequantized weight with x quantized per 32 inputs (int4's minimum term with x's exact sums), for
    batches of 1 to 11 rows (in chunks of 4 rows, 5 with AVX-512) and a row count that is not a multiple of 8."""
    from ferrum.models.layers.quantized_linear import CpuKernelsMethod, QuantizedLinear
    from ferrum.weights.quantization.arith import dequantize, quantize
    from ferrum.weights.quantization.scheme import QuantScheme

    torch.manual_seed(3)
    n, k = 37, 128
    scheme = QuantScheme(method, group_size=group or 128, per_group=bool(group) and method == "int8",
                         params=torch.float32 if method == "int4" and param_dtype == torch.float32 else None)
    stored = quantize((torch.randn(n, k) * 0.05).to(param_dtype), scheme)
    layer = QuantizedLinear(k, n, False, scheme, "cpu_kernels", torch.bfloat16)
    assert isinstance(layer.method, CpuKernelsMethod)
    for name, part in stored.parts.items():
        getattr(layer, name).copy_(part)
    weight = dequantize(layer.storage(), torch.float32)
    layer.prepare()
    if method == "int4":
        assert layer.gemv_scale.dtype == (torch.float16 if param_dtype == torch.bfloat16 else torch.float32)
    torch.testing.assert_close(layer.dequantized().float(), weight.to(torch.bfloat16).float(), rtol=0, atol=0)
    # 37: plain AVX2's many-rows int4 kernel in two chunks (elsewhere 37 rows take the dense product)
    for rows in (r for r in (1, 3, 5, 11, 37) if r < layer.method.dense_rows(layer)):
        x = torch.randn(rows, k).to(torch.bfloat16)
        # each row the same bits at any row count (a speculative verify step's rows score as one-row decodes)
        assert torch.equal(layer(x), torch.cat([layer(row) for row in x.split(1)]))
        exact = quantized_activations(x) @ weight.t()
        if method == "int4":  # w = q * scale + minimum: the minimum meets x's exact sums
            minimum = (stored.parts["zero"].float() - 8 * stored.parts["scale"].float())
            exact += (x.float() - quantized_activations(x)) @ minimum.repeat_interleave(group, 1).t()
        got = layer(x).float()
        assert got.shape == (rows, n)
        assert ((got - exact).abs().max() / exact.abs().max()).item() < 8e-3  # the output's bf16 rounding
    x = torch.randn(layer.method.dense_rows(layer) + 3, k).to(torch.bfloat16)  # long prefill: dequantized once
    exact = x.float() @ weight.t()
    assert ((layer(x).float() - exact).abs().max() / exact.abs().max()).item() < 8e-3


@pytest.mark.parametrize(("dtype", "group", "symmetric", "params"), [
    (torch.bfloat16, 32, False, torch.float16),  # quantization auto's scheme on 16-bit serving
    (torch.float32, 128, True, torch.float32),
    (torch.bfloat16, 64, False, None),  # scales and zeros in the weight's own dtype
])
def test_int4_fit_on_load_matches_the_torch_fit(ops: object, dtype: torch.dtype, group: int, symmetric: bool,
                                                params: torch.dtype | None) -> None:
    """The loader's int4 quantization through the CPU kernels (LayerOps.quantize of cpu_ops) is
    ferrum.weights.quantization.arith's fit: the same bytes, scales and zeros, but where a sum taken in
    another order moves a near-tie (the test allows 1 group in 500, and no worse squared error); a
    scheme it does not take (int8, a ragged last group) is left to arith's torch ops."""
    from ferrum.models.layers.ops import cpu_ops
    from ferrum.weights.quantization.arith import dequantize, quantize
    from ferrum.weights.quantization.scheme import QuantScheme

    torch.manual_seed(5)
    weight = (torch.randn(203, 512) * torch.rand(203, 1) * 0.1).to(dtype)  # rows of different ranges
    weight[0, :group] = 0.25  # a constant group: its scale never 0
    scheme = QuantScheme("int4", group_size=group, symmetric=symmetric, params=params)
    kernel = cpu_ops().quantize
    assert kernel is not None
    fitted, reference = quantize(weight, scheme, kernel), quantize(weight, scheme)
    assert fitted.layout_problems() == [] and fitted.scheme == scheme
    for name in ("scale", "zero"):
        assert fitted.parts[name].dtype == reference.parts[name].dtype == (params or dtype)
    same = (fitted.parts["qweight"] == reference.parts["qweight"]).view(weight.shape[0], -1, group // 2).all(-1)
    for name in ("scale", "zero"):  # float32 ones within their last bits, 16-bit ones equal
        same &= torch.isclose(fitted.parts[name].float(), reference.parts[name].float(), rtol=1e-5, atol=1e-9)
    assert (~same).sum().item() <= same.numel() // 500
    assert float(dequantize(fitted, torch.float32)[0, :group].min()) > 0
    errors = [(dequantize(q, torch.float32) - weight.float()).square().sum().item() for q in (fitted, reference)]
    assert errors[0] <= errors[1] * 1.001
    assert kernel(weight, QuantScheme("int8")) is None
    assert kernel(weight[:, :500], scheme) is None
    assert kernel(weight.double(), QuantScheme("int4", group_size=group)) is None  # float64 scales: arith's
