"""Ferrum's decoder against HF transformers, fp32, on tiny random-weight models of each family.

Every forward goes through the real paged path (a runner + BlockManager), on the CPU path (torch
layers and attention) and the GPU path (Triton layers and attention, interpreted without a GPU):
whole-prompt prefill, chunked prefill, batched decode and mixed batches.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ferrum.engine.block_manager import BlockManager
from ferrum.engine.sampling_params import SamplingParams
from ferrum.engine.scheduler import ScheduledSequence
from ferrum.engine.sequence import Sequence
from tests.engines import host_device, load_test_model, make_runner
from tests.tiny_model import FAMILIES, save_hf_model, tiny_config
from tests.triton_interpreter import gpu_path_device

transformers = pytest.importorskip("transformers")

# Max abs error allowed between Ferrum's and HF's fp32 logits. Observed values are
# around 1e-7 (5e-8 to 1e-7 on the families below); the bound leaves room for other reduction orders.
ATOL = 1e-5


@pytest.fixture(scope="module", params=FAMILIES)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    """HF's model of the family (float32, the reference) and the folder it was saved to."""
    folder = Path(tmp_path_factory.mktemp(request.param))
    hf = save_hf_model(folder, tiny_config(request.param))
    return hf, folder


def _ours(folder: Path, kind: str):
    """Our model and the device it runs on: the CPU path, or the GPU path (Triton kernels for the
    layers and attention; interpreted without a GPU)."""
    device = host_device() if kind == "cpu" else gpu_path_device()
    return load_test_model(folder, device, torch.float32), device


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def _seq(i: int, tokens: list[int]) -> Sequence:
    return Sequence(f"r{i}", list(tokens), SamplingParams(max_tokens=8), 0.0)


def _run(runner, blocks: BlockManager, plan: list[tuple[Sequence, int]]) -> dict[str, torch.Tensor]:
    for seq, n in plan:
        blocks.grow(seq, seq.num_computed_tokens + n)
    logits, seqs = runner.execute([ScheduledSequence(s, n) for s, n in plan])
    return {s.request_id: row.cpu() for s, row in zip(seqs, logits, strict=True)}


@pytest.mark.parametrize("runner_kind", ["cpu", "triton-eager"])
def test_prefill_chunked_prefill_and_decode_match_hf(pair, runner_kind: str) -> None:
    hf, folder = pair
    ours, device = _ours(folder, runner_kind)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (37, 5, 70)]
    blocks = BlockManager(num_blocks=64, block_size=8)
    runner = make_runner(ours, device, 64, 8, enforce_eager=True)
    seqs = [_seq(i, p) for i, p in enumerate(prompts)]

    worst = 0.0
    # step 1: seq0 whole prompt, seq1 whole prompt, seq2 first chunk only (mixed prefill batch)
    got = _run(runner, blocks, [(seqs[0], 37), (seqs[1], 5), (seqs[2], 30)])
    assert set(got) == {"r0", "r1"}
    for s in seqs[:2]:
        worst = max(worst, (got[s.request_id] - _hf_logits(hf, s.prompt_token_ids)[-1]).abs().max().item())
    # step 2: seq2's second chunk beside seq0/seq1 decodes -- but first they need their next token
    for s in seqs[:2]:
        s.output_token_ids.append(int(got[s.request_id].argmax()))
    got = _run(runner, blocks, [(seqs[0], 1), (seqs[1], 1), (seqs[2], 40)])
    assert set(got) == {"r0", "r1", "r2"}
    seqs[2].output_token_ids.append(int(got["r2"].argmax()))
    worst = max(worst, (got["r2"] - _hf_logits(hf, prompts[2])[-1]).abs().max().item())
    # steps 3..8: batched greedy decode of all three, each step checked against HF on the full text
    for _ in range(6):
        for s in seqs[:2]:
            ref = _hf_logits(hf, s.prompt_token_ids + s.output_token_ids)[-1]
            worst = max(worst, (got[s.request_id] - ref).abs().max().item())
            s.output_token_ids.append(int(got[s.request_id].argmax()))
        got = _run(runner, blocks, [(s, 1) for s in seqs])
        if "r2" in got:
            ref = _hf_logits(hf, seqs[2].prompt_token_ids + seqs[2].output_token_ids)[-1]
            worst = max(worst, (got["r2"] - ref).abs().max().item())
            seqs[2].output_token_ids.append(int(got["r2"].argmax()))
    print(f"max abs logit error {worst:.2e}")
    assert worst < ATOL, f"max abs logit error {worst:.2e}"


