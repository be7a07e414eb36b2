"""The mixture-of-experts kernels (ferrum.kernels.moe) against plain PyTorch: the router's top k against
softmax + topk in float32, and the experts' weighted sums, per pair and grouped by expert, in the
activations' dtype and with quantized expert stacks (int8, fp8, int4 planes), against the same experts run
one by one over the dequantized weights in float64.

Interpreted by Triton on machines without CUDA (fp16 there: numpy has no bf16), compiled on a GPU.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from ferrum.kernels.config import GemvTable
from ferrum.kernels.counts import done_counts
from tests.kernels.test_quant_kernels import quantized
from tests.triton_interpreter import ON_GPU, use_interpreter

use_interpreter()
from ferrum.kernels import moe  # noqa: E402  (after the interpreter is chosen)

DEVICE = "cuda" if ON_GPU else "cpu"
DTYPE = torch.bfloat16 if ON_GPU else torch.float16
TABLE = GemvTable(features_per_program=8)  # the per-pair products: fewer programs to interpret


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    return float((out - ref).norm() / ref.norm())


def reference(x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
              down: torch.Tensor, experts: int) -> torch.Tensor:
    """Each token's chosen experts one by one, float64."""
    hidden = x.shape[1]
    inter = down.shape[1]
    gu = gate_up.double().view(experts, 2 * inter, hidden)
    dn = down.double().view(experts, hidden, inter)
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j, e in enumerate(chosen[t].tolist()):
            gate, up = (gu[e] @ x[t].double()).chunk(2)
            out[t] += float(weights[t, j]) * (dn[e] @ (torch.nn.functional.silu(gate) * up))
    return out


@pytest.mark.parametrize("tokens", [37, 3, 1])  # two kernels; one launch whose last program picks (twice in a row)
@pytest.mark.parametrize(("experts", "top_k", "normalize"),  # 128 at 1 token: one warp a program (router_warps)
                         [(8, 2, True), (4, 2, False), (40, 6, True), (128, 8, True)])
def test_route_picks_the_top_k_of_the_softmax(experts: int, top_k: int, normalize: bool, tokens: int) -> None:
    gen = torch.Generator().manual_seed(experts)
    x = torch.randn(tokens, 384, generator=gen).to(DTYPE)  # 384: three slices of the hidden features
    w = (torch.randn(experts, 384, generator=gen) / 8).to(DTYPE)
    probs = torch.softmax(x.double() @ w.double().T, dim=-1)
    want_w, want = probs.topk(top_k, dim=-1)
    if normalize:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    xd = x.to(DEVICE)
    for _ in range(2 if tokens <= 16 else 1):
        chosen, weights = moe.route(xd, w.to(DEVICE), top_k, normalize)
        assert chosen.dtype == torch.int32 and weights.dtype == torch.float32
        assert torch.equal(chosen.cpu().long(), want)  # (random scores: no near-ties at this size)
        torch.testing.assert_close(weights.cpu().double(), want_w, atol=1e-5, rtol=1e-5)
    if tokens <= 16:
        assert int(done_counts(xd.device)[0].item()) == 0  # set back for the next launch


