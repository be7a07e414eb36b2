"""Sliding-window attention in the paged KV cache, against HF transformers (float32, tiny random-weight
models): a Mistral-style model with a 16-token window on every layer (its blocks behind the window given
back as a sequence advances) and a Qwen2-style model whose upper layers alone have a window (every block
kept). Prompts of 100 tokens and 100 generated: logits step by step through each attention path (the plain
torch path, the CPU kernels, the GPU path's Triton kernels interpreted without a GPU), greedy outputs
through the engine with the prefix cache on, and the blocks each sequence holds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from ferrum.engine.block_manager import FREED, BlockManager
from ferrum.engine.sampling_params import SamplingParams
from ferrum.engine.scheduler import ScheduledSequence
from ferrum.engine.sequence import Sequence
from ferrum.models.config import load_model_config
from tests.engines import host_device, load_test_model, local_engine, make_runner
from tests.tiny_model import save_hf_model, tiny_config
from tests.triton_interpreter import gpu_path_device

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

WINDOW, BLOCK = 16, 8
ATOL = 1e-4  # float32 logits against HF's


@pytest.fixture(scope="module")
def mistral(tmp_path_factory: pytest.TempPathFactory):
    folder = Path(tmp_path_factory.mktemp("mistral-window"))
    return save_hf_model(folder, tiny_config("mistral", sliding_window=WINDOW), demo_tokenizer=True), folder


@pytest.fixture(scope="module")
def qwen2_upper(tmp_path_factory: pytest.TempPathFactory):
    """Qwen2 with use_sliding_window: layers from max_window_layers (1) on have the window, layer 0 not."""
    folder = Path(tmp_path_factory.mktemp("qwen2-window"))
    config = tiny_config("qwen2-qkv-bias", use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1)
    return save_hf_model(folder, config, demo_tokenizer=True), folder


def _prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_windows_read_from_the_config(mistral, qwen2_upper, tmp_path: Path) -> None:
    assert load_model_config(mistral[1]).uniform_window == WINDOW
    qwen = load_model_config(qwen2_upper[1])
    assert [qwen.layer_window(i) for i in range(3)] == [None, WINDOW, WINDOW] and qwen.uniform_window is None
    folder = tmp_path / "no-window"  # transformers' layer_types decide where config.json lists them
    folder.mkdir()
    raw = json.loads((mistral[1] / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**raw, "layer_types": ["full_attention"] * 3}))
    assert load_model_config(folder).sliding_window is None


@pytest.mark.parametrize("path", ["torch", "cpu-kernels", "triton-eager"])
def test_logits_match_hf_step_by_step_with_blocks_given_back(mistral, path: str) -> None:
    """A 100-token prompt in chunks of 40, then 100 decodes (24 interpreted) beside a second sequence's
    prefill: every step's logits against HF's over the whole sequence so far, the blocks behind the window
    given back (their table entries FREED) before each step, so no path may read them."""
    hf, folder = mistral
    device = gpu_path_device() if path == "triton-eager" else host_device()
    ours = load_test_model(folder, device, torch.float32)
    runner = _runner(ours, device, path)
    blocks = BlockManager(num_blocks=64, block_size=BLOCK, window=WINDOW)
    seq = Sequence("a", _prompt(100, 1), SamplingParams(max_tokens=100), 0.0)
    other = Sequence("b", _prompt(37, 2), SamplingParams(max_tokens=1), 0.0)

    def step(plan: list[tuple[Sequence, int]]) -> dict[str, torch.Tensor]:
        for s, n in plan:
            blocks.release_before_window(s)
            blocks.grow(s, s.num_computed_tokens + n)
            if n == 1:  # a decode: the window's keys and its own, in at most this many blocks
                assert BlockManager.held(s) <= WINDOW // BLOCK + 1
        logits, done = runner.execute([ScheduledSequence(s, n) for s, n in plan])  # (moves them on)
        return {s.request_id: row.cpu() for s, row in zip(done, logits, strict=True)}

    worst = 0.0
    step([(seq, 40)])
    step([(seq, 40)])
    plan = [(seq, 20)]
    decodes = 24 if path == "triton-eager" else 100  # interpreted: 5 s a step
    for i in range(decodes):
        got = step(plan)
        want = _hf_last(hf, seq.tokens(0, seq.num_tokens))
        worst = max(worst, (got["a"] - want).abs().max().item())
        if i == 10:  # the other's whole prompt in the same step as a decode
            worst = max(worst, (got["b"] - _hf_last(hf, other.prompt_token_ids)).abs().max().item())
        seq.output_token_ids.append(int(got["a"].argmax()))
        plan = [(seq, 1), (other, 37)] if i == 9 else [(seq, 1)]
    assert seq.block_table[: (seq.num_computed_tokens - WINDOW) // BLOCK] == [FREED] * (
        (seq.num_computed_tokens - WINDOW) // BLOCK)
    print(f"{path}: largest logit difference {worst:.2e}")
    assert worst < ATOL


def _runner(ours, device, path: str):
    if path != "cpu-kernels":
        return make_runner(ours, device, 64, BLOCK, enforce_eager=True)
    from ferrum.kernels.cpu.build import compiler, load_cpu_kernels

    if compiler() is None:
        pytest.skip("no C++ compiler to build the CPU kernels with")
    load_cpu_kernels(Path("~/.cache/ferrum/kernels").expanduser())
    from ferrum.engine.config import EngineConfig
    from ferrum.engine.model_rank import runner_for
    from ferrum.models.attention import select_attention
    from ferrum.models.attention.layout import KVCacheLayout

    layout = KVCacheLayout.of(ours.config, torch.float32, BLOCK)
    config = EngineConfig(block_size=BLOCK).for_device(device)
    attention = select_attention(device, layout, config.kernels, cpu_kernels=True)
    assert attention.name == "cpu_paged"
    return runner_for(ours, device, layout, 64, attention, config, 256)


def _hf_last(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1].float()


GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="the GPU's decode graphs and fused chain: needs CUDA")


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=GPU)])
@pytest.mark.parametrize("model", ["mistral", "qwen2_upper"])
def test_greedy_outputs_match_hf_through_the_engine(model: str, backend: str, request: pytest.FixtureRequest) -> None:
    """Three 100-token prompts, 100 tokens each, run together; two share their first 48 tokens (the prefix
    cache on). With a window on every layer a decoding sequence holds at most the window's blocks and one
    more; with a layer that sees everything it holds them all. max_model_len is the model's, not the window."""
    hf, folder = request.getfixturevalue(model)
    engine = local_engine(folder, backend=backend, dtype="float32", kv_cache_memory_gb=0.01, block_size=BLOCK,
                          max_num_seqs=4)
    assert engine.max_model_len == 256
    shared = _prompt(48, 3)
    prompts = [shared + _prompt(52, 4), _prompt(100, 5), shared + _prompt(52, 6)]
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts[:2]):
        engine.add_request(str(i), p, params)
    got: dict[str, list[int]] = {"0": [], "1": [], "2": []}
    most, added = 0, False
    while engine.has_work:
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
        if len(got["0"]) >= 50 and not added:  # >=: GPU bursts give several tokens a step
            engine.add_request("2", prompts[2], params)
            added = True
        # after a step that decoded (not one that prefilled: a chunk holds its own tokens' blocks)
        most = max([most] + [BlockManager.held(s) for s in engine.scheduler.running if len(s.output_token_ids) > 1])
    assert engine.stats().prefix_cache_hits > 0
    uniform = load_model_config(folder).uniform_window is not None
    # GPU bursts queued back to back hold the blocks grown for up to two bursts ahead of the sequence's count
    ahead = -(-2 * engine.runner.max_burst // BLOCK)
    assert most <= (WINDOW // BLOCK + 1 + ahead if uniform else 200 // BLOCK + ahead), most
    for i, prompt in enumerate(prompts):  # HF's greedy choice over the whole sequence at each step (its
        tokens = list(prompt)  # generate() with min_new_tokens would take EOS out of the choice)
        for _ in range(100):
            tokens.append(int(_hf_last(hf, tokens).argmax()))
        assert got[str(i)] == tokens[len(prompt) :], i
    engine.release()
