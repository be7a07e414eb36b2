"""`ferrum bench serve`: the workload against a running server, once per concurrency level."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from ferrum.bench.client import Target, send
from ferrum.bench.errors import BenchError
from ferrum.bench.metrics import LevelResult, RequestRecord, summarize
from ferrum.bench.progress import RequestProgress
from ferrum.bench.workload import BenchRequest, WorkloadSpec, make_workload, prompt_token_pool, warmup_request
from ferrum.tokenizer import Tokenizer


@dataclass(frozen=True)
class ServeOptions:
    url: str
    workload: WorkloadSpec
    concurrency: tuple[int, ...] = (1, 16, 64)
    request_rate: float = math.inf  # requests/s, Poisson arrivals; inf: all at once
    model: str | None = None  # default: the first model the server lists
    tokenizer: str | None = None  # a model folder with tokenizer.json; default: `model` if it is one
    timeout_s: float = 3600.0  # per request

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be at least 1, got {self.concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be positive (or inf), got {self.request_rate}")


@dataclass(frozen=True)
class LevelRun:
    result: LevelResult
    records: tuple[RequestRecord, ...]


@dataclass(frozen=True)
class ServeResult:
    url: str
    model: str
    max_model_len: int
    tokenizer: str
    workload: WorkloadSpec
    request_rate: float
    levels: tuple[LevelRun, ...]


def _tokenizer_folder(options: ServeOptions, model: str) -> Path:
    for candidate in (options.tokenizer, options.model, model):
        if candidate and (Path(candidate) / "tokenizer.json").is_file():
            return Path(candidate)
    if options.tokenizer:
        raise BenchError(f"--tokenizer {options.tokenizer}: no tokenizer.json in that folder")
    raise BenchError(
        f"prompts are drawn from the model's vocabulary: pass --tokenizer FOLDER, a local copy of the "
        f"served model ({model}) holding tokenizer.json"
    )


async def _served_model(session: aiohttp.ClientSession, base_url: str, wanted: str | None) -> tuple[str, int]:
    """The model to ask for and its max_model_len, from /v1/models."""
    try:
        async with session.get(f"{base_url}/v1/models") as response:
            if response.status != 200:
                raise BenchError(f"GET {base_url}/v1/models answered HTTP {response.status}")
            cards: list[dict[str, Any]] = (await response.json())["data"]
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise BenchError(f"cannot reach {base_url}: {exc}") from None
    if not cards:
        raise BenchError(f"{base_url}/v1/models lists no model")
    names = [str(card["id"]) for card in cards]
    name = wanted if wanted is not None else names[0]
    for card in cards:
        if card["id"] == name:
            return name, int(card.get("max_model_len") or 0)
    raise BenchError(f"the server does not serve {name!r}; it serves {', '.join(names)}")


def _arrival_gaps(count: int, rate: float, seed: int) -> list[float]:
    """Seconds to wait before each request: exponential gaps (a Poisson process), or none at rate inf."""
    if math.isinf(rate):
        return [0.0] * count
    return [float(g) for g in np.random.default_rng([seed, 2]).exponential(1.0 / rate, size=count)]


async def _run_level(
    session: aiohttp.ClientSession, target: Target, requests: Sequence[BenchRequest], concurrency: int,
    rate: float, seed: int,
) -> LevelRun:
    slots = asyncio.Semaphore(concurrency)
    progress = RequestProgress(len(requests), f"concurrency {concurrency}")

    async def one(request: BenchRequest) -> RequestRecord:
        async with slots:
            record = await send(session, target, request)
        progress.advance()
        return record

    tasks: list[asyncio.Task[RequestRecord]] = []
    started = time.perf_counter()
    with progress:
        for request, gap in zip(requests, _arrival_gaps(len(requests), rate, seed), strict=True):
            if gap > 0:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(request)))
        records = await asyncio.gather(*tasks)
    duration = time.perf_counter() - started
    return LevelRun(summarize(records, duration, concurrency, rate), tuple(records))


async def run_serve(options: ServeOptions) -> ServeResult:
    base_url = options.url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=options.timeout_s, sock_connect=30)
    connector = aiohttp.TCPConnector(limit=max(options.concurrency))
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        model, max_model_len = await _served_model(session, base_url, options.model)
        if max_model_len and options.workload.longest_request > max_model_len:
            raise BenchError(
                f"the longest request may need {options.workload.longest_request} tokens (input "
                f"{options.workload.input_len.high} + output {options.workload.output_len.high}); the "
                f"server's max_model_len is {max_model_len}: lower --input-len / --output-len"
            )
        folder = _tokenizer_folder(options, model)
        pool = prompt_token_pool(Tokenizer.from_folder(folder))
        target = Target(base_url, model, options.workload.ignore_eos)
        probe = await send(session, target, warmup_request(options.workload, pool))
        if not probe.ok:
            raise BenchError(f"the warm-up request failed: {probe.error}")
        levels = []
        for index, concurrency in enumerate(options.concurrency):
            requests = make_workload(options.workload, pool, round_index=index)
            levels.append(await _run_level(session, target, requests, concurrency, options.request_rate,
                                           options.workload.seed))
    return ServeResult(base_url, model, max_model_len, str(folder), options.workload, options.request_rate,
                       tuple(levels))
