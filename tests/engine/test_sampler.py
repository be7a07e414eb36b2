"""ferrum.engine.sampler.sample on hand-made logits and real Sequence objects.

Support checks draw thousands of samples in one batched call (one row per draw)
under a fixed global seed, so they are deterministic and fast.
"""

from __future__ import annotations

import math

import pytest
import torch

from ferrum.engine.sampler import sample
from ferrum.engine.sampling_params import SamplingParams
from ferrum.engine.sequence import Sequence

N = 4000  # draws per support / distribution check


def _seq(
    params: SamplingParams, prompt: list[int] | None = None, output: list[int] | None = None
) -> Sequence:
    seq = Sequence("r", list(prompt or [0]), params, 0.0, output_token_ids=list(output or []))
    if params.seed is not None:  # as LLMEngine.add_request does
        seq.generator = torch.Generator().manual_seed(params.seed % 2**64)
    return seq


def _draws(logits: list[float], params: SamplingParams, n: int = N, global_seed: int = 0) -> torch.Tensor:
    """n unseeded draws from one row of logits, as a tensor of token ids."""
    torch.manual_seed(global_seed)
    row = torch.tensor(logits, dtype=torch.float32)
    seq = _seq(params)
    return torch.tensor(sample(row.expand(n, -1).contiguous(), [seq] * n).token_ids)


def _support(logits: list[float], params: SamplingParams) -> set[int]:
    return set(_draws(logits, params).tolist())


def _log(probs: list[float]) -> list[float]:
    return [math.log(p) for p in probs]


# a fixed, unsorted distribution over 8 tokens: token -> probability
PROBS = [0.06, 0.30, 0.02, 0.15, 0.03, 0.40, 0.01, 0.03]
ORDER = sorted(range(8), key=lambda t: -PROBS[t])  # [5, 1, 3, 0, ...]


# --- greedy ----------------------------------------------------------------------------------


def test_greedy_is_argmax_per_row() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 100, generator=g) * 3
    seqs = [_seq(SamplingParams(temperature=0.0)) for _ in range(6)]
    assert sample(logits, seqs).token_ids == logits.argmax(dim=-1).tolist()


def test_greedy_rows_unaffected_by_sampled_rows_in_the_same_batch() -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=g)
    params = [SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0) for i in range(6)]
    out = sample(logits, [_seq(p) for p in params]).token_ids
    for i in range(0, 6, 2):
        assert out[i] == int(logits[i].argmax())
    assert all(0 <= t < 50 for t in out)


def test_top_k_1_equals_greedy() -> None:
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(5, 64, generator=g)
    for row in logits:
        draws = _draws(row.tolist(), SamplingParams(temperature=1.0, top_k=1), n=500)
        assert set(draws.tolist()) == {int(row.argmax())}


# --- top-k / top-p / min-p support ---------------------------------------------------------


@pytest.mark.parametrize("k", [2, 3, 4])
def test_top_k_restricts_support_to_the_k_most_likely(k: int) -> None:
    support = _support(_log(PROBS), SamplingParams(temperature=1.0, top_k=k))
    assert support == set(ORDER[:k])  # nothing outside the top k, and every top-k token reachable


@pytest.mark.parametrize("k", [0, -1, 8, 100])
def test_top_k_off_or_at_least_vocab_keeps_everything(k: int) -> None:
    support = _support(_log(PROBS), SamplingParams(temperature=1.0, top_k=k))
    assert support == set(range(8))


def test_top_p_below_float32_keeps_the_most_likely_token() -> None:
    """1e-300 is 0 in float32: the most likely token stays, the row never turns into NaN."""
    params = SamplingParams(temperature=2.0, top_p=1e-300, top_k=1, min_p=1.0)
    assert _support(_log(PROBS), params) == {ORDER[0]}
    assert _support(_log(PROBS), SamplingParams(temperature=1e-4, top_p=1e-300)) == {ORDER[0]}


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.35, 1),  # 0.40 alone reaches it
        (0.50, 2),  # 0.40 < 0.5 <= 0.70
        (0.69, 2),
        (0.80, 3),  # 0.70 < 0.8 <= 0.85
        (0.88, 4),  # 0.85 < 0.88 <= 0.91
        (0.999, 8),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(top_p: float, kept: int) -> None:
    support = _support(_log(PROBS), SamplingParams(temperature=1.0, top_p=top_p))
    if kept == 8:
        assert support == set(range(8))
    else:
        assert support == set(ORDER[:kept])


