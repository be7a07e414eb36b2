"""Prompt logprobs through the API, on a live `ferrum serve` of a tiny model (float32, 16-token steps: every
prompt here is a chunked prefill): /v1/completions' echo with logprobs (OpenAI's legacy shape, the first
token's logprob null), pure scoring with max_tokens 0, the request lm-evaluation-harness's
`local-completions` sends and how it parses the answer, vLLM's prompt_logprobs (completions and chat),
streaming echo, the 400s, the openai SDK, and scripts/perplexity.py.

Every value is checked against transformers' log_softmax over the same prompt on the same weights, to
1e-4 (measured: about 1e-6); the weights are spread (0.3) so that ranks and top tokens are well defined.
"""

from __future__ import annotations

import importlib.util
import json
import math
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from ferrum.tokenizer import Tokenizer
from tests.live_server import ROOT, live_server
from tests.tiny_model import DEMO, DEMO_VOCAB, save_hf_model, tiny_config

pytestmark = pytest.mark.slow

MODEL = "tiny"
TOL = 1e-4
TEXT = "The quick brown fox jumps over the lazy dog. It was a sunny day in the old town."
DATA = Path(__file__).resolve().parents[1] / "data" / "perplexity.txt"


def _script(path: Path) -> Any:
    """A script of scripts/ as a module (loaded by path: scripts/ is no package)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up while the class is made
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    if not (DEMO / "tokenizer.json").is_file():
        pytest.skip(f"demo model's tokenizer not prepared at {DEMO}")
    folder = tmp_path_factory.mktemp("prompt-logprobs") / "tiny"
    hf = save_hf_model(folder, tiny_config("llama2-mha", vocab_size=DEMO_VOCAB), spread=0.3, demo_tokenizer=True)
    return folder, hf


@pytest.fixture(scope="module")
def url(tiny: tuple[Path, Any]) -> Iterator[str]:
    with live_server("--model", str(tiny[0]), "--backend", "cpu", "--dtype", "float32", "--served-model-name", MODEL,
                     "--max-model-len", "256", "--max-num-batched-tokens", "16",
                     "--kv-cache-memory-gb", "0.05") as base:
        yield base


@pytest.fixture(scope="module")
def tok(tiny: tuple[Path, Any]) -> Tokenizer:
    return Tokenizer.from_folder(tiny[0])


def reference(tiny: tuple[Path, Any], ids: list[int]) -> torch.Tensor:
    """transformers' log_softmax over the prompt: row p is the distribution of token p + 1."""
    with torch.no_grad():
        return torch.log_softmax(tiny[1](torch.tensor([ids])).logits[0].float(), dim=-1)


def own_logprobs(ref: torch.Tensor, ids: list[int]) -> list[float]:
    return ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()


def post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body, timeout=120)


