"""Speculative decoding (ferrum.engine.speculative) against plain decoding: greedy outputs token for token
(tiny float32 models on the CPU kernels' path and the plain torch path, the demo model in float32, mixed
batches with the prefix cache, tensor parallelism on gloo), with logprobs, stop strings and tokens, max_tokens,
grammars, logit bias, penalties and n > 1 behaving as without; rejection sampling's draws against the
target's distribution (chi-square); seeded runs that repeat; the policy's rule; bad configurations."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ferrum.engine.sampler import sample
from ferrum.engine.sampling_params import SamplingParams, StructuredOutput
from ferrum.engine.sequence import Sequence
from ferrum.engine.speculative.config import SpeculativeConfig
from ferrum.engine.speculative.policy import SpeculationPolicy
from ferrum.engine.speculative.proposer import NgramProposer
from ferrum.engine.speculative.speculator import Speculator
from ferrum.engine.speculative.verify import Draft, Verifier
from ferrum.server.metrics import SPEC_METRIC_NAMES
from tests.engines import local_engine
from tests.tiny_model import DEMO, save_hf_model, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
         "adaptive": False}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = Path(tmp_path_factory.mktemp("spec")) / "llama"
    save_hf_model(folder, tiny_config("llama3.2-gqa-tied-rope-scaling", vocab_size=49152), demo_tokenizer=True)
    return folder


def _prompts() -> list[list[int]]:
    """Prompts that repeat themselves (the n-gram proposer finds matches in them), and one that does not."""
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 512, (12,), generator=g).tolist()
    return [base * 4, torch.randint(0, 512, (30,), generator=g).tolist(), base[:5] * 6, base * 2 + base[:7]]


def _run(engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, Any]:
    """Every prompt at once; each request's tokens, text, logprobs and finish reason."""
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), prompt, p)
    out: dict[str, Any] = {str(i): {"tokens": [], "text": "", "logprobs": [], "finish": None}
                           for i in range(len(prompts))}
    while engine.has_work:
        for delta in engine.step():
            o = out[delta.request_id]
            o["tokens"] += delta.new_token_ids
            o["text"] += delta.new_text
            o["logprobs"] += [(lp.token_id, round(lp.logprob, 4)) for lp in delta.new_logprobs or ()]
            o["finish"] = delta.finish_reason
    return out


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch"])
def test_greedy_outputs_equal_plain_decoding_in_a_mixed_batch(tiny: Path, kernels: bool) -> None:
    """Four requests at once, twice (the second round's prompts hit the prefix cache): the same tokens and
    logprobs with and without speculation, and drafts were verified and kept."""
    prompts = _prompts()
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=1 if i == 0 else None)
              for i, n in enumerate((60, 40, 55, 33))]
    runs = []
    for spec in (None, NGRAM):
        engine = local_engine(tiny, dtype="float32", kv_cache_memory_gb=0.01, block_size=8, speculative_config=spec,
                              kernels={"cpu": kernels})
        runs.append([_run(engine, prompts, params) for _ in range(2)])
        if spec is not None:
            stats = engine.stats()
            assert stats.spec_num_accepted_tokens > 20 and stats.spec_num_drafts > 5
            assert stats.prefix_cache_hits > 0
            assert engine.block_manager.num_used == 0  # every block given back, the refused drafts' too
            assert _exposed(engine) >= SPEC_METRIC_NAMES
        engine.release()
    assert runs[0] == runs[1]


def _exposed(engine) -> set[str]:
    """The metric families /metrics exposes for this engine."""
    from prometheus_client import generate_latest

    from ferrum.server.metrics import ServerMetrics

    metrics = ServerMetrics("m")
    metrics.engine = engine
    text = generate_latest(metrics.registry).decode()
    return {line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")}


def test_stops_limits_grammars_bias_penalties_and_n_as_without(tiny: Path) -> None:
    """Inside an accepted run: a stop string, a stop token, max_tokens, a regex grammar, logit bias, a
    repetition penalty, two sequences of one prompt (a request's n = 2): each as plain decoding gives it."""
    prompts = _prompts()
    base = prompts[0]
    plain = local_engine(tiny, dtype="float32", kv_cache_memory_gb=0.01, block_size=8)
    free = _run(plain, [base], [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)])["0"]
    stop_text = free["text"][len(free["text"]) // 2 :][:3]
    stop_token = free["tokens"][25]
    cases = [
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop=(stop_text,)),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, stop_token_ids=(stop_token,)),
        SamplingParams(max_tokens=7, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=30, temperature=0, structured=StructuredOutput("regex", "[a-z ]{5,40}")),
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, logit_bias=((base[3], 3.0),)),
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),  # n = 2: the server's two sequences
        SamplingParams(max_tokens=30, temperature=0, ignore_eos=True),
    ]
    want = _run(plain, [base] * len(cases), cases)
    plain.release()
    spec = local_engine(tiny, dtype="float32", kv_cache_memory_gb=0.01, block_size=8, speculative_config=NGRAM)
    got = _run(spec, [base] * len(cases), cases)
    assert spec.stats().spec_num_accepted_tokens > 0
    spec.release()
    assert got == want
    assert want["0"]["finish"] == "stop" and want["1"]["finish"] == "stop" and len(want["2"]["tokens"]) == 7


