"""Perplexity of a text file through a running server's /v1/completions, from the prompt logprobs.

    python scripts/perplexity.py --url http://127.0.0.1:8000 --file tests/data/perplexity.txt

The text is tokenized by the server (/tokenize), then scored in windows of at most
--max-tokens-per-request tokens (default: the served model's context less one) that start --stride
tokens apart (default: half a window), each window a request with echo, logprobs 0 and max_tokens 0
(a pure scoring request) over its token ids. Each token is scored once, by the first window that
holds it past that window's overlap with the one before (so every token but the text's first has
context; from the second window on, at least window - stride tokens of it), as in Hugging Face's
sliding-window perplexity. Prints the tokens scored, the mean negative log-likelihood (nats) and the
perplexity, exp(mean NLL); --json prints them as one JSON object instead.

Standard library only, so that it runs wherever the server's URL can be reached.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

Post = Callable[[str, dict[str, Any]], dict[str, Any]]


@dataclass(frozen=True)
class Window:
    start: int  # the window's first token
    end: int  # one past its last
    scored: int  # its last `scored` tokens are the ones it scores


@dataclass(frozen=True)
class Perplexity:
    tokens: int  # tokens scored
    requests: int
    mean_nll: float  # nats per token
    perplexity: float


def windows(num_tokens: int, size: int, stride: int) -> list[Window]:
    """Windows of at most `size` tokens every `stride` tokens, each scoring the tokens that the ones
    before it did not (the text's first token is never scored: it has no context)."""
    if size < 2 or not 1 <= stride < size:  # a window's first token has no context: the one before scores it
        raise ValueError(f"need a window of at least 2 tokens and 1 <= stride < window, got {size} and {stride}")
    out: list[Window] = []
    done = 1  # tokens [0, done) are scored or unscorable
    start = 0
    while done < num_tokens:
        end = min(start + size, num_tokens)
        out.append(Window(start, end, end - done))
        done = end
        start += stride
    return out


def http_post(base_url: str, api_key: str | None = None, timeout_s: float = 600.0) -> Post:
    def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        request = urllib.request.Request(base_url.rstrip("/") + path, json.dumps(body).encode(), headers)
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                result: dict[str, Any] = json.loads(response.read())
                return result
        except urllib.error.HTTPError as exc:
            raise SystemExit(f"{path}: HTTP {exc.code}: {exc.read().decode(errors='replace')}") from None

    return post


def http_get(base_url: str, path: str, api_key: str | None = None) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    with urllib.request.urlopen(urllib.request.Request(base_url.rstrip("/") + path, headers=headers)) as response:
        result: dict[str, Any] = json.loads(response.read())
        return result


def window_logprobs(post: Post, model: str | None, token_ids: list[int]) -> list[float | None]:
    """The prompt logprobs of one window (None for its first token), as the API returns them."""
    body: dict[str, Any] = {"prompt": token_ids, "max_tokens": 0, "echo": True, "logprobs": 0, "temperature": 0}
    if model:
        body["model"] = model
    choice = post("/v1/completions", body)["choices"][0]
    logprobs: list[float | None] = choice["logprobs"]["token_logprobs"]
    if len(logprobs) != len(token_ids):
        raise SystemExit(f"the server returned {len(logprobs)} logprobs for a {len(token_ids)}-token prompt")
    return logprobs


def perplexity(post: Post, model: str | None, token_ids: list[int], size: int, stride: int) -> Perplexity:
    nll = 0.0
    plan = windows(len(token_ids), size, stride)
    for window in plan:
        logprobs = window_logprobs(post, model, token_ids[window.start : window.end])
        for value in logprobs[len(logprobs) - window.scored :]:
            if value is None:
                raise SystemExit("a scored token has no logprob (only a window's first token may lack one)")
            nll -= value
    count = sum(w.scored for w in plan)
    if not count:
        raise SystemExit("the text has fewer than 2 tokens: nothing to score")
    return Perplexity(count, len(plan), nll / count, math.exp(nll / count))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--model", default=None, help="the model name to send (default: the served model)")
    parser.add_argument("--file", type=Path, required=True, help="the text to score (UTF-8)")
    parser.add_argument("--max-tokens-per-request", type=int, default=None,
                        help="window size in tokens (default: the served max_model_len - 1)")
    parser.add_argument("--stride", type=int, default=None, help="tokens between window starts (default: half)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--json", action="store_true", help="print the result as one JSON object")
    args = parser.parse_args(argv)

    post = http_post(args.url, args.api_key)
    size = args.max_tokens_per_request
    if size is None:
        card = http_get(args.url, "/v1/models", args.api_key)["data"][0]
        size = int(card["max_model_len"]) - 1  # the engine samples one token after the prompt
    stride = args.stride or max(1, size // 2)
    if size < 2 or not 1 <= stride < size:
        parser.error(f"need --max-tokens-per-request >= 2 and 1 <= --stride < it, got {size} and {stride}")
    body: dict[str, Any] = {"prompt": args.file.read_text(encoding="utf-8")}
    if args.model:
        body["model"] = args.model
    token_ids: list[int] = post("/tokenize", body)["tokens"]
    result = perplexity(post, args.model, token_ids, size, stride)
    if args.json:
        print(json.dumps({**asdict(result), "window": size, "stride": stride}))
    else:
        print(f"tokens:      {result.tokens} ({len(token_ids)} in the text, {result.requests} requests of at most "
              f"{size} tokens, stride {stride})")
        print(f"mean NLL:    {result.mean_nll:.6f} nats/token")
        print(f"perplexity:  {result.perplexity:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