def test_top_p_renormalizes_within_the_kept_set() -> None:
    draws = _draws(_log(PROBS), SamplingParams(temperature=1.0, top_p=0.5), n=20000)
    frac = (draws == 5).float().mean().item()  # 0.40 / (0.40 + 0.30)
    assert abs(frac - 0.4 / 0.7) < 0.02, frac


@pytest.mark.parametrize(
    "min_p, kept",
    [
        (0.06, 6),  # threshold 0.024: drops 0.01 and 0.02 -> keeps 0.4 .3 .15 .06 .03 .03
        (0.10, 4),  # 0.04: keeps .4 .3 .15 .06
        (0.30, 3),  # 0.12: keeps .4 .3 .15
        (0.50, 2),  # 0.20: keeps .4 .3
        (0.80, 1),  # 0.32: keeps .4
    ],
)
def test_min_p_drops_tokens_below_min_p_times_max(min_p: float, kept: int) -> None:
    support = _support(_log(PROBS), SamplingParams(temperature=1.0, min_p=min_p))
    expected = {t for t in range(8) if PROBS[t] >= min_p * max(PROBS)}
    assert len(expected) == kept
    assert support == expected


def test_min_p_uses_the_temperature_scaled_distribution() -> None:
    # at temperature 2 the probabilities flatten (p ~ sqrt(PROBS)): min_p=0.5 keeps sqrt(p) >= 0.5 sqrt(0.4)
    support = _support(_log(PROBS), SamplingParams(temperature=2.0, min_p=0.5))
    expected = {t for t in range(8) if math.sqrt(PROBS[t]) >= 0.5 * math.sqrt(0.4)}
    assert expected == {5, 1, 3}
    assert support == expected


# --- temperature ---------------------------------------------------------------------------


def test_low_temperature_is_near_greedy() -> None:
    logits = [0.0, 2.0, 1.8, -1.0, 1.9]
    assert set(_draws(logits, SamplingParams(temperature=0.005)).tolist()) == {1}
    # sanity: at temperature 1 the same logits are not near-greedy
    assert len(set(_draws(logits, SamplingParams(temperature=1.0)).tolist())) == 5


def _chi_square(draws: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(draws, minlength=probs.numel()).double()
    expected = probs.double() * draws.numel()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_empirical_distribution_matches_softmax_of_logits_over_temperature(temperature: float) -> None:
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.5, -1.0])
    draws = _draws(logits.tolist(), SamplingParams(temperature=temperature), n=40000, global_seed=123)
    right = _chi_square(draws, torch.softmax(logits / temperature, dim=0))
    # 5 degrees of freedom: P(chi2 > 30) ~ 1.5e-5, so this bound is loose yet catches real mistakes
    assert right < 30, f"chi-square {right:.1f} against softmax(logits / {temperature})"
    # the same draws are clearly not from the untempered (or wrongly tempered) distribution
    if temperature != 1.0:
        wrong = _chi_square(draws, torch.softmax(logits, dim=0))
        assert wrong > 300, f"chi-square vs untempered distribution only {wrong:.1f}"


# --- seeds ---------------------------------------------------------------------------------


def _seeded_run(seed: int, steps: int = 40, others: int = 0, global_seed: int = 0) -> list[int]:
    """`steps` draws for one seeded sequence, optionally batched with unseeded rows."""
    torch.manual_seed(global_seed)
    seq = _seq(SamplingParams(temperature=1.0, seed=seed))
    logits = torch.zeros(1 + others, 100)  # uniform over 100 tokens
    batch = [seq] + [_seq(SamplingParams(temperature=1.0)) for _ in range(others)]
    out = []
    for _ in range(steps):
        token = sample(logits, batch).token_ids[0]
        seq.output_token_ids.append(token)
        out.append(token)
    return out


def test_same_seed_same_draws() -> None:
    assert _seeded_run(7) == _seeded_run(7)


def test_different_seed_different_draws() -> None:
    a, b = _seeded_run(7), _seeded_run(8)
    assert a != b
    assert sum(x == y for x, y in zip(a, b, strict=True)) < 10  # uniform over 100: agreement is rare


def test_seeded_draws_ignore_batch_neighbours_and_the_global_rng() -> None:
    alone = _seeded_run(99)
    assert _seeded_run(99, others=3, global_seed=5) == alone
    assert _seeded_run(99, others=1, global_seed=6) == alone


