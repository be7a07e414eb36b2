"""Prompt logprobs in the engine (SamplingParams.prompt_logprobs): the step plan scores every prompt
position once (chunks, recomputes after preemption, tensor-parallel workers' mirrors), and the engine's
values, ranks and top tokens equal a plain transformers forward pass over the prompt, on the CPU runner,
chunked or not, with the prefix cache, under preemption, and on the GPU runner's path (interpreted).

The model: tiny random Llama weights spread wide enough (0.3) that its distributions are peaked
(top-5 logprob gaps above 1e-3), so that ranks and top tokens are well defined; float32 throughout.
Tolerance on logprobs: 1e-4 (measured: about 1e-6).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch

from ferrum.engine.config import EngineConfig
from ferrum.engine.llm_engine import LLMEngine
from ferrum.engine.outputs import RequestOutput, TokenLogprob
from ferrum.engine.parallel.mirror import mirror, snapshot
from ferrum.engine.runner import pack_step
from ferrum.engine.sampling_params import SamplingParams, SamplingParamsError
from ferrum.engine.scheduler import ScheduledSequence
from ferrum.engine.sequence import Sequence
from ferrum.models.attention.layout import KVCacheLayout
from ferrum.models.config import load_model_config
from ferrum.weights.locations.model_files import ModelFiles, local_weights
from ferrum.weights.spec.sources import File
from tests.engines import local_engine
from tests.tiny_model import DEMO_VOCAB, save_hf_model, tiny_config
from tests.triton_interpreter import gpu_path_device

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

TOL = 1e-4
TEXT = "The quick brown fox jumps over the lazy dog. It was a sunny day in the old town, and the market was busy."


@dataclasses.dataclass(frozen=True)
class Tiny:
    folder: Path
    hf: Any  # the transformers model of the same weights, float32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    folder = tmp_path_factory.mktemp("prompt-scoring") / "tiny"
    hf = save_hf_model(folder, tiny_config("llama2-mha", vocab_size=DEMO_VOCAB), spread=0.3, demo_tokenizer=True)
    return Tiny(folder, hf)


@pytest.fixture(scope="module")
def engine(tiny: Tiny) -> LLMEngine:
    return local_engine(tiny.folder, dtype="float32", kv_cache_memory_gb=0.02, max_model_len=256)


@pytest.fixture(scope="module")
def prompt(engine: LLMEngine) -> list[int]:
    ids = engine.tokenizer.encode(TEXT)
    assert len(ids) > 20
    return ids


def reference(tiny: Tiny, prompt: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits over the prompt: row p is the distribution of token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(tiny.hf(torch.tensor([prompt])).logits[0].float(), dim=-1)


def check_against(ref: torch.Tensor, prompt: list[int], got: tuple[TokenLogprob | None, ...], top_k: int) -> None:
    assert len(got) == len(prompt) and got[0] is None
    for p, lp in enumerate(got[1:], start=1):
        assert lp is not None and lp.token_id == prompt[p]
        row = ref[p - 1]
        want = float(row[prompt[p]])
        assert abs(lp.logprob - want) < TOL, (p, lp.logprob, want)
        # the rank is the reference's where no other token's logprob lies within TOL of this one's; in a
        # near-tie (the flat tail of a 49k vocabulary) either order is right (an AVX2 EPYC's float32 kernels
        # put one token of 49,152 on the other side: rank 44414 against 44415)
        assert lp.rank is not None
        assert int((row > want + TOL).sum()) + 1 <= lp.rank <= max(int((row >= want - TOL).sum()), 1)
        values, ids = row.topk(top_k)
        assert [t.token_id for t in lp.top] == ids.tolist()
        assert max(abs(t.logprob - v) for t, v in zip(lp.top, values.tolist(), strict=True)) < TOL if top_k else True


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict[str, list[RequestOutput]]:
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    outs: dict[str, list[RequestOutput]] = {rid: [] for rid in requests}
    while engine.has_work:
        for out in engine.step():
            outs[out.request_id].append(out)
    return outs


def prompt_logprobs_of(outs: list[RequestOutput]) -> tuple[TokenLogprob | None, ...]:
    sent = [out.prompt_logprobs for out in outs if out.prompt_logprobs is not None]
    assert len(sent) == 1, "prompt logprobs come exactly once"
    assert outs[0].prompt_logprobs is not None, "with the first output"
    return sent[0]


# -- the plan -------------------------------------------------------------------------------------------


def _scheduled(seq: Sequence, n: int) -> list[ScheduledSequence]:
    seq.block_table = list(range(8))
    return [ScheduledSequence(seq, n)]


def test_chunks_and_recomputes_plan_each_prompt_position_once() -> None:
    layout = KVCacheLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32, block_size=16)
    prompt = list(range(100, 140))  # 40 tokens: 39 to score, positions 0..38
    seq = Sequence("s", prompt, SamplingParams(max_tokens=4, prompt_logprobs=2), 0.0)
    scored: list[int] = []
    for n in (16, 16, 8):  # three chunks; the last position (39) is the sampled one
        plan = pack_step(_scheduled(seq, n), layout)
        for owner, rows in plan.prompt_rows:
            assert owner is seq and rows.token_ids == prompt[rows.start : rows.start + len(rows.token_ids)]
            assert rows.first_row == rows.start - 1 - seq.num_computed_tokens and rows.top_k == 2
            scored += range(rows.start, rows.start + len(rows.token_ids))
            seq.num_prompt_scored = rows.start + len(rows.token_ids) - 1  # what score_prompts records
        seq.num_computed_tokens += n
    assert scored == list(range(1, 40)) and not seq.scores_prompt
    # preempted mid-prompt and recomputed from 0: what was scored is not planned again
    seq.num_computed_tokens, seq.num_prompt_scored = 0, 20
    plan = pack_step(_scheduled(seq, 32), layout)
    [(_, rows)] = plan.prompt_rows
    assert (rows.first_row, rows.start, len(rows.token_ids)) == (20, 21, 12)
    # nobody asks: nothing planned
    plain = Sequence("p", prompt, SamplingParams(max_tokens=4), 0.0)
    assert pack_step(_scheduled(plain, 40), layout).prompt_rows == []


def test_a_tensor_parallel_worker_plans_the_same_rows() -> None:
    layout = KVCacheLayout(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32, block_size=16)
    seq = Sequence("s", list(range(100, 140)), SamplingParams(max_tokens=4, prompt_logprobs=3), 0.0)
    seq.num_computed_tokens, seq.num_prompt_scored, seq.block_table = 16, 16, list(range(8))
    lead = pack_step([ScheduledSequence(seq, 16)], layout)
    worker = pack_step([ScheduledSequence(mirror(snapshot(seq)), 16)], layout)
    assert [rows for _, rows in worker.prompt_rows] == [rows for _, rows in lead.prompt_rows]
    assert worker.step == lead.step


def test_out_of_range_prompt_logprobs_are_refused() -> None:
    for bad in (-1, SamplingParams.MAX_LOGPROBS + 1):
        with pytest.raises(SamplingParamsError) as err:
            SamplingParams(prompt_logprobs=bad)
        assert err.value.param == "prompt_logprobs"


# -- the engine -----------------------------------------------------------------------------------------


def test_prompt_logprobs_equal_a_forward_pass_whole_and_chunked(tiny: Tiny, engine: LLMEngine,
                                                                prompt: list[int]) -> None:
    ref = reference(tiny, prompt)
    scored = SamplingParams(max_tokens=3, temperature=0, prompt_logprobs=5, ignore_eos=True)
    plain = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    outs = run(engine, {"scored": (prompt, scored), "plain": (prompt[:9], plain)})  # batched with one that asks none
    check_against(ref, prompt, prompt_logprobs_of(outs["scored"]), 5)
    assert all(out.prompt_logprobs is None for out in outs["plain"])
    alone = run(engine, {"alone": (prompt[:9], plain)})["alone"]
    assert [t for o in alone for t in o.new_token_ids] == [t for o in outs["plain"] for t in o.new_token_ids]

    chunked = local_engine(tiny.folder, dtype="float32", kv_cache_memory_gb=0.02, max_model_len=256,
                           max_num_batched_tokens=8)
    only_own = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0)
    got = prompt_logprobs_of(run(chunked, {"c": (prompt, only_own)})["c"])
    check_against(ref, prompt, got, 0)
    assert all(lp is None or lp.top == () for lp in got)
    # a one-token prompt has nothing to score
    assert prompt_logprobs_of(run(chunked, {"one": (prompt[:1], only_own)})["one"]) == (None,)


def test_scored_prompts_skip_the_prefix_cache_but_fill_it(tiny: Tiny, engine: LLMEngine, prompt: list[int]) -> None:
    assert engine.block_manager.enable_prefix_caching
    params = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
    run(engine, {"warm": (prompt, SamplingParams(max_tokens=1, temperature=0))})  # its blocks are now cached
    hits = engine.stats().prefix_cache_hits
    got = prompt_logprobs_of(run(engine, {"scored": (prompt, params)})["scored"])
    assert engine.stats().prefix_cache_hits == hits, "a prompt to score must compute every position"
    check_against(reference(tiny, prompt), prompt, got, 1)
    run(engine, {"after": (prompt, SamplingParams(max_tokens=1, temperature=0))})
    assert engine.stats().prefix_cache_hits > hits  # a plain request reuses the blocks as before


def test_preempted_requests_still_score_each_prompt_token_once(tiny: Tiny, prompt: list[int]) -> None:
    config = load_model_config(tiny.folder)
    layout = KVCacheLayout.of(config, torch.float32, 16)
    blocks = 6  # 96 tokens: too few for both requests to run to their end together
    small = local_engine(tiny.folder, dtype="float32", block_size=16, max_model_len=96, max_num_batched_tokens=16,
                         kv_cache_memory_gb=(blocks + 0.5) * layout.bytes_per_block / 2**30)
    assert small.stats().kv_blocks_total == blocks
    long = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, prompt_logprobs=2)
    outs = run(small, {"a": (prompt, long), "b": (prompt[::-1], long)})
    assert small.stats().num_preemptions > 0
    for rid, ids in (("a", prompt), ("b", prompt[::-1])):
        check_against(reference(tiny, ids), ids, prompt_logprobs_of(outs[rid]), 2)
        assert sum(len(o.new_token_ids) for o in outs[rid]) == 40


def test_the_gpu_runner_path_scores_the_same(tiny: Tiny, prompt: list[int]) -> None:
    files = ModelFiles(File(tiny.folder), tiny.folder, local_weights(tiny.folder), complete=True)
    config = EngineConfig(dtype="float32", max_model_len=64, kv_cache_memory_gb=0.01, max_num_seqs=2,
                          max_num_batched_tokens=16, block_size=8)
    gpu_path = LLMEngine(config, gpu_path_device(), files)
    assert gpu_path.attention.name == "triton_paged"
    ids = prompt[:12]  # one step: the interpreter is slow
    got = run(gpu_path, {"g": (ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=3))})["g"]
    check_against(reference(tiny, ids), ids, prompt_logprobs_of(got), 3)


def test_two_tensor_parallel_ranks_score_the_same(tiny: Tiny, prompt: list[int]) -> None:
    """The head is a collective under tensor parallelism: the worker replays the scoring calls (or hangs)."""
    split = local_engine(tiny.folder, dtype="float32", kv_cache_memory_gb=0.01, max_model_len=64,
                         max_num_batched_tokens=16, tensor_parallel_size=2)
    try:
        ids = prompt[:30]
        got = run(split, {"tp": (ids, SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=2))})["tp"]
        check_against(reference(tiny, ids), ids, prompt_logprobs_of(got), 2)
    finally:
        split.release()