@pytest.mark.parametrize("tokens", [1, 6, 20])  # one launch (1: a row at once; 6: rows in chunks); 20: norm kernel
def test_route_normed_norms_in_the_router_and_hands_the_rows_on(tokens: int) -> None:
    """The decode chain's router: RMSNorm inside its one launch. The rows it hands the experts equal the
    norm kernel's within one rounding of the activations' dtype, and the picks equal routing those rows."""
    from ferrum.kernels.norm import rms_norm

    gen = torch.Generator().manual_seed(tokens)
    hidden, experts, top_k = 640, 24, 4  # 640: five slices, and a row not a power of two
    x = (torch.randn(tokens, hidden, generator=gen) * 3).to(DTYPE).to(DEVICE)
    w = (torch.randn(experts, hidden, generator=gen) / 8).to(DTYPE).to(DEVICE)
    norm_weight = (1 + torch.randn(hidden, generator=gen) / 4).to(DTYPE).to(DEVICE)
    want_x = rms_norm(x, norm_weight, 1e-5)[0]
    for _ in range(2):  # twice: the launch set its count back
        routed = moe.route_normed(x, w, top_k, True, norm_weight, 1e-5)
        assert routed.x.shape == x.shape and routed.x.dtype == x.dtype
        assert not torch.equal(routed.x, x)
        step = torch.finfo(DTYPE).eps * want_x.double().abs().cpu()
        assert bool(((routed.x.double() - want_x.double()).abs().cpu() <= step).all())
        chosen, weights = moe.route(routed.x, w, top_k, True)
        assert torch.equal(routed.chosen, chosen)
        torch.testing.assert_close(routed.weights, weights, atol=1e-6, rtol=1e-6)
    assert int(done_counts(x.device)[0].item()) == 0


@pytest.mark.parametrize(("tokens", "per_pair"), [(1, True), (5, True), (1, False), (5, False), (40, False)])
def test_experts_match_one_by_one(tokens: int, per_pair: bool) -> None:
    """Mixtral-like 8 experts top 2 and the dims not powers of two; the grouped path's blocks of 16 and of
    64 rows (40 tokens: 80 pairs, 10 an expert on average, some experts none)."""
    gen = torch.Generator().manual_seed(tokens)
    experts, top_k, hidden, inter = 8, 2, 96, 40
    x = torch.randn(tokens, hidden, generator=gen).to(DTYPE)
    gate_up = (torch.randn(experts * 2 * inter, hidden, generator=gen) / 8).to(DTYPE)
    down = (torch.randn(experts * hidden, inter, generator=gen) / 6).to(DTYPE)
    chosen = torch.stack([torch.randperm(experts - 2, generator=gen)[:top_k] for _ in range(tokens)]).int()  # 6, 7 idle
    weights = torch.rand(tokens, top_k, generator=gen)
    d = lambda t: t.to(DEVICE)  # noqa: E731
    out = moe.experts(d(x), d(chosen), d(weights), d(gate_up), d(down), experts, TABLE, per_pair=per_pair)
    assert out.shape == (tokens, hidden) and out.dtype == DTYPE
    assert rel_err(out, reference(x, chosen, weights.to(DTYPE), gate_up, down, experts)) < 1e-2
    # the residual added by the last kernel (per pair: the down products' own) as adding it afterwards would
    residual = torch.randn(tokens, hidden, generator=gen).to(DTYPE)
    added = moe.experts(d(x), d(chosen), d(weights), d(gate_up), d(down), experts, TABLE, per_pair=per_pair,
                        residual=d(residual))
    assert torch.equal(added.cpu(), (out.cpu() + residual).cpu())


@pytest.mark.parametrize("inter", [300, 2100])  # two unrolled slices of 256; past 2048, a loop of slices
def test_down_products_of_every_chosen_expert_at_once(inter: int) -> None:
    """The per-pair down products with weights in the activations' dtype read all k experts' rows together
    (k = 3: a tile of 4, one masked) in unrolled slices, or in a loop of them for larger experts."""
    gen = torch.Generator().manual_seed(inter)
    experts, top_k, hidden, tokens = 6, 3, 48, 2
    x = torch.randn(tokens, hidden, generator=gen).to(DTYPE)
    gate_up = (torch.randn(experts * 2 * inter, hidden, generator=gen) / 8).to(DTYPE)
    down = (torch.randn(experts * hidden, inter, generator=gen) / (2 * inter**0.5)).to(DTYPE)
    chosen = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)]).int()
    weights = torch.rand(tokens, top_k, generator=gen)
    out = moe.experts(x.to(DEVICE), chosen.to(DEVICE), weights.to(DEVICE), gate_up.to(DEVICE), down.to(DEVICE),
                      experts, TABLE, per_pair=True)
    assert rel_err(out, reference(x, chosen, weights.to(DTYPE), gate_up, down, experts)) < 1e-2


