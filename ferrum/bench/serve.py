"""`ferrum bench serve`: the workload against a running server, once per concurrency level."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from ferrum.bench.client import ENDPOINTS, Endpoint, Target, send
from ferrum.bench.errors import BenchError
from ferrum.bench.metrics import Acceptance, LevelResult, RequestRecord, summarize
from ferrum.bench.progress import RequestProgress
from ferrum.bench.workload import (
    BenchRequest,
    TokenPool,
    WorkloadSpec,
    make_workload,
    prompt_token_pool,
    warmup_request,
    with_text,
)
from ferrum.tokenizer import Tokenizer

log = logging.getLogger("ferrum.bench")


@dataclass(frozen=True)
class ServeOptions:
    """A serving benchmark: `workload` once per concurrency level, against the server at `url`."""

    url: str
    workload: WorkloadSpec
    concurrency: tuple[int, ...] = (1, 16, 64)
    request_rate: float = math.inf  # requests/s, Poisson arrivals; inf: all at once
    model: str | None = None  # default: the first model the server lists
    tokenizer: str | None = None  # a model folder with tokenizer.json; default: `model` if it is one
    timeout_s: float = 3600.0  # per request
    endpoint: Endpoint = "completions"  # or "chat": /v1/chat/completions with the prompt as text
    requests_per_level: tuple[int, ...] | None = None  # one count per level; default workload.num_prompts
    warmup: bool = True  # send one untimed request first

    def __post_init__(self) -> None:
        if not self.concurrency or min(self.concurrency) < 1:
            raise ValueError(f"concurrency levels must be at least 1, got {self.concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be positive (or inf), got {self.request_rate}")
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        counts = self.requests_per_level
        if counts is not None and (len(counts) != len(self.concurrency) or min(counts) < 1):
            raise ValueError(f"requests_per_level (--requests-per-level) needs one count >= 1 per "
                             f"concurrency level ({len(self.concurrency)}), got {counts}")

    @property
    def level_sizes(self) -> tuple[int, ...]:
        """The number of requests of each level."""
        if self.requests_per_level is not None:
            return self.requests_per_level
        return (self.workload.num_prompts,) * len(self.concurrency)


SPEC_COUNTERS = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total")


def spec_counters(metrics_text: str) -> tuple[float, float, float] | None:
    """The three counters from a Prometheus text page (ferrum_ or vllm: names, labels summed); None when
    the server does not speculate."""
    found: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith("#"):
            continue
        name, _, rest = line.partition(" ")
        base = name.split("{")[0].removeprefix("ferrum_").removeprefix("vllm:")
        if base in SPEC_COUNTERS:
            try:
                found[base] = found.get(base, 0.0) + float(rest.split()[0])
            except (ValueError, IndexError):
                continue
    if len(found) < len(SPEC_COUNTERS):
        return None
    return found[SPEC_COUNTERS[0]], found[SPEC_COUNTERS[1]], found[SPEC_COUNTERS[2]]


async def _spec_counters(session: aiohttp.ClientSession, base_url: str) -> tuple[float, float, float] | None:
    try:
        async with session.get(f"{base_url}/metrics") as response:
            return spec_counters(await response.text()) if response.status == 200 else None
    except (TimeoutError, aiohttp.ClientError):
        return None


@dataclass(frozen=True)
class LevelRun:
    result: LevelResult
    records: tuple[RequestRecord, ...]  # in the order of the level's requests
    speculation: Acceptance | None = None  # where the server speculates (its /metrics say)


@dataclass(frozen=True)
class ServeResult:
    url: str
    model: str
    max_model_len: int  # 0 when the server did not say
    tokenizer: str | None  # the folder prompt ids came from; None for a prompt list
    workload: WorkloadSpec
    request_rate: float
    levels: tuple[LevelRun, ...]
    endpoint: Endpoint = "completions"
    warmup: RequestRecord | None = None  # the untimed first request, when one was sent


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


async def _model_cards(base_url: str) -> list[dict[str, Any]] | str:
    """The cards of /v1/models, or why the server gave none (an HTTP error status). Asked on a
    connection of its own: a server whose listing failed may drop the connection it answered on."""
    timeout = aiohttp.ClientTimeout(total=60, sock_connect=30)
    try:
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(f"{base_url}/v1/models") as response,
        ):
            if response.status != 200:
                return f"GET {base_url}/v1/models answered HTTP {response.status}"
            cards: list[dict[str, Any]] = (await response.json())["data"]
            return cards
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise BenchError(f"cannot reach {base_url}: {exc}") from None


async def _served_model(base_url: str, wanted: str | None) -> tuple[str, int]:
    """The model to ask for and its max_model_len (0: unknown), from /v1/models. A `wanted` model that
    the server does not list (some servers, e.g. `transformers serve`, list other models than the one
    they serve, or fail to list any) is used as given; a wrong name then fails the first request."""
    cards = await _model_cards(base_url)
    if isinstance(cards, str):
        if wanted is None:
            raise BenchError(f"{cards}: pass --model")
        log.warning("%s; asking for %r anyway", cards, wanted)
        return wanted, 0
    for card in cards:
        if wanted is None or card["id"] == wanted:
            return str(card["id"]), int(card.get("max_model_len") or 0)
    if wanted is None:
        raise BenchError(f"{base_url}/v1/models lists no model")
    listed = ", ".join(str(card["id"]) for card in cards) or "nothing"
    log.warning("%s/v1/models lists %s, not %r; asking for it anyway", base_url, listed, wanted)
    return wanted, 0


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


def _check_fits(spec: WorkloadSpec, max_model_len: int) -> None:
    if max_model_len and spec.longest_request > max_model_len:
        raise BenchError(
            f"the longest request may need {spec.longest_request} tokens ({spec.describe_longest()}); the "
            f"server's max_model_len is {max_model_len}: lower --prefix-len / --input-len / --output-len"
        )


@dataclass(frozen=True)
class _Prompts:
    """How requests are made for one run: the token pool (None for a prompt list) and, for the chat
    endpoint with random ids, the tokenizer that turns them into text."""

    spec: WorkloadSpec
    pool: TokenPool | None
    decoder: Tokenizer | None

    def prepare(self, request: BenchRequest) -> BenchRequest:
        return request if self.decoder is None else with_text(request, self.decoder.decode)

    def level(self, index: int, count: int) -> list[BenchRequest]:
        requests = make_workload(self.spec, self.pool, round_index=index, num_requests=count)
        return [self.prepare(r) for r in requests]

    def warmup(self) -> BenchRequest:
        return self.prepare(warmup_request(self.spec, self.pool))


def _prompts(options: ServeOptions, model: str) -> tuple[_Prompts, Path | None]:
    """The request maker, and the tokenizer folder it drew from (None for a prompt list)."""
    spec = options.workload
    if spec.prompts:
        return _Prompts(spec, None, None), None
    folder = _tokenizer_folder(options, model)
    tokenizer = Tokenizer.from_folder(folder)
    decoder = tokenizer if options.endpoint == "chat" else None
    return _Prompts(spec, prompt_token_pool(tokenizer, _model_vocab(folder)), decoder), folder


def _model_vocab(folder: Path) -> int | None:
    """The model's vocabulary size where the tokenizer's folder is the model's (its embedding may
    have fewer rows than the tokenizer has tokens), else None."""
    try:
        size = json.loads((folder / "config.json").read_text()).get("vocab_size")
    except (OSError, ValueError, AttributeError):
        return None
    return size if isinstance(size, int) and size > 0 else None


async def _warm_up(session: aiohttp.ClientSession, target: Target, prompts: _Prompts) -> RequestRecord:
    record = await send(session, target, prompts.warmup())
    if not record.ok:
        raise BenchError(f"the warm-up request failed: {record.error}")
    return record


async def run_serve(options: ServeOptions) -> ServeResult:
    """Runs `options.workload` once per concurrency level (round i of the workload at level i, with
    `options.level_sizes[i]` requests), after one warm-up request unless `options.warmup` is off."""
    base_url = options.url.rstrip("/")
    model, max_model_len = await _served_model(base_url, options.model)
    _check_fits(options.workload, max_model_len)
    prompts, folder = _prompts(options, model)
    timeout = aiohttp.ClientTimeout(total=options.timeout_s, sock_connect=30)
    connector = aiohttp.TCPConnector(limit=max(options.concurrency))
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        target = Target(base_url, model, options.workload.ignore_eos, options.endpoint)
        warmup = await _warm_up(session, target, prompts) if options.warmup else None
        levels = []
        for index, concurrency in enumerate(options.concurrency):
            requests = prompts.level(index, options.level_sizes[index])
            before = await _spec_counters(session, base_url)
            run = await _run_level(session, target, requests, concurrency, options.request_rate,
                                   options.workload.seed)
            after = await _spec_counters(session, base_url)
            if before is not None and after is not None:
                drafts, tokens, accepted = (b - a for a, b in zip(before, after, strict=True))
                run = LevelRun(run.result, run.records, Acceptance(drafts, tokens, accepted))
            levels.append(run)
    tokenizer = None if folder is None else str(folder)
    return ServeResult(base_url, model, max_model_len, tokenizer, options.workload, options.request_rate,
                       tuple(levels), options.endpoint, warmup)
