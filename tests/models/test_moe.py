"""Mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral) against HF transformers, float32, on tiny
random-weight models: logits through the paged path (CPU, and the GPU path's Triton kernels, interpreted
without a GPU) for a whole prompt, a chunk after cached tokens and decodes in one mixed batch; the
router's choices token by token; greedy outputs through the engine with the prefix cache on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from ferrum.engine.block_manager import BlockManager
from ferrum.engine.sampling_params import SamplingParams
from ferrum.engine.scheduler import ScheduledSequence
from ferrum.engine.sequence import Sequence
from ferrum.models.config import load_model_config
from ferrum.models.errors import ModelConfigError
from ferrum.models.layers import layer_ops
from ferrum.models.layers.mlp import GatedMLP
from ferrum.models.layers.moe import MoE, plain_experts
from ferrum.models.layers.parallel import ShardingError
from ferrum.models.layers.quantized_linear import QuantizedExperts
from ferrum.models.loader import load_model
from ferrum.weights.loader import WeightLoader
from ferrum.weights.locations.model_files import local_weights
from ferrum.weights.quantization.scheme import QuantizationConfig
from ferrum.weights.spec.loader_config import WeightLoaderConfig
from tests.engines import host_device, load_test_model, local_engine, make_runner
from tests.models.test_models_vs_hf import fused_decode_error
from tests.tiny_model import MOE_FAMILIES, save_hf_model, tiny_config
from tests.triton_interpreter import gpu_path_device

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

ATOL = 1e-5  # float32 logits against HF's: measured 3e-8 to 4e-8
NEAR_TIE = 1e-4  # two experts' router probabilities this close may order either way


@pytest.fixture(scope="module", params=MOE_FAMILIES)
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    folder = Path(tmp_path_factory.mktemp(request.param))
    return save_hf_model(folder, tiny_config(request.param), demo_tokenizer=True), folder


def _hf_last(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0, -1].float()


@pytest.mark.parametrize("path", ["cpu", "triton-eager"])
def test_logits_match_hf_in_a_mixed_batch(pair, path: str) -> None:
    hf, folder = pair
    device = host_device() if path == "cpu" else gpu_path_device()
    ours = load_test_model(folder, device, torch.float32)
    runner = make_runner(ours, device, 64, 8, enforce_eager=True)
    blocks = BlockManager(num_blocks=64, block_size=8)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 512, (n,), generator=g).tolist() for n in (29, 6, 50)]
    seqs = [Sequence(f"r{i}", p, SamplingParams(max_tokens=4), 0.0) for i, p in enumerate(prompts)]

    def run(plan: list[tuple[Sequence, int]]) -> dict[str, torch.Tensor]:
        for seq, n in plan:
            blocks.grow(seq, seq.num_computed_tokens + n)
        logits, done = runner.execute([ScheduledSequence(s, n) for s, n in plan])
        return {s.request_id: row.cpu() for s, row in zip(done, logits, strict=True)}

    worst = 0.0
    got = run([(seqs[0], 29), (seqs[1], 6), (seqs[2], 20)])  # two whole prompts, a first chunk
    for s in seqs[:2]:
        worst = max(worst, (got[s.request_id] - _hf_last(hf, s.prompt_token_ids)).abs().max().item())
        s.output_token_ids.append(int(got[s.request_id].argmax()))
    got = run([(seqs[0], 1), (seqs[1], 1), (seqs[2], 30)])  # two decodes beside a chunk after 20 cached tokens
    for s in seqs:
        worst = max(worst, (got[s.request_id] - _hf_last(hf, s.tokens(0, s.num_tokens))).abs().max().item())
    print(f"{folder.name} {path}: largest logit difference {worst:.2e}")
    assert worst < ATOL


def test_fused_decode_chain_matches_hf(pair) -> None:
    """The GPU's few-row decode chain (interpreted without a GPU), each MoE layer through the router's kernel
    (the block's norm inside it) and the experts' kernels per pair: two sequences over one step against HF."""
    worst = fused_decode_error(pair[0], pair[1], steps=1)
    print(f"{pair[1].name}: largest logit difference {worst:.2e}")
    assert worst < ATOL


def test_router_chooses_hfs_experts_with_hfs_weights(pair) -> None:
    hf, folder = pair
    ours = load_test_model(folder, host_device(), torch.float32)
    layer = next(i for i, m in enumerate(ours.layers) if isinstance(m.mlp, MoE))
    moe = ours.layers[layer].mlp
    assert isinstance(moe, MoE)
    hf_block = hf.model.layers[layer].mlp if hasattr(hf.model.layers[layer], "mlp") else None
    hf_router = (hf_block or hf.model.layers[layer].block_sparse_moe).gate
    x = torch.randn(64, moe.hidden, generator=torch.Generator().manual_seed(5))
    chosen, weights = moe.route(x)
    with torch.no_grad():
        _, ref_weights, ref_chosen = hf_router(x)
    probs = torch.softmax(x @ moe.gate.weight.T, dim=-1).sort(dim=-1, descending=True).values
    k = moe.moe.top_k
    ties = (probs[:, k - 1] - probs[:, k]).abs() < NEAR_TIE  # the k-th and the next are a near-tie
    print(f"{folder.name}: {int(ties.sum())} of 64 tokens at a near-tie")
    for t in range(64):
        if ties[t]:
            continue
        assert set(chosen[t].tolist()) == set(ref_chosen[t].tolist()), t
        order = ref_chosen[t].argsort()
        torch.testing.assert_close(weights[t][chosen[t].argsort()], ref_weights[t][order].float(), atol=1e-6,
                                   rtol=1e-5)


# the experts' outputs from quantized stacks against the same experts' dequantized weights (rounding order
# only), and the model's logits against the unquantized model's (the quantization's own error: measured 0.004
# int8, 0.017 fp8, 0.05 int4 at logits of about 1)
QUANTIZED_LOGIT_BOUND = {"int8": 0.02, "fp8": 0.06, "int4": 0.2}


@pytest.mark.parametrize("method", ["int8", "fp8", "int4"])
def test_quantized_experts_against_their_dequantized_weights(pair, method: str) -> None:
    """Quantization on load takes the expert stacks too (int4 in groups of 32): each MoE layer's output equals
    its experts run on the stacks' dequantized rows, and the logits stay near the unquantized model's."""
    _check_quantized_experts(pair[1], method, "cpu")


@pytest.mark.parametrize("method", ["int8", "fp8", "int4"])
def test_quantized_experts_through_the_gpu_kernels(method: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """The same on the GPU path (interpreted without a GPU; one family: the kernels are the same for all):
    the per-pair kernels read the chosen experts' rows of the quantized stacks as they lie."""
    folder = Path(tmp_path_factory.getbasetemp()) / "qwen3-moe-quantized"
    if not (folder / "config.json").exists():
        save_hf_model(folder, tiny_config("qwen3-moe"))
    _check_quantized_experts(folder, method, "triton-eager")


def _check_quantized_experts(folder: Path, method: str, path: str) -> None:
    device = host_device() if path == "cpu" else gpu_path_device()
    loader = WeightLoader(WeightLoaderConfig(cache_enabled=False, progress="off"))
    quantization = QuantizationConfig(method, 32)
    ours = load_model(load_model_config(folder), local_weights(folder), device, torch.float32, layer_ops(device),
                      loader, quantization=quantization)[0]
    plain = load_test_model(folder, device, torch.float32)
    moe = next(m.mlp for m in ours.layers if isinstance(m.mlp, MoE))
    assert isinstance(moe.experts_gate_up, QuantizedExperts) and isinstance(moe.experts_down, QuantizedExperts)
    # interpreted: 2 tokens take the per-pair products (a program per token, expert and 2 outputs), 9 the
    # grouped ones over the stacks dequantized
    for rows in ((5,) if path == "cpu" else (2, 9)):
        x = torch.randn(rows, moe.hidden, generator=torch.Generator().manual_seed(2)).to(device.torch_device)
        want = plain_experts(moe, x)  # dequantized rows, expert by expert
        got = moe(x)
        if moe.shared_expert is not None and moe.shared_expert_gate is not None:
            got = got - torch.sigmoid(moe.shared_expert_gate(x)) * moe.shared_expert(x)
        # the GPU kernels' int8/int4 planes sum float32 products of x with 2^16 + q (2^8 + q), less x times the
        # offsets after (read in chunks: once a chunk of 16 int8 inputs): exact in bf16's terms, about 1e-4 of
        # the output in float32's (int8 in chunks 1.2e-4, int4 9e-6)
        bound = 1e-5 if path == "cpu" or rows > 2 else 2e-4
        assert ((got.cpu() - want.cpu()).norm() / want.norm()).item() < bound
    if path != "cpu":
        return  # the whole model's logits: on the CPU path (interpreted, a prefill takes minutes)
    runner_q = make_runner(ours, device, 16, 8, enforce_eager=True)
    runner_p = make_runner(plain, device, 16, 8, enforce_eager=True)
    prompt = torch.randint(0, 512, (19,), generator=torch.Generator().manual_seed(4)).tolist()
    logits = []
    for runner in (runner_q, runner_p):
        seq = Sequence("q", prompt, SamplingParams(max_tokens=2), 0.0)
        BlockManager(num_blocks=16, block_size=8).grow(seq, len(prompt))
        logits.append(runner.execute([ScheduledSequence(seq, len(prompt))])[0][0].cpu())
    worst = (logits[0] - logits[1]).abs().max().item()
    print(f"{folder.name} {method} {path}: logits within {worst:.3f} of the unquantized model's")
    assert worst < QUANTIZED_LOGIT_BOUND[method]


def test_dense_layers_where_the_config_says(tmp_path: Path) -> None:
    folder = tmp_path / "qwen3-moe"
    save_hf_model(folder, tiny_config("qwen3-moe"))  # mlp_only_layers=[1]
    ours = load_test_model(folder, host_device(), torch.float32)
    assert [type(layer.mlp) for layer in ours.layers] == [MoE, GatedMLP, MoE]


@pytest.mark.parametrize("backend", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the GPU's decode graphs and fused chain: needs CUDA"))])
def test_greedy_outputs_match_hf_through_the_engine(pair, backend: str) -> None:
    """Two prompts sharing a 24-token prefix, one after the other: the second reads the first's cached
    blocks (the prefix cache on). On the GPU its decodes run in CUDA graphs, one row through the fused chain."""
    hf, folder = pair
    engine = local_engine(folder, backend=backend, dtype="float32", max_model_len=128, kv_cache_memory_gb=0.01,
                          block_size=8, max_num_seqs=4)
    g = torch.Generator().manual_seed(9)
    prefix = torch.randint(0, 512, (24,), generator=g).tolist()
    prompts = [prefix + torch.randint(0, 512, (n,), generator=g).tolist() for n in (5, 11)]
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    got = [engine.generate([p], params)[0] for p in prompts]
    assert engine.stats().prefix_cache_hits > 0
    engine.release()
    for prompt, tokens in zip(prompts, got, strict=True):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, min_new_tokens=10)
        assert tokens == ref[0, len(prompt):].tolist()


def test_two_ranks_match_one_process(pair) -> None:
    """Tensor parallelism on gloo: each rank holds every expert's half of the intermediate dimension (and of
    the shared expert's); the same greedy tokens and logits as one process."""
    _, folder = pair
    settings: dict[str, Any] = dict(dtype="float32", max_model_len=128, kv_cache_memory_gb=0.01)
    prompts = [[5, 17, 42, 7, 99, 3, 250, 11, 64, 8, 301, 2, 77], [400, 1, 2, 3]]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)

    def run(engine) -> tuple[list[list[int]], list[float]]:
        try:
            for i, p in enumerate(prompts):
                engine.add_request(str(i), p, params)
            tokens: dict[str, list[int]] = {"0": [], "1": []}
            logprobs: list[float] = []
            while engine.has_work:
                for out in engine.step():
                    tokens[out.request_id] += out.new_token_ids
                    logprobs += [lp.logprob for lp in out.new_logprobs or ()]
            return [tokens["0"], tokens["1"]], logprobs
        finally:
            engine.release()

    want_tokens, want_lp = run(local_engine(folder, **settings))
    got_tokens, got_lp = run(local_engine(folder, tensor_parallel_size=2, **settings))
    assert got_tokens == want_tokens
    assert max(abs(a - b) for a, b in zip(got_lp, want_lp, strict=True)) < 1e-4


def test_an_expert_size_the_ranks_do_not_divide_is_refused(tmp_path: Path) -> None:
    folder = tmp_path / "mixtral"
    save_hf_model(folder, tiny_config("mixtral", intermediate_size=45), demo_tokenizer=True)
    with pytest.raises(ShardingError, match="tensor_parallel_size=2 does not divide the model's 45"):
        local_engine(folder, dtype="float32", tensor_parallel_size=2, kv_cache_memory_gb=0.01)


def test_a_published_quantized_mixture_of_experts_is_refused_by_name(tmp_path: Path) -> None:
    folder = tmp_path / "qwen3-moe-fp8"
    save_hf_model(folder, tiny_config("qwen3-moe"), demo_tokenizer=True)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelConfigError, match=r"qwen3-moe-fp8/config.json: a fp8 quantized mixture of experts "
                                               r"\(Qwen3MoeForCausalLM\): published quantized experts are not served"):
        load_model_config(folder)