def test_float32_experts_are_exact_to_float32() -> None:
    gen = torch.Generator().manual_seed(3)
    experts, top_k, hidden, inter = 4, 2, 64, 32
    x = torch.randn(6, hidden, generator=gen)
    gate_up = torch.randn(experts * 2 * inter, hidden, generator=gen) / 8
    down = torch.randn(experts * hidden, inter, generator=gen) / 6
    chosen = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(6)]).int()
    weights = torch.rand(6, top_k, generator=gen)
    want = reference(x, chosen, weights, gate_up, down, experts)
    for per_pair in (True, False):
        out = moe.experts(x.to(DEVICE), chosen.to(DEVICE), weights.to(DEVICE), gate_up.to(DEVICE), down.to(DEVICE),
                          experts, TABLE, per_pair=per_pair)
        assert rel_err(out, want) < 1e-5


def test_alignment_covers_every_pair_once() -> None:
    chosen = torch.tensor([[3, 1], [3, 0], [1, 3], [2, 3], [3, 1]], dtype=torch.int32)
    a = moe.align(chosen.to(DEVICE), 5, 2)
    assert a.counts.tolist() == [1, 3, 1, 5, 0]
    assert a.block_start.tolist() == [0, 1, 3, 4, 7]
    assert a.block_expert.tolist()[:7] == [0, 1, 1, 2, 3, 3, 3] and set(a.block_expert.tolist()[7:]) == {5}
    flat = chosen.flatten().tolist()
    order = a.order.tolist()
    assert sorted(order) == list(range(10)) and [flat[p] for p in order] == sorted(flat)


@pytest.mark.parametrize("kind", ["int8", "fp8", "int4"])
def test_quantized_experts_per_pair(kind: str) -> None:
    """The stacks quantized row by row (int4 in groups of 32 along K): the per-pair products read each
    expert's rows of the storage; against the dequantized stacks."""
    gen = torch.Generator().manual_seed(7)
    experts, top_k, hidden, inter = 6, 2, 64, 32
    x = torch.randn(3, hidden, generator=gen).to(DTYPE)
    gate_up, gate_up_ref = quantized((torch.randn(experts * 2 * inter, hidden, generator=gen) / 8).to(DTYPE), kind)
    down, down_ref = quantized((torch.randn(experts * hidden, inter, generator=gen) / 6).to(DTYPE), kind)
    chosen = torch.tensor([[5, 0], [2, 3], [0, 5]], dtype=torch.int32)
    weights = torch.rand(3, top_k, generator=gen)
    out = moe.experts(x.to(DEVICE), chosen.to(DEVICE), weights.to(DEVICE), gate_up, down, experts, TABLE)
    assert rel_err(out, reference(x, chosen, weights.to(DTYPE), gate_up_ref, down_ref, experts)) < 1e-2
    # the residual added by the down products' kernel, as adding it afterwards would
    residual = torch.randn(3, hidden, generator=gen).to(DTYPE).to(DEVICE)
    added = moe.experts(x.to(DEVICE), chosen.to(DEVICE), weights.to(DEVICE), gate_up, down, experts, TABLE,
                        residual=residual)
    assert torch.equal(added.cpu(), (out + residual).cpu())
    with pytest.raises(ValueError, match="grouped expert products take weights in the activations' dtype"):
        moe.experts(x.to(DEVICE), chosen.to(DEVICE), weights.to(DEVICE), gate_up, down, experts, per_pair=False)
    if kind == "int4":  # x as int8 a chunk of 32 (the dense GEMV's int8_inputs): within x's rounding of the above
        rounded = moe.experts(x.to(DEVICE), chosen.to(DEVICE), weights.to(DEVICE), gate_up, down, experts,
                              replace(TABLE, int8_inputs=True))
        assert not torch.equal(rounded.cpu(), out.cpu()) and rel_err(rounded, out) < 3e-2  # two roundings: ~1.4e-2