def test_seeded_row_in_a_batch_draws_from_its_own_row() -> None:
    # each row puts all mass on a different token: seeded and unseeded rows must pick their own
    logits = torch.full((4, 10), -1e9)
    for i, t in enumerate([3, 7, 1, 9]):
        logits[i, t] = 0.0
    seqs = [_seq(SamplingParams(temperature=1.0, seed=s)) for s in (1, None, 2, None)]
    assert sample(logits, seqs).token_ids == [3, 7, 1, 9]


# --- penalties -----------------------------------------------------------------------------


def _greedy_pick(
    logits: dict[int, float], params: SamplingParams, prompt: list[int], output: list[int]
) -> int:
    row = torch.full((1, 16), -50.0)
    for t, v in logits.items():
        row[0, t] = v
    return sample(row, [_seq(params, prompt, output)]).token_ids[0]


@pytest.mark.parametrize("seen_in", ["prompt", "output"])
def test_repetition_penalty_divides_positive_logits_of_seen_tokens(seen_in: str) -> None:
    prompt, output = ([4], []) if seen_in == "prompt" else ([0], [4])
    params = SamplingParams(temperature=0.0, repetition_penalty=1.6)
    # token 4 (seen) has logit 2.0 -> 2.0 / 1.6 = 1.25; token 9 (unseen) is the rival
    assert _greedy_pick({4: 2.0, 9: 1.3}, params, prompt, output) == 9
    assert _greedy_pick({4: 2.0, 9: 1.2}, params, prompt, output) == 4
    # without the penalty token 4 wins against both rivals
    assert _greedy_pick({4: 2.0, 9: 1.3}, SamplingParams(temperature=0.0), prompt, output) == 4


@pytest.mark.parametrize("seen_in", ["prompt", "output"])
def test_repetition_penalty_multiplies_negative_logits_of_seen_tokens(seen_in: str) -> None:
    prompt, output = ([4], []) if seen_in == "prompt" else ([0], [4])
    params = SamplingParams(temperature=0.0, repetition_penalty=1.6)
    # token 4 (seen) has logit -1.0 -> -1.6 (dividing would give -0.625)
    assert _greedy_pick({4: -1.0, 9: -1.5}, params, prompt, output) == 9
    assert _greedy_pick({4: -1.0, 9: -1.7}, params, prompt, output) == 4


def test_repetition_penalty_counts_a_token_once_and_leaves_unseen_tokens() -> None:
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    # token 4 seen five times still only divided once: 3.0 -> 1.5 (not 3 / 2**5)
    assert _greedy_pick({4: 3.0, 9: 1.4}, params, [4, 4, 4], [4, 4]) == 4
    assert _greedy_pick({4: 3.0, 9: 1.6}, params, [4, 4, 4], [4, 4]) == 9
    # unseen tokens keep their logits: 9 (unseen, 1.6) beats 4 (seen, 3.0 -> 1.5) but 10 (unseen, 1.7) beats 9
    assert _greedy_pick({4: 3.0, 9: 1.6, 10: 1.7}, params, [4], []) == 10


def test_repetition_penalty_below_one_rewards_seen_tokens() -> None:
    params = SamplingParams(temperature=0.0, repetition_penalty=0.5)
    assert _greedy_pick({4: 1.0, 9: 1.9}, params, [4], []) == 4  # 1.0 / 0.5 = 2.0 > 1.9
    assert _greedy_pick({4: 1.0, 9: 2.1}, params, [4], []) == 9


def test_presence_and_frequency_penalties_subtract_the_right_amounts() -> None:
    output = [5, 5, 5, 7]  # token 5 three times, token 7 once
    params = SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.25)
    # token 5: 3.0 - (0.5 + 3 * 0.25) = 1.75
    assert _greedy_pick({5: 3.0, 9: 1.8}, params, [0], output) == 9
    assert _greedy_pick({5: 3.0, 9: 1.7}, params, [0], output) == 5
    # token 7: 3.0 - (0.5 + 1 * 0.25) = 2.25
    assert _greedy_pick({7: 3.0, 9: 2.3}, params, [0], output) == 9
    assert _greedy_pick({7: 3.0, 9: 2.2}, params, [0], output) == 7