def test_seeded_sampling_repeats_itself(tiny: Path) -> None:
    params = [SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=s, ignore_eos=True) for s in (1, 2)]
    engine = local_engine(tiny, dtype="float32", kv_cache_memory_gb=0.01, block_size=8, speculative_config=NGRAM)
    first, second = (_run(engine, _prompts()[:2], params) for _ in range(2))
    engine.release()
    assert first == second


def _chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """The chi-square test's p-value of `counts` against `probs` (cells expected under 5 pooled)."""
    n = counts.sum()
    expected = probs.double() * n
    big = expected >= 5
    obs = torch.cat([counts.double()[big], counts.double()[~big].sum().reshape(1)])
    exp = torch.cat([expected[big], expected[~big].sum().reshape(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


@pytest.mark.parametrize("rank", [0, 5])  # the draft: the target's most likely first token, or its sixth
def test_rejection_sampling_keeps_the_target_distribution(rank: int) -> None:
    """A 32-token vocabulary, 20,000 draws of the token after a two-token draft, against the target's
    distribution (temperature 0.9, top-p 0.95): each position's chi-square p at least 0.01, with and without
    speculation; the second position checked on the draws that kept the first draft token."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(3, 32, generator=g) * 1.5
    params = SamplingParams(max_tokens=10, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    probs = [_target_probs(logits[i], params) for i in range(3)]
    draft_token = int(probs[0].argsort(descending=True)[rank])
    verifier = Verifier(_PlainOutputs(), _NoGuides())  # type: ignore[arg-type]
    draws = 20_000
    seqs = [Sequence(str(i), [1, 2], params, 0.0, generator=torch.Generator().manual_seed(i)) for i in range(draws)]
    drafts = [Draft(s, [draft_token, 9], logits) for s in seqs]
    verifier.verify(drafts)
    first = torch.bincount(torch.tensor([s.output_token_ids[0] for s in seqs]), minlength=32)
    assert _chi_square_p(first, probs[0]) >= 0.01
    kept = [s for s in seqs if s.output_token_ids[0] == draft_token]
    second = torch.bincount(torch.tensor([s.output_token_ids[1] for s in kept]), minlength=32)
    assert len(kept) > 100 and _chi_square_p(second, probs[1]) >= 0.01
    plain_seqs = [Sequence(str(i), [1, 2], params, 0.0, generator=torch.Generator().manual_seed(i)) for i in
                  range(draws)]
    plain = sample(logits[:1].expand(draws, -1), plain_seqs).token_ids
    assert _chi_square_p(torch.bincount(torch.tensor(plain), minlength=32), probs[0]) >= 0.01


def _target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    probs = torch.softmax(logits / p.temperature, dim=-1)
    ordered, order = probs.sort(descending=True)
    drop = (ordered.cumsum(0) - ordered) >= p.top_p
    probs = probs.clone()
    probs[order[drop]] = 0
    return probs / probs.sum()


class _PlainOutputs:
    """The output processor's append, without a tokenizer (the verifier only appends)."""

    def append(self, seqs: list[Sequence], result: Any) -> None:
        for seq, token in zip(seqs, result.token_ids, strict=True):
            seq.output_token_ids.append(token)


class _NoGuides:
    def start_masks(self, seqs: list[Sequence]) -> None:
        return None


def test_the_demo_model_copies_a_passage_exactly_as_plain_decoding() -> None:
    """Float32, the demo model asked to repeat a passage: the same greedy answer with speculation, most of
    it from accepted drafts."""
    if not (DEMO / "config.json").is_file():
        pytest.skip(f"demo model not prepared at {DEMO}")
    passage = ("The river runs past the old mill, under the stone bridge and through the quiet village, "
               "where the baker opens his shop at six and the church bell rings twice every morning.")
    messages = [{"role": "user", "content": f"Repeat this text exactly, word for word:\n\n{passage}"}]
    outputs = []
    for spec in (None, NGRAM):
        engine = local_engine(DEMO, dtype="float32", kv_cache_memory_gb=0.05, max_model_len=512,
                              speculative_config=spec)
        prompt = engine.tokenizer.encode_chat(messages)
        outputs.append(engine.generate([prompt], SamplingParams(max_tokens=60, temperature=0))[0])
        if spec is not None:
            stats = engine.stats()
            assert stats.spec_num_accepted_tokens >= 20, stats
        engine.release()
    assert outputs[0] == outputs[1]


def test_two_ranks_speculate_as_one_process(tiny: Path) -> None:
    """Tensor parallelism on gloo: the ranks verify the same drafts (every rank's head sees the draft rows)."""
    params = [SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)] * 2
    prompts = _prompts()[:2]
    plain = local_engine(tiny, dtype="float32", kv_cache_memory_gb=0.01, block_size=8)
    want = _run(plain, prompts, params)
    plain.release()
    engine = local_engine(tiny, dtype="float32", kv_cache_memory_gb=0.01, block_size=8, speculative_config=NGRAM,
                          tensor_parallel_size=2)
    try:
        assert _run(engine, prompts, params) == want
        assert engine.stats().spec_num_accepted_tokens > 0
    finally:
        engine.release()


def test_ngram_proposer_takes_the_most_recent_match_of_the_longest_suffix() -> None:
    proposer = NgramProposer(2, 3)
    seq = Sequence("a", [5, 6, 7, 1, 5, 6, 7, 2, 9, 9, 5, 6, 7], SamplingParams(), 0.0)
    assert proposer.propose([seq], [4]) == [[2, 9, 9, 5]]  # "5 6 7" seen at 0 and 4: the one at 4
    other = Sequence("b", [1, 2, 3, 4, 1, 2, 3, 9], SamplingParams(), 0.0)
    assert proposer.propose([other], [3]) == [[]]  # neither "2 3 9" nor "3 9" was seen before
    other.output_token_ids += [1, 2]  # "1 2" (kept incrementally): most recently at 4
    assert proposer.propose([other], [3]) == [[3, 9, 1]]
    assert proposer.propose([other], [0]) == [[]]


def test_the_policy_drafts_where_it_pays() -> None:
    """Flat step cost (memory-bound): the draft positions kept at least 1 time in 10. Cost in proportion to the
    tokens (compute-bound): nothing, even at 97% acceptance. A fixed cost and a small one a token (the CPU's
    small batches): all of a well-accepted draft, none of a poorly accepted one; after 32 refusals one step
    drafts again, after 64 the next time. A step's time is the median of its last five. disable_by_batch_size:
    none from there."""
    seqs = [Sequence(str(i), [1], SamplingParams(), 0.0) for i in range(2)]
    drafts = [[1, 2, 3, 4], [5, 6, 7, 8]]

    def policy(cost: Any, acceptance: float) -> SpeculationPolicy:
        made = SpeculationPolicy(SpeculativeConfig(num_speculative_tokens=4))
        for tokens in range(1, 20):
            made.cost.observe(tokens, cost(tokens))
        for s in seqs:
            s.spec_acceptance = acceptance
        return made

    fresh = SpeculationPolicy(SpeculativeConfig())
    assert fresh.trim(seqs, drafts) == [[], []]  # a plain step first: t(B) is what drafts are weighed against
    fresh.cost.observe(2, 0.010)
    assert fresh.trim(seqs, drafts) == drafts  # t(B + M) not measured yet: this step measures it
    assert policy(lambda t: 0.010, 0.9).trim(seqs, drafts) == drafts
    assert policy(lambda t: 0.010, 0.2).trim(seqs, drafts) == [[1], [5]]  # 0.2^2 is kept less than 1 time in 10
    assert policy(lambda t: 0.010, 0.02).trim(seqs, drafts) == [[], []]
    assert policy(lambda t: 0.005 * t, 0.97).trim(seqs, drafts) == [[], []]
    assert policy(lambda t: 0.010 + 0.001 * t, 0.97).trim(seqs, drafts) == drafts
    assert policy(lambda t: 0.010 + 0.001 * t, 0.2).trim(seqs, drafts) == [[], []]  # 2.7% more: under the margin
    refusing = policy(lambda t: 0.005 * t, 0.97)
    assert all(refusing.trim(seqs, drafts) == [[], []] for _ in range(32))
    assert refusing.trim(seqs, drafts) == drafts  # after 32 refusals one step drafts: t(B + M) measured anew
    assert all(refusing.trim(seqs, drafts) == [[], []] for _ in range(64))  # then it waits twice as long
    assert refusing.trim(seqs, drafts) == drafts
    skipping = policy(lambda t: 0.005 * t, 0.97)  # as the speculator asks: skips first, the proposer if not
    assert skipping.trim(seqs, drafts) == [[], []]
    assert all(skipping.skips(2) for _ in range(31)) and skipping.refusing(2)
    assert not skipping.skips(2) and skipping.trim(seqs, drafts) == drafts  # the retry, at the same count
    assert not skipping.skips(2)  # a step drafted: nothing refused since
    many = [Sequence(str(i), [1], SamplingParams(), 0.0) for i in range(60)]
    wide = policy(lambda t: 0.005 * t, 0.97)
    wide.cost.observe(60, 0.3)
    wide.cost.observe(300, 1.5)
    assert wide.trim(many, [[1, 2, 3, 4]] * 60) == [[]] * 60  # judged at the prior acceptance (0.5)
    small = policy(lambda t: 0.005 * t, 0.97)
    fresh_seqs = [Sequence(str(i), [1], SamplingParams(), 0.0) for i in range(2)]
    assert small.trim(fresh_seqs, drafts) == drafts  # no acceptance known, a small batch: this step measures it
    small.verified(fresh_seqs[0], 4, 4)
    assert small.trim(fresh_seqs, drafts) == [[], []]
    assert wide.refusing(50) and wide.skips(49) and not wide.refusing(40)  # 49..64 share the refusal
    slow_first = policy(lambda t: 0.010, 0.9)
    slow_first.cost.samples.clear()
    for seconds in (0.010, 0.5, 0.011, 0.012):  # one slow step (a first call's set-up) among ordinary ones
        slow_first.cost.observe(10, seconds)
    assert slow_first.cost.estimate(10) == pytest.approx(0.0115)  # the median of the last five
    counting = SpeculationPolicy(SpeculativeConfig())
    counting.verified(seqs[0], 4, 4)  # four positions tried, four kept: the evidence of four
    assert counting.acceptance == pytest.approx(5 / 6) and seqs[0].spec_acceptance == pytest.approx((4 + 5 / 3) / 6)
    counting.verified(seqs[1], 4, 0)  # one position tried, refused
    assert counting.acceptance == pytest.approx((0.9 * 4 + 1) / (0.9 * 4 + 1 + 2))
    capped = SpeculationPolicy(SpeculativeConfig(disable_by_batch_size=8))
    assert capped.allowed(7) and not capped.allowed(8)


def test_the_prior_weighs_drafts_before_any_verify_step_ran() -> None:
    """The device's step times by rows (timed at start-up) stand where no step of that size ran, scaled to the
    steps measured: once a draft has shown the acceptance, 64 sequences on a device where 256 rows take 2.8x
    the time of 64 are judged not worth drafting, and their bursts chain (promising is False); 1 sequence at
    1.1x for 5 tokens is. t(B) not measured: promising, so that a step measures it. A refusal at a size class
    counts each chained burst, and the retry due ends the chain."""
    config = SpeculativeConfig(num_speculative_tokens=4)
    prior = {1: 0.00035, 8: 0.00036, 64: 0.00074, 256: 0.00208}
    policy = SpeculationPolicy(config)
    policy.cost.prior = dict(prior)
    many = [Sequence(str(i), [1], SamplingParams(), 0.0) for i in range(64)]
    assert policy.cost.estimate(256) == pytest.approx(0.00208)  # nothing measured: the prior itself
    assert policy.promising(many, 3)  # t(64) not measured yet: the next step (a plain one) measures it
    policy.cost.observe(64, 0.0013)
    assert policy.cost.estimate(256) == pytest.approx(0.0013 * 0.00208 / 0.00074)  # scaled to the step measured
    assert policy.promising(many, 3) is False  # 64 + 192 rows: 2.8x the time for about 1.9x the tokens (a = 0.5)
    policy.verified(many[0], 4, 3)  # 3 of 4 kept: 0.67 a position
    assert policy.promising(many, 3) is False  # and about 2.4x at 0.67
    assert policy.cost.estimate(32) == pytest.approx(0.0013 * (0.00036 + 0.00038 * 24 / 56) / 0.00074)  # below it too
    assert policy.cost.estimate(48) == pytest.approx(0.0013 * (0.00036 + 0.00038 * 40 / 56) / 0.00074)
    assert policy.trim(many, [[1, 2, 3]] * 64) == [[]] * 64 and policy.refusing(64)
    one = [Sequence("one", [1], SamplingParams(), 0.0)]
    one[0].spec_acceptance = 0.6
    assert policy.promising(one, 4)  # t(1) not measured: the next step measures it
    policy.cost.observe(1, 0.0005)
    assert policy.promising(one, 4)  # 5 tokens: 1.1x the time of one (between the counts measured)
    unknown = SpeculationPolicy(config)
    assert unknown.promising(many, 3)  # no prior (the CPU), nothing measured: the next step measures
    assert all(not policy.promising(many, 3) for _ in range(30))  # chained bursts count as refusals (31 with trim's)
    assert policy.promising(many, 3)  # the 32nd: the retry is due, the chain ends
    assert policy.trim(many, [[1, 2, 3]] * 64) == [[1, 2, 3]] * 64  # and the next step drafts again
    assert not SpeculationPolicy(SpeculativeConfig(disable_by_batch_size=8)).promising(many, 3)


def test_drafts_are_cut_to_the_rows_a_graph_runs() -> None:
    """With verify_rows (the runner's largest graph past the fused chain's), the drafts of a step are cut so
    that its sequences and draft tokens fit: 4 sequences in 10 rows draft 1 token each, in 4 rows none (the
    proposer not asked); without the bound, k (2) each."""
    seqs = [Sequence(str(i), [1, 2, 3, 1, 2, 3, 1, 2], SamplingParams(max_tokens=50), 0.0) for i in range(4)]
    for seq in seqs:
        seq.num_computed_tokens = seq.num_tokens - 1
    config = SpeculativeConfig(num_speculative_tokens=2, adaptive=False)
    asked: list[list[int]] = []

    class Recording(NgramProposer):
        def propose(self, seqs, limits):  # type: ignore[no-untyped-def]
            asked.append(list(limits))
            return super().propose(seqs, limits)

    for rows, drafted in ((0, 2), (10, 1), (4, 0)):
        Speculator(config, 64, Recording(2, 4), verify_rows=rows).prepare(seqs)
        assert [len(seq.draft_token_ids) for seq in seqs] == [drafted] * 4
    assert asked == [[2] * 4, [1] * 4]


@pytest.mark.parametrize(("raw", "message"), [
    ({"method": "eagle3"}, "method 'eagle3' is not one Ferrum runs"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be a positive integer"),
    ({"num_speculative_tokens": 17}, "num_speculative_tokens must be at most 16"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, r"prompt_lookup_min \(5\) is above prompt_lookup_max \(3\)"),
    ({"n_gram": 3}, "unknown speculative_config key"),
    ("{not json", "speculative_config is not JSON"),
])
def test_bad_configurations_are_refused_by_name(raw: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(raw if isinstance(raw, str) else json.dumps(raw))


def test_the_flag_and_the_yaml_section_reach_the_engine(tmp_path: Path) -> None:
    from ferrum.config.loader import ConfigError, load_config

    flag = load_config(None, {"model": "m", "speculative_config": json.dumps({"num_speculative_tokens": 3})}, {})
    assert flag.engine_config().speculative_config == SpeculativeConfig(num_speculative_tokens=3)
    path = tmp_path / "c.yaml"
    path.write_text("model: m\nengine:\n  speculative_config:\n    method: ngram\n    prompt_lookup_max: 5\n")
    assert load_config(path, {}, {}).engine_config().speculative_config == SpeculativeConfig(prompt_lookup_max=5)
    with pytest.raises(ConfigError, match="num_speculative_tokens must be at most 16"):
        load_config(None, {"model": "m", "speculative_config": '{"num_speculative_tokens": 99}'}, {})

