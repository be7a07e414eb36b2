"""The demo model under load: 256 concurrent streams, all greedy outputs equal to the one-at-a-time
ones (float32 activations, quantization auto) but at near-ties, memory flat over three rounds, every KV
block back; and 100 clients that drop mid-stream at random points, after which nothing runs and no KV
block is held.

Near-ties: quantization auto on the CPU keeps an int8 KV cache where the instruction set scores it in
integers (AVX2, AVX512-VNNI). A step's rows are computed the same way alone or in a batch up to the
integer products' dense threshold, but a batch's larger prefill steps take dense products, whose sums
differ from the integer ones by about 1e-5; rounded into the int8 cache, such a difference moves a key
by one step now and then, and a later token's logprob by up to 0.036 nats (measured: 256 requests of these
prompts batched against each alone, 16 tokens each). So a stream may leave the one-at-a-time answer only
where that answer's top two tokens were within NEAR_TIE of each other, the other one taken."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.live_server import MODEL_DIR, ServerProcess, server_process

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (MODEL_DIR / "config.json").is_file(), reason="demo model not prepared"),
]

PROMPTS = [f"Write one sentence about the number {i}." for i in range(16)]
MAX_TOKENS = 16
NEAR_TIE = 0.1  # nats between the reference's first and second token (about 3x the int8 cache's measured drift)


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    with server_process("--model", str(MODEL_DIR), "--backend", "cpu", "--dtype", "float32",
                        "--max-model-len", "512") as s:
        yield s


def request(prompt: str, stream: bool, max_tokens: int = MAX_TOKENS) -> dict[str, object]:
    return {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": stream,
            "logprobs": 2}


def gauges(server: ServerProcess) -> dict[str, float]:
    values = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        for name in ("ferrum_num_requests_running", "ferrum_num_requests_waiting", "ferrum_kv_blocks_used",
                     "ferrum_api_requests_in_flight"):
            if line.startswith(name + "{"):
                values[name] = float(line.rsplit(" ", 1)[1])
    return values


def wait_idle(server: ServerProcess, timeout_s: float) -> float:
    """Seconds until nothing runs, waits or holds a KV block (fails after `timeout_s`)."""
    started = time.monotonic()
    while True:
        g = gauges(server)
        if not any(g.values()):
            return time.monotonic() - started
        if time.monotonic() - started > timeout_s:
            pytest.fail(f"still busy after {timeout_s}s: {g}")
        time.sleep(0.05)


def rss_kib(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


Tokens = list[tuple[str, dict[str, float]]]  # each token with the top two (token -> logprob)


def _tokens(logprobs: dict[str, list]) -> Tokens:
    return list(zip(logprobs["tokens"], logprobs["top_logprobs"], strict=True))


async def _stream_tokens(client: httpx.AsyncClient, url: str, prompt: str) -> Tokens:
    tokens: Tokens = []
    async with client.stream("POST", f"{url}/v1/completions", json=request(prompt, True)) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                tokens += _tokens(event["choices"][0]["logprobs"])
    return tokens


def near_tie_or_equal(reference: Tokens, got: Tokens) -> bool:
    """Equal, or equal up to a token where the reference's runner-up, within NEAR_TIE, was taken."""
    assert len(got) == len(reference) == MAX_TOKENS
    for (ref_token, top), (token, _) in zip(reference, got, strict=True):
        if token != ref_token:
            return token in top and top[ref_token] - top[token] <= NEAR_TIE
    return True


def test_256_concurrent_streams_three_rounds(server: ServerProcess) -> None:
    reference = {}
    for prompt in PROMPTS:  # one at a time
        r = httpx.post(f"{server.url}/v1/completions", json=request(prompt, False), timeout=60)
        reference[prompt] = _tokens(r.json()["choices"][0]["logprobs"])

    async def round_() -> list[Tokens]:
        limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*(_stream_tokens(client, server.url, PROMPTS[i % 16]) for i in range(256)))

    rss = []
    for _ in range(3):
        streams = asyncio.run(round_())
        assert [near_tie_or_equal(reference[PROMPTS[i % 16]], t) for i, t in enumerate(streams)] == [True] * 256
        changed = sum([tok for tok, _ in t] != [tok for tok, _ in reference[PROMPTS[i % 16]]]
                      for i, t in enumerate(streams))
        print(f"{changed} of 256 streams took a near-tie's other token")
        wait_idle(server, 30)  # every KV block back, nothing running or waiting
        rss.append(rss_kib(server.proc.pid))
    print(f"server RSS after rounds 1-3: {[r // 1024 for r in rss]} MiB")
    assert rss[2] <= rss[0] * 1.05, rss


def test_100_clients_dropping_mid_stream_leave_nothing_behind(server: ServerProcess) -> None:
    rng = random.Random(0)
    plan = [rng.randint(0, 24) for _ in range(100)]  # events read before the client goes away

    async def drop(client: httpx.AsyncClient, i: int) -> None:
        async with client.stream("POST", f"{server.url}/v1/completions",
                                 json=request(PROMPTS[i % 16], True, max_tokens=200)) as r:
            assert r.status_code == 200
            seen = 0
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                if seen >= plan[i]:
                    break  # leaving the block closes the connection mid-stream

    async def run() -> None:
        limits = httpx.Limits(max_connections=200, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            await asyncio.gather(*(drop(client, i) for i in range(100)))

    asyncio.run(run())
    took = wait_idle(server, 60)
    print(f"idle {took:.2f} s after the last of 100 clients went away")
    after = httpx.post(f"{server.url}/v1/completions", json=request(PROMPTS[0], False), timeout=60)
    assert after.status_code == 200  # and it serves on
