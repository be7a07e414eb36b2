"""The small-batch decode kernels (ferrum.kernels.gemv) against plain-torch references: fused
norm / bias / silu*mul / residual under several slicings (GemvTable), and the q/k/v projection
with rope and the KV-cache write in its epilogue.

Interpreted by Triton on machines without CUDA (fp16 there: numpy has no bf16), compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from ferrum.kernels.config import GemvTable, KernelConfig
from tests.triton_interpreter import ON_GPU, use_interpreter

use_interpreter()
from ferrum.kernels import gemv as tg  # noqa: E402  (after the interpreter is chosen)
from ferrum.kernels import rope  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float16


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm())


def rms_normed(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.double()
    return w.double() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


TABLES = [
    GemvTable(),  # all of K (256) in one slice: the norm applied before the product
    GemvTable(features_per_program=8, whole_k_with_norm=64, whole_k_without_norm=64, k_slice=64),
    GemvTable(features_per_program=4, whole_k_with_norm=32, whole_k_without_norm=32, k_slice=32),
    # the served table's rule, scaled down: products of up to 64 outputs without a norm read K whole (past
    # k_slice), 16 outputs a program (the last partial); the gated product, with its norm, is sliced at 64
    GemvTable(whole_k_with_norm=64, whole_k_without_norm=256, k_slice=64, whole_k_features=16, whole_k_max_outputs=64),
]


@pytest.mark.parametrize("k", [256, 200])  # 200: one slice wider than K (K need not be a power of two)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("table", TABLES, ids=lambda t: f"f{t.features_per_program}-slice{t.k_slice}"
                                                         f"-whole{t.whole_k_features}")
def test_gemv_with_norm_gate_bias_and_residual(table: GemvTable, rows: int, k: int) -> None:
    if k % 8 and table.k_slice < k:
        pytest.skip("K slices must divide K")
    gen = torch.Generator().manual_seed(rows * 100 + table.k_slice + k)
    n = 40  # not a multiple of the features per program: the last feature block is partial
    x = torch.randn(rows, k, generator=gen).to(DTYPE)
    w = (torch.randn(2 * n, k, generator=gen) / 8).to(DTYPE)
    bias = torch.randn(2 * n, generator=gen).to(DTYPE)
    norm_w = (1 + 0.2 * torch.randn(k, generator=gen)).to(DTYPE)
    residual = torch.randn(rows, n, generator=gen).to(DTYPE)
    d = lambda t: t.to(DEVICE)  # noqa: E731

    plain = tg.gemv(d(x), d(w[:n]), table)
    assert plain.shape == (rows, n) and plain.dtype == DTYPE
    assert rel_err(plain, x.double() @ w[:n].double().T) < 1e-2

    gated = tg.gemv(d(x), d(w), table, bias=d(bias), norm_weight=d(norm_w), eps=1e-5, gated=True)
    gate_up = rms_normed(x, norm_w, 1e-5) @ w.double().T + bias.double()
    gate, up = gate_up[:, :n], gate_up[:, n:]
    assert rel_err(gated, torch.nn.functional.silu(gate) * up) < 1e-2

    summed = tg.gemv(d(x), d(w[:n]), table, residual=d(residual), out_dtype=torch.float32)
    assert summed.dtype == torch.float32
    assert rel_err(summed, x.double() @ w[:n].double().T + residual.double()) < 1e-2
    into = torch.full((rows, n), float("nan"), dtype=torch.float32, device=DEVICE)
    assert tg.gemv(d(x), d(w[:n]), table, residual=d(residual), out=into) is into
    assert torch.equal(into, summed)


@pytest.mark.parametrize(
    ("k", "norm", "rows", "block_k"),
    [
        (2048, True, 1, 2048), (2048, False, 1, 2048), (8192, False, 1, 2048),  # Llama-3.2-1B
        (4096, True, 1, 4096), (4096, False, 1, 2048), (14336, False, 1, 2048),  # Llama-3.1-8B
        (2048, True, 2, 1024), (4096, False, 4, 512), (14336, False, 3, 512),
    ],
)
def test_default_table_gives_the_measured_slicing(k: int, norm: bool, rows: int, block_k: int) -> None:
    """The slicings measured on an H100 for the 1B and 8B shapes (benchmarks/gpu.md)."""
    cut = tg.slicing(k, rows, GemvTable(), norm=norm)
    assert (cut.block_n, cut.block_k, cut.num_warps) == (2, block_k, 4)
    assert tg.qkv_block_k(2048, 1, GemvTable()) == 1024 and tg.qkv_block_k(4096, 1, GemvTable()) == 2048


@pytest.mark.parametrize(
    ("k", "n", "norm", "cut"),
    [
        (4096, 2048, False, (8, 4096)),  # Qwen3-30B-A3B's o_proj: whole K, 8 outputs a program
        (2048, 2048, False, (8, 2048)),  # Llama-3.2-1B's o_proj
        (4096, 4096, False, (2, 2048)),  # Llama-3.1-8B's o_proj: wider than 2048 outputs, sliced
        (8192, 2048, False, (2, 2048)),  # the 1B's down_proj: K past 4096, sliced
        (2048, 5120, True, (2, 2048)), (4096, 2048, True, (2, 4096)),  # a norm fused: features_per_program
        (4096, 0, False, (2, 2048)),  # outputs not said: as wide ones
    ],
)
def test_the_served_bf16_table_reads_narrow_products_whole(k: int, n: int, norm: bool, cut: tuple[int, int]) -> None:
    """KernelConfig().gemv: products of up to 2048 outputs without a norm read all of K up to 4096 in one
    slice, 8 outputs a program; wider ones keep the base table's slicing (benchmarks/moe.md, 2026-12-06)."""
    got = tg.slicing(k, 1, KernelConfig().gemv, norm=norm, n=n)
    assert (got.block_n, got.block_k) == cut
    assert tg.slicing(4096, 2, KernelConfig().gemv, n=2048) == tg.slicing(4096, 2, GemvTable(), n=2048)  # 2 rows
    with pytest.raises(ValueError, match="whole_k_max_outputs"):
        GemvTable(whole_k_max_outputs=3000)