def test_presence_penalty_alone_ignores_counts() -> None:
    params = SamplingParams(temperature=0.0, presence_penalty=1.0)
    # token 5 seen 4 times: 3.0 - 1.0 = 2.0 regardless of the count
    assert _greedy_pick({5: 3.0, 9: 1.9}, params, [0], [5, 5, 5, 5]) == 5
    assert _greedy_pick({5: 3.0, 9: 2.1}, params, [0], [5, 5, 5, 5]) == 9


def test_frequency_penalty_alone_scales_with_count() -> None:
    params = SamplingParams(temperature=0.0, frequency_penalty=0.5)
    # token 5 seen 4 times: 3.0 - 4 * 0.5 = 1.0
    assert _greedy_pick({5: 3.0, 9: 1.1}, params, [0], [5, 5, 5, 5]) == 9
    assert _greedy_pick({5: 3.0, 9: 0.9}, params, [0], [5, 5, 5, 5]) == 5


def test_presence_and_frequency_penalties_ignore_prompt_tokens() -> None:
    params = SamplingParams(temperature=0.0, presence_penalty=2.0, frequency_penalty=2.0)
    assert _greedy_pick({5: 3.0, 9: 2.9}, params, [5, 5, 5], []) == 5
    assert _greedy_pick({5: 3.0, 9: 2.9}, params, [5, 5, 5], [1]) == 5


def test_negative_presence_penalty_encourages_repeats() -> None:
    params = SamplingParams(temperature=0.0, presence_penalty=-1.0)
    assert _greedy_pick({5: 2.0, 9: 2.9}, params, [0], [5]) == 5  # 2.0 + 1.0 = 3.0 > 2.9
    assert _greedy_pick({5: 2.0, 9: 3.1}, params, [0], [5]) == 9


def test_penalties_apply_only_to_their_own_row() -> None:
    logits = torch.tensor([[3.0, 2.5], [3.0, 2.5]])
    seqs = [
        _seq(SamplingParams(temperature=0.0, frequency_penalty=1.0), [1], [0]),  # token 0 -> 2.0
        _seq(SamplingParams(temperature=0.0), [1], [0]),
    ]
    assert sample(logits, seqs).token_ids == [1, 0]
    assert logits.tolist() == [[3.0, 2.5], [3.0, 2.5]]  # the caller's logits are not modified


# --- logprobs ------------------------------------------------------------------------------


@pytest.mark.parametrize("n_top", [1, 5, 20])
def test_logprobs_are_those_of_the_raw_logits(n_top: int) -> None:
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 200, generator=g) * 2
    params = [
        SamplingParams(temperature=0.0, logprobs=n_top),
        # penalties and temperature change the sampling distribution, not the reported logprobs
        SamplingParams(
            temperature=0.7, top_k=10, repetition_penalty=1.5, presence_penalty=1.0, logprobs=n_top
        ),
        SamplingParams(temperature=1.3, top_p=0.9, logprobs=n_top, seed=4),
    ]
    seqs = [_seq(p, [1, 2, 3], [int(logits[i].argmax())]) for i, p in enumerate(params)]
    result = sample(logits, seqs)
    ref = torch.log_softmax(logits, dim=-1)
    for i, (token, lp) in enumerate(zip(result.token_ids, result.logprobs, strict=True)):
        assert lp is not None
        chosen, top = lp
        assert chosen == pytest.approx(ref[i, token].item(), abs=1e-6)
        assert len(top) == n_top
        values = [v for _, v in top]
        assert values == sorted(values, reverse=True)
        want_v, want_ids = ref[i].topk(n_top)
        assert [t for t, _ in top] == want_ids.tolist()
        assert values == pytest.approx(want_v.tolist(), abs=1e-6)
    assert result.token_ids[0] == int(logits[0].argmax())
    assert result.logprobs[0] is not None
    assert result.logprobs[0][0] == pytest.approx(ref[0].max().item(), abs=1e-6)


def test_logprobs_zero_gives_the_chosen_token_only_and_none_is_off() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0], [0.0, 1.0, 2.0]])
    seqs = [_seq(SamplingParams(temperature=0.0, logprobs=0)), _seq(SamplingParams(temperature=0.0))]
    result = sample(logits, seqs)
    assert result.logprobs[0] is not None
    chosen, top = result.logprobs[0]
    assert top == []
    assert chosen == pytest.approx(torch.log_softmax(logits[0], 0)[2].item(), abs=1e-6)
    assert result.logprobs[1] is None
    assert sample(logits[1:], seqs[1:]).logprobs == [None]