def completion(url: str, **body: Any) -> dict[str, Any]:
    r = post(url, "/v1/completions", {"model": MODEL, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def close(got: list[float | None], want: list[float]) -> bool:
    return len(got) == len(want) and all(g is not None and abs(g - w) < TOL for g, w in zip(got, want, strict=True))


def test_echo_with_logprobs_gives_the_prompt_then_the_completion(url: str, tiny: tuple[Path, Any],
                                                                 tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    n = len(ids)
    ref = reference(tiny, ids)
    body = completion(url, prompt=TEXT, echo=True, logprobs=2, max_tokens=3, ignore_eos=True)
    plain = completion(url, prompt=TEXT, logprobs=2, max_tokens=3, ignore_eos=True)["choices"][0]
    choice = body["choices"][0]
    assert choice["text"] == TEXT + plain["text"]
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"]) == n + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"][0] == tok.id_to_token_text(ids[0])
    assert close(lp["token_logprobs"][1:n], own_logprobs(ref, ids))
    for p in range(1, n):
        top = ref[p - 1].topk(2)
        want = {tok.id_to_token_text(i): v for i, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)}
        assert all(abs(lp["top_logprobs"][p][t] - v) < TOL for t, v in want.items())
        assert set(lp["top_logprobs"][p]) == set(want) | {lp["tokens"][p]}
    assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
    # the completion's part is the plain request's, its offsets counted in the echoed text
    assert lp["tokens"][n:] == plain["logprobs"]["tokens"]
    assert lp["token_logprobs"][n:] == plain["logprobs"]["token_logprobs"]
    assert lp["text_offset"][n:] == [len(TEXT) + o for o in plain["logprobs"]["text_offset"]]
    assert body["usage"] == {"prompt_tokens": n, "completion_tokens": 3, "total_tokens": n + 3}


def test_max_tokens_0_only_scores(url: str, tiny: tuple[Path, Any], tok: Tokenizer) -> None:
    prompts = [tok.encode(TEXT), tok.encode("Once upon a time, in a land far away, there lived a king.")]
    body = completion(url, prompt=prompts, echo=True, logprobs=0, max_tokens=0)
    assert body["usage"]["completion_tokens"] == 0
    for choice, ids in zip(sorted(body["choices"], key=lambda c: c["index"]), prompts, strict=True):
        assert choice["text"] == tok.decode(ids) and choice["finish_reason"] == "length"
        assert len(choice["logprobs"]["tokens"]) == len(ids)
        assert close(choice["logprobs"]["token_logprobs"][1:], own_logprobs(reference(tiny, ids), ids))
    # echo without logprobs: the prompt's text alone
    assert completion(url, prompt=TEXT, echo=True, max_tokens=0)["choices"][0]["text"] == TEXT


def test_lm_evaluation_harness_local_completions_request(url: str, tiny: tuple[Path, Any], tok: Tokenizer) -> None:
    """What lm_eval/models/openai_completions.py (LocalCompletionsAPI) sends for loglikelihood requests and
    how its parse_logprobs reads the answer: sum(token_logprobs[ctxlen:-1]), greedy when every
    continuation token's logprob is the max of its top_logprobs."""
    context = tok.encode("Question: what colour is the sky on a clear day? Answer:")
    continuations = [tok.encode(" blue"), tok.encode(" a deep shade of green")]
    inputs = [context + c for c in continuations]
    payload = {"model": MODEL, "prompt": inputs, "temperature": 0, "max_tokens": 1, "logprobs": 1, "seed": 1234,
               "echo": True}
    r = post(url, "/v1/completions", payload)
    assert r.status_code == 200, r.text
    ctxlen = len(context)
    for choice, ids in zip(sorted(r.json()["choices"], key=lambda c: c["index"]), inputs, strict=True):
        token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
        top_logprobs = choice["logprobs"]["top_logprobs"][ctxlen:-1]
        assert len(token_logprobs) == len(ids) - ctxlen
        ref = reference(tiny, ids)
        want = own_logprobs(ref, ids)[ctxlen - 1 :]
        assert abs(sum(token_logprobs) - sum(want)) < TOL * len(want)
        is_greedy = all(t == max(top.values()) for t, top in zip(token_logprobs, top_logprobs, strict=True))
        ref_greedy = all(int(ref[p - 1].argmax()) == ids[p] for p in range(ctxlen, len(ids)))
        assert is_greedy == ref_greedy


def test_vllm_prompt_logprobs(url: str, tiny: tuple[Path, Any], tok: Tokenizer) -> None:
    ids = tok.encode(TEXT)
    ref = reference(tiny, ids)
    choice = completion(url, prompt=ids, max_tokens=1, prompt_logprobs=3)["choices"][0]
    got = choice["prompt_logprobs"]
    assert len(got) == len(ids) and got[0] is None
    for p in range(1, len(ids)):
        row, own = ref[p - 1], float(ref[p - 1][ids[p]])
        entry = {int(k): v for k, v in got[p].items()}
        assert abs(entry[ids[p]]["logprob"] - own) < TOL
        # the reference's rank outside near-ties within TOL (tests/engine/test_prompt_scoring.py's check_against)
        assert int((row > own + TOL).sum()) + 1 <= entry[ids[p]]["rank"] <= max(int((row >= own - TOL).sum()), 1)
        assert entry[ids[p]]["decoded_token"] == tok.id_to_token_text(ids[p])
        top = row.topk(3)
        for rank, (i, v) in enumerate(zip(top.indices.tolist(), top.values.tolist(), strict=True), start=1):
            assert entry[i]["rank"] == rank and abs(entry[i]["logprob"] - v) < TOL
        assert set(entry) == set(top.indices.tolist()) | {ids[p]}
    assert choice["logprobs"] is None  # prompt_logprobs alone: no OpenAI-shaped logprobs
    assert "prompt_logprobs" not in completion(url, prompt=ids, max_tokens=1)["choices"][0]
    # chat: one list for the request, over the templated prompt
    r = post(url, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi there"}],
                                           "max_tokens": 1, "prompt_logprobs": 0})
    assert r.status_code == 200, r.text
    chat = r.json()
    assert len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"] and chat["prompt_logprobs"][0] is None
    assert all(len(entry) == 1 for entry in chat["prompt_logprobs"][1:])