def test_greedy_generation_matches_hf(pair) -> None:
    hf, folder = pair
    ours, device = _ours(folder, "cpu")
    prompt = list(range(3, 20))
    blocks = BlockManager(num_blocks=32, block_size=4)
    runner = make_runner(ours, device, 32, 4)
    seq = _seq(0, prompt)
    got = _run(runner, blocks, [(seq, len(prompt))])
    for _ in range(12):
        seq.output_token_ids.append(int(got["r0"].argmax()))
        got = _run(runner, blocks, [(seq, 1)])
    seq.output_token_ids.append(int(got["r0"].argmax()))
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=13, do_sample=False)[0, len(prompt) :].tolist()
    assert seq.output_token_ids == ref


def test_fused_small_batch_decode_matches_hf(pair) -> None:
    """The few-row decode path (each projection one fused GEMV kernel, split attention), run in
    Triton's interpreter without a GPU: logits of two sequences over four steps against HF."""
    worst = fused_decode_error(pair[0], pair[1], steps=4)
    print(f"max abs logit error {worst:.2e}")
    assert worst < ATOL, f"max abs logit error {worst:.2e}"


def fused_decode_error(hf, folder: Path, steps: int) -> float:
    """The largest logit difference from HF's of two sequences decoded `steps` steps through the fused
    decode chain (ferrum.models.fused_decode), after a prefill through the eager path."""
    ours, device = _ours(folder, "triton-eager")
    runner = make_runner(ours, device, 64, 8, enforce_eager=True)
    from ferrum.kernels.config import KernelConfig
    from ferrum.models.fused_decode import FusedDecode

    fused = FusedDecode(ours, KernelConfig(), pdl=False)
    blocks = BlockManager(num_blocks=64, block_size=8)
    g = torch.Generator().manual_seed(5)
    seqs = [_seq(i, torch.randint(0, 512, (n,), generator=g).tolist()) for i, n in enumerate((21, 9))]
    got = _run(runner, blocks, [(s, s.num_tokens) for s in seqs])  # prefill, eager path
    worst = 0.0
    for _ in range(steps):
        for s in seqs:
            s.output_token_ids.append(int(got[s.request_id].argmax()))
            blocks.grow(s, s.num_computed_tokens + 1)
        pos = [s.num_computed_tokens for s in seqs]
        width = max(len(s.block_table) for s in seqs)
        tables = torch.tensor([s.block_table + [0] * (width - len(s.block_table)) for s in seqs], dtype=torch.int32)
        dev = device.torch_device
        batch = runner.attention.decode_graph_inputs(
            torch.tensor(pos, device=dev),
            torch.tensor([runner.layout.slot(s.block_table, p) for s, p in zip(seqs, pos, strict=True)], device=dev),
            tables.to(dev), torch.tensor([p + 1 for p in pos], dtype=torch.int32, device=dev), ours.rotary,
        )
        ids = torch.tensor([s.token_at(p) for s, p in zip(seqs, pos, strict=True)], device=dev)
        logits = fused.logits(ids, runner.kv_caches, batch).cpu()
        got = {}
        for s, row in zip(seqs, logits, strict=True):
            s.num_computed_tokens += 1
            got[s.request_id] = row
            ref = _hf_logits(hf, s.prompt_token_ids + s.output_token_ids)[-1]
            worst = max(worst, (row - ref).abs().max().item())
    return worst
