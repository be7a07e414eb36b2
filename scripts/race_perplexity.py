#!/usr/bin/env python
"""Perplexity of one text the way llama.cpp's `llama-perplexity` computes it, for each server of the CPU
race (scripts/cpu_race.py): by `llama-perplexity` itself on a GGUF, through a server's prompt logprobs
(Ferrum: /tokenize, then /v1/completions with echo), or in-process with transformers on a model folder.

The method (llama-perplexity's default, perplexity() in tools/perplexity/perplexity.cpp): the text's
tokens (no BOS: the demo model's GGUF says add_bos_token false, and its HF tokenizer adds none either)
are cut into floor(tokens / CTX) chunks of CTX tokens, each chunk evaluated alone from an empty context,
and in each only the tokens CTX/2 + 1 .. CTX - 1 are scored (each with at least CTX/2 tokens of context);
perplexity = exp(mean negative log-likelihood over every scored token). llama-perplexity needs at least
2 x CTX tokens and rounds its context up to a multiple of 256, so CTX must be a multiple of 256.

    python scripts/race_perplexity.py --folder models/SmolLM2-135M-Instruct --text tests/data/perplexity.txt \
        --ctx 256 --dtype bfloat16 float32    # the transformers reference: a JSON list on stdout
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import re
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from perplexity import http_post, window_logprobs  # noqa: E402


class PerplexityError(RuntimeError):
    pass


@dataclass(frozen=True)
class ChunkedPerplexity:
    method: str
    text_tokens: int | None  # the text's tokens as this method tokenized it (None: not reported)
    ctx: int
    chunks: int
    scored_tokens: int
    mean_nll: float | None  # nats per scored token (None: llama-perplexity prints only the perplexity)
    perplexity: float
    token_ids_sha256: str | None = None  # of the token ids, to check that two methods scored the same tokens
    error_estimate: float | None = None  # llama-perplexity's "+/-"


def ids_digest(token_ids: Sequence[int]) -> str:
    return hashlib.sha256(json.dumps(list(token_ids)).encode()).hexdigest()[:16]


def chunk_count(num_tokens: int, ctx: int) -> int:
    """The chunks llama-perplexity evaluates; it refuses a text under 2 x ctx tokens."""
    if ctx < 4 or ctx % 256:
        raise PerplexityError(f"the context must be a multiple of 256 (llama.cpp pads it so), got {ctx}")
    if num_tokens < 2 * ctx:
        raise PerplexityError(f"a context of {ctx} needs at least {2 * ctx} tokens; the text has {num_tokens}")
    return num_tokens // ctx


def scored_per_chunk(ctx: int) -> int:
    return ctx - 1 - ctx // 2


def chunked_nll(logprobs_of_chunk: Sequence[Sequence[float | None]], ctx: int) -> tuple[float, int]:
    """Summed NLL and count over the scored tokens of each chunk's prompt logprobs (entry j: log p(token j |
    tokens before it), entry 0 None)."""
    first = ctx // 2
    nll, count = 0.0, 0
    for logprobs in logprobs_of_chunk:
        if len(logprobs) != ctx:
            raise PerplexityError(f"a chunk of {ctx} tokens came back with {len(logprobs)} logprobs")
        for value in logprobs[first + 1 : ctx]:
            if value is None:
                raise PerplexityError("a scored token has no logprob")
            nll -= value
            count += 1
    return nll, count


def _result(method: str, token_ids: Sequence[int], ctx: int, chunks: int, nll: float, count: int) -> ChunkedPerplexity:
    return ChunkedPerplexity(method, len(token_ids), ctx, chunks, count, nll / count, math.exp(nll / count),
                             ids_digest(token_ids))


# -- through a server's prompt logprobs --------------------------------------------------------------


def api_tokenize(base_url: str, text: str, model: str | None) -> list[int]:
    """Ferrum's /tokenize ({"prompt": text} -> {"tokens": [...]})."""
    body: dict[str, Any] = {"prompt": text}
    if model:
        body["model"] = model
    return list(http_post(base_url)("/tokenize", body)["tokens"])