def _stream(url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    chunks = []
    with httpx.stream("POST", f"{url}/v1/completions", json={"model": MODEL, "temperature": 0, "stream": True, **body},
                      timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[len("data: "):]))
    return chunks


def test_echo_streams_the_prompt_first(url: str, tok: Tokenizer) -> None:
    n = len(tok.encode(TEXT))
    whole = completion(url, prompt=TEXT, echo=True, logprobs=1, max_tokens=4, ignore_eos=True)["choices"][0]
    chunks = [c["choices"][0] for c in _stream(url, {"prompt": TEXT, "echo": True, "logprobs": 1, "max_tokens": 4,
                                                     "ignore_eos": True})]
    assert chunks[0]["text"] == TEXT and len(chunks[0]["logprobs"]["tokens"]) == n
    assert chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["text"] for c in chunks) == whole["text"]
    joined = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert joined == whole["logprobs"]["tokens"]
    offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert offsets == whole["logprobs"]["text_offset"]
    scoring = [c["choices"][0] for c in _stream(url, {"prompt": TEXT, "echo": True, "max_tokens": 0})]
    assert [c["text"] for c in scoring] == [TEXT, ""] and scoring[-1]["finish_reason"] == "length"


@pytest.mark.parametrize("body, param", [
    ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": "all"}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"echo": True, "logprobs": 21}, "logprobs"),
    ({"echo": True, "logprobs": 1, "prompt_logprobs": 30}, "prompt_logprobs"),
    ({"max_tokens": 0}, "max_tokens"),
])
def test_bad_values_are_400(url: str, body: dict[str, Any], param: str) -> None:
    r = post(url, "/v1/completions", {"model": MODEL, "prompt": "hello", "max_tokens": 1, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    chat = post(url, "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                              "prompt_logprobs": 99})
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "prompt_logprobs"


def test_openai_sdk_scoring_and_the_perplexity_it_gives(url: str, tiny: tuple[Path, Any], tok: Tokenizer) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    out = client.completions.create(model=MODEL, prompt=TEXT, echo=True, logprobs=1, max_tokens=0)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.token_logprobs[0] is None
    scored = [v for v in lp.token_logprobs[1:] if v is not None]
    ids = tok.encode(TEXT)
    assert len(scored) == len(ids) - 1
    want = own_logprobs(reference(tiny, ids), ids)
    ppl = math.exp(-sum(scored) / len(scored))
    assert math.isfinite(ppl) and abs(ppl / math.exp(-sum(want) / len(want)) - 1) < 1e-4


def test_perplexity_script(url: str, tiny: tuple[Path, Any], tok: Tokenizer,
                           capsys: pytest.CaptureFixture[str]) -> None:
    script = _script(ROOT / "scripts" / "perplexity.py")
    ids = tok.encode(DATA.read_text(encoding="utf-8"))
    assert len(ids) > 256  # more than one window of the served context
    nll = 0.0
    plan = script.windows(len(ids), 128, 64)
    for w in plan:
        part = ids[w.start : w.end]
        nll -= sum(own_logprobs(reference(tiny, part), part)[-w.scored :])
    assert sum(w.scored for w in plan) == len(ids) - 1
    assert script.main(["--url", url, "--file", str(DATA), "--max-tokens-per-request", "128", "--stride", "64",
                        "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["tokens"] == len(ids) - 1 and got["requests"] == len(plan)
    assert abs(got["mean_nll"] - nll / (len(ids) - 1)) < TOL
    assert math.isfinite(got["perplexity"]) and abs(math.log(got["perplexity"]) - got["mean_nll"]) < 1e-9
    # by default: windows of the served context (less one), half overlapping; printed for people
    assert script.main(["--url", url, "--file", str(DATA)]) == 0
    assert "perplexity:" in capsys.readouterr().out