@pytest.mark.parametrize("table", [GemvTable(), GemvTable(k_slice=32, qkv_two_slices_from=64)],
                         ids=["whole", "sliced"])
@pytest.mark.parametrize("rows", [1, 2])
def test_qkv_projection_with_rope_and_cache_write(rows: int, table: GemvTable) -> None:
    """Against gemv + the separate rope_and_store kernel: same q, same cache contents."""
    gen = torch.Generator().manual_seed(20 + rows)
    heads, kv_heads, dim, hidden = 4, 2, 32, 128
    x = torch.randn(rows, hidden, generator=gen).to(DTYPE)
    w = (torch.randn((heads + 2 * kv_heads) * dim, hidden, generator=gen) / 8).to(DTYPE)
    bias = torch.randn((heads + 2 * kv_heads) * dim, generator=gen).to(DTYPE)
    norm_w = (1 + 0.2 * torch.randn(hidden, generator=gen)).to(DTYPE)
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    emb = torch.outer(torch.arange(64).float(), inv).repeat(1, 2)
    cos, sin = emb.cos().to(DEVICE), emb.sin().to(DEVICE)
    positions = torch.tensor([5, 40][:rows], device=DEVICE)
    slots = torch.tensor([3, 17][:rows], device=DEVICE)
    d = lambda t: t.to(DEVICE)  # noqa: E731

    caches = [torch.zeros(20, kv_heads, dim, dtype=DTYPE, device=DEVICE) for _ in range(4)]
    q = tg.qkv_rope_store(d(x), d(w), d(bias), d(norm_w), 1e-5, positions, cos, sin, slots,
                          caches[0], caches[1], heads, kv_heads, dim, table)
    qkv = tg.gemv(d(x), d(w), table, bias=d(bias), norm_weight=d(norm_w), eps=1e-5)
    q_ref = rope.rope_and_store(qkv, positions, cos, sin, slots, caches[2], caches[3], heads, kv_heads, dim)
    assert rel_err(q, q_ref.float()) < 1e-2
    for ours, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert rel_err(ours[slots], ref[slots].float()) < 1e-2
        untouched = torch.ones(20, dtype=torch.bool)
        untouched[slots.cpu()] = False
        assert not ours[untouched.to(DEVICE)].any()


def test_qkv_projection_writes_an_fp8_cache() -> None:
    """The fused projection's cache write into an fp8 cache: what rope_and_store writes there from the
    unfused projection (each k and v over its layer's scale), to the products' rounding."""
    gen = torch.Generator().manual_seed(23)
    heads, kv_heads, dim, hidden = 4, 2, 32, 128
    x = torch.randn(1, hidden, generator=gen).to(DTYPE).to(DEVICE)
    w = (torch.randn((heads + 2 * kv_heads) * dim, hidden, generator=gen) / 4).to(DTYPE).to(DEVICE)
    emb = torch.outer(torch.arange(64).float(), 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))).repeat(1, 2)
    cos, sin = emb.cos().to(DEVICE), emb.sin().to(DEVICE)
    positions, slots = torch.tensor([9], device=DEVICE), torch.tensor([6], device=DEVICE)
    scales = torch.tensor([0.01, 0.005], device=DEVICE)
    caches = [torch.zeros(8, kv_heads, dim, dtype=torch.float8_e4m3fn, device=DEVICE) for _ in range(4)]
    table = GemvTable()
    tg.qkv_rope_store(x, w, None, None, 1e-5, positions, cos, sin, slots, caches[0], caches[1], heads, kv_heads, dim,
                      table, kv_scale=scales)
    qkv = tg.gemv(x, w, table)
    rope.rope_and_store(qkv, positions, cos, sin, slots, caches[2], caches[3], heads, kv_heads, dim, kv_scale=scales)
    for ours, ref in ((caches[0], caches[2]), (caches[1], caches[3])):
        assert ref[slots].float().abs().sum() > 0
        assert rel_err(ours[slots].float(), ref[slots].float()) < 2e-2


def test_gemv_reads_its_rows_from_a_table():
    """The first decoder layer's projections read their input and residual rows straight from the
    embedding table (x_rows / residual_rows) instead of a gathered copy."""
    gen = torch.Generator().manual_seed(5)
    table = torch.randn(50, 64, generator=gen).to(DTYPE).to(DEVICE)
    w = (torch.randn(32, 64, generator=gen) / 8).to(DTYPE).to(DEVICE)
    rows = torch.tensor([7, 0, 49], dtype=torch.int64, device=DEVICE)
    norm = (torch.rand(64, generator=gen) + 0.5).to(DTYPE).to(DEVICE)
    t = GemvTable()
    gathered = tg.gemv(table, w, t, norm_weight=norm, x_rows=rows)
    assert torch.equal(gathered, tg.gemv(table[rows], w, t, norm_weight=norm))
    x = torch.randn(3, 32, generator=gen).to(DTYPE).to(DEVICE)
    w2 = (torch.randn(64, 32, generator=gen) / 8).to(DTYPE).to(DEVICE)
    assert torch.equal(tg.gemv(x, w2, t, residual=table, residual_rows=rows), tg.gemv(x, w2, t, residual=table[rows]))