def api_perplexity(base_url: str, model: str | None, text: str, ctx: int) -> ChunkedPerplexity:
    """The server tokenizes the text; each chunk is one scoring request (echo, logprobs 0, max_tokens 0)."""
    token_ids = api_tokenize(base_url, text, model)
    chunks = chunk_count(len(token_ids), ctx)
    post = http_post(base_url)
    per_chunk = [window_logprobs(post, model, token_ids[i * ctx : (i + 1) * ctx]) for i in range(chunks)]
    nll, count = chunked_nll(per_chunk, ctx)
    return _result("prompt logprobs through the API (/tokenize, /v1/completions echo)", token_ids, ctx, chunks,
                   nll, count)


# -- llama.cpp's llama-perplexity ----------------------------------------------------------------------

_CHUNKS = re.compile(r"calculating perplexity over (\d+) chunks, n_ctx=(\d+)")
_FINAL = re.compile(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)")


def llama_perplexity(exe: str, gguf: Path, text_file: Path, ctx: int, threads: int, log: Path,
                     text_tokens: int | None = None) -> ChunkedPerplexity:
    """Runs `llama-perplexity -m GGUF -f TEXT -c CTX -t THREADS` (its own tokenizer; output kept in `log`)."""
    cmd = [exe, "-m", str(gguf), "-f", str(text_file), "-c", str(ctx), "-t", str(threads)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
    output = done.stdout + done.stderr
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(" ".join(cmd) + "\n" + output)
    chunks, final = _CHUNKS.search(output), _FINAL.search(output)
    if done.returncode or chunks is None or final is None:
        tail = "\n".join(output.splitlines()[-5:])
        raise PerplexityError(f"llama-perplexity exited with {done.returncode} without a final estimate:\n{tail}")
    n_chunks, n_ctx = int(chunks.group(1)), int(chunks.group(2))
    if n_ctx != ctx:
        raise PerplexityError(f"llama-perplexity used n_ctx={n_ctx}, not the {ctx} asked")
    ppl = float(final.group(1))
    return ChunkedPerplexity("llama-perplexity", text_tokens, n_ctx, n_chunks, n_chunks * scored_per_chunk(n_ctx),
                             math.log(ppl), ppl, None, float(final.group(2)))


# -- transformers, in-process --------------------------------------------------------------------------


def hf_perplexity(folder: Path, text: str, ctx: int, dtype: str) -> ChunkedPerplexity:
    """The folder's model and tokenizer under transformers, on the CPU, in `dtype`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    token_ids = list(tokenizer(text)["input_ids"])
    chunks = chunk_count(len(token_ids), ctx)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype)).eval()
    per_chunk: list[list[float | None]] = []
    with torch.inference_mode():
        for i in range(chunks):
            ids = torch.tensor([token_ids[i * ctx : (i + 1) * ctx]])
            logprobs = torch.log_softmax(model(ids).logits[0].float(), dim=-1)
            picked = logprobs[:-1].gather(1, ids[0, 1:, None])[:, 0]
            per_chunk.append([None, *picked.tolist()])
    nll, count = chunked_nll(per_chunk, ctx)
    return _result(f"transformers in-process ({dtype})", token_ids, ctx, chunks, nll, count)


def hf_perplexity_subprocess(folder: Path, text_file: Path, ctx: int, dtypes: Sequence[str]) -> list[ChunkedPerplexity]:
    """hf_perplexity in each dtype, in a child process, so that the race's own process stays small."""
    cmd = [sys.executable, __file__, "--folder", str(folder), "--text", str(text_file), "--ctx", str(ctx),
           "--dtype", *dtypes]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False,
                          env={**_offline_env(), "PYTHONUNBUFFERED": "1"})
    if done.returncode:
        raise PerplexityError(f"the transformers perplexity exited with {done.returncode}: {done.stderr[-800:]}")
    return [ChunkedPerplexity(**fields) for fields in json.loads(done.stdout.strip().splitlines()[-1])]


def _offline_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="llama-perplexity's chunked perplexity under transformers")
    ap.add_argument("--folder", type=Path, required=True)
    ap.add_argument("--text", type=Path, required=True)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--dtype", nargs="+", default=["bfloat16"], choices=["bfloat16", "float32"])
    args = ap.parse_args(argv)
    try:
        text = args.text.read_text(encoding="utf-8")
        results = [hf_perplexity(args.folder, text, args.ctx, dtype) for dtype in args.dtype]
    except PerplexityError as exc:
        print(f"race_perplexity: {exc}", file=sys.stderr)
        return 1
    print(json.dumps([asdict(result) for result in results]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
