"""The OpenAI-compatible HTTP API over an AsyncEngine.

Routes: GET /health, /v1/models, /v1/models/{id}, /metrics; POST /v1/completions and
/v1/chat/completions, each streaming (SSE) or not.

Behaviour worth knowing:
- A request without `model` is served by the served model; any other name is a 404.
- `max_tokens` left out means "up to the end of the context" (max_model_len - prompt tokens).
- `n` > 1 fans out to n engine requests with ids f"{id}-{i}"; a seed s gives them seeds s + i.
  A list of prompts gives len(prompts) * n choices, indexed prompt-major as OpenAI does.
- A client that goes away aborts its engine requests: streams through the closed generators,
  non-streaming requests through a disconnect watcher.
- X-Request-Id is honoured (and echoed) when given, else a uuid4 hex is used; the response id is
  "cmpl-<id>" or "chatcmpl-<id>". Two running requests may not share an id (400).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import Any, TypeVar

import anyio
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from ferrum.engine.async_engine import AsyncEngine, PromptTooLongError
from ferrum.engine.outputs import FinishReason, RequestOutput, TokenLogprob
from ferrum.engine.sampling_params import SamplingParams
from ferrum.server.errors import (
    APIError,
    bad_request,
    from_validation_error,
    install_error_handlers,
    internal_error,
)
from ferrum.server.metrics import ServerMetrics
from ferrum.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    SamplingFields,
    Usage,
)
from ferrum.tokenizer import ChatTemplateError

log = logging.getLogger(__name__)

RequestT = TypeVar("RequestT", bound=BaseModel)
T = TypeVar("T")
_MAX_REQUEST_ID_LEN = 128
_LOGPROB_FLOOR = -9999.0  # OpenAI's stand-in for -inf


# -- request ids -------------------------------------------------------------------------------------


class RequestIdMiddleware:
    """Puts the request id in scope["state"]["request_id"] and on every response as X-Request-Id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1").strip()
        usable = 0 < len(given) <= _MAX_REQUEST_ID_LEN and given.isprintable()
        request_id = given if usable else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["x-request-id"] = request_id
            await send(message)

        await self.app(scope, receive, send_with_id)


# -- body parsing -------------------------------------------------------------------------------------


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


async def parse_body(request: Request, model: type[RequestT]) -> RequestT:
    """The body as `model`, whatever the Content-Type; any problem is a one-line 400."""
    raw = await request.body()
    if not raw.strip():
        raise bad_request("The request body is empty; expected a JSON object.")
    try:
        data = json.loads(raw, parse_constant=_no_constants)
    except (ValueError, RecursionError) as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise bad_request("The request body must be a JSON object.")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise from_validation_error(exc) from None


# -- running engine requests ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Job:
    """One engine request: one choice of the response."""

    index: int
    prompt_index: int
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclasses.dataclass
class ChoiceResult:
    text: str = ""
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None


async def _next_output(gen: AsyncIterator[RequestOutput]) -> RequestOutput:
    return await gen.__anext__()


def _settle(task: asyncio.Task[RequestOutput]) -> None:
    """Marks a finished task's exception as seen so asyncio does not warn about it."""
    if task.done() and not task.cancelled():
        task.exception()


async def run_jobs(
    engine: AsyncEngine, jobs: Sequence[Job], metrics: ServerMetrics, arrived: float
) -> AsyncGenerator[tuple[Job, RequestOutput], None]:
    """The outputs of all jobs as they come. However the consumer stops (return, error, aclose,
    cancellation), every engine generator is closed, which aborts the unfinished requests."""
    gens = [engine.generate(job.request_id, job.prompt_ids, job.params) for job in jobs]
    pending: dict[asyncio.Task[RequestOutput], int] = {}
    first_token_seen = [False] * len(jobs)

    def observe(i: int, out: RequestOutput) -> None:
        if out.new_token_ids and not first_token_seen[i]:
            first_token_seen[i] = True
            metrics.observe_first_token(time.monotonic() - arrived)
        if out.finished:
            metrics.observe_finished(time.monotonic() - arrived, out.finish_reason or "stop")

    try:
        if len(gens) == 1:
            async for out in gens[0]:
                observe(0, out)
                yield jobs[0], out
            return
        pending = {asyncio.create_task(_next_output(g)): i for i, g in enumerate(gens)}
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t]):
                i = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                observe(i, out)
                if not out.finished:
                    pending[asyncio.create_task(_next_output(gens[i]))] = i
                yield jobs[i], out
    finally:
        with anyio.CancelScope(shield=True):
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending)
            for task in pending:
                _settle(task)
            for gen in gens:
                try:
                    await gen.aclose()  # type: ignore[attr-defined]
                except Exception:
                    log.exception("closing an engine request failed")


async def collect(
    engine: AsyncEngine, jobs: Sequence[Job], metrics: ServerMetrics, arrived: float
) -> list[ChoiceResult]:
    results = [ChoiceResult() for _ in jobs]
    for job, result in zip(jobs, results, strict=True):
        if job.params.logprobs is not None:
            result.logprobs = []
    async with aclosing(run_jobs(engine, jobs, metrics, arrived)) as outputs:
        async for job, out in outputs:
            r = results[job.index]
            r.text += out.new_text
            r.num_prompt_tokens = out.num_prompt_tokens
            r.num_output_tokens = out.num_output_tokens
            if r.logprobs is not None and out.new_logprobs:
                r.logprobs.extend(out.new_logprobs)
            if out.finished:
                r.finish_reason = out.finish_reason
    return results


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Runs `work`; cancels it (aborting its engine requests) and returns None if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.wait({task})
    if task.cancelled():
        return None
    return task.result()


def engine_error(exc: BaseException, param: str) -> APIError:
    if isinstance(exc, PromptTooLongError):
        return bad_request(str(exc), param=param, code="context_length_exceeded")
    log.error("request failed", exc_info=exc)
    return internal_error()


# -- SSE ------------------------------------------------------------------------------------------------


class SSEResponse(StreamingResponse):
    """A stream whose body generator is always closed, however the response ends, and which runs
    `on_close` last. Starlette cancels the body on disconnect; closing it makes sure."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncGenerator[str, None], on_close: Callable[[], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._content = content
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                with anyio.CancelScope(shield=True):
                    await self._content.aclose()
            finally:
                self._on_close()


async def sse_events(chunks: AsyncGenerator[BaseModel, None], error_param: str) -> AsyncGenerator[str, None]:
    try:
        async with aclosing(chunks):
            async for chunk in chunks:
                yield f"data: {chunk.model_dump_json()}\n\n"
    except Exception as exc:
        error = exc if isinstance(exc, APIError) else engine_error(exc, error_param)
        yield f"data: {json.dumps(error.body())}\n\n"
    yield "data: [DONE]\n\n"


# -- logprobs in the two wire formats -------------------------------------------------------------


def _finite(value: float) -> float:
    return value if value >= _LOGPROB_FLOOR else _LOGPROB_FLOOR  # also maps NaN to the floor


def completion_logprobs(lps: Sequence[TokenLogprob], text_offset: int) -> CompletionLogprobs:
    out = CompletionLogprobs()
    for lp in lps:
        top = {t.token: _finite(t.logprob) for t in lp.top}
        top.setdefault(lp.token, _finite(lp.logprob))
        out.tokens.append(lp.token)
        out.token_logprobs.append(_finite(lp.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(lp.token)
    return out


def chat_logprobs(lps: Sequence[TokenLogprob]) -> ChatLogprobs:
    return ChatLogprobs(
        content=[
            ChatTokenLogprob(
                token=lp.token,
                logprob=_finite(lp.logprob),
                bytes=list(lp.token.encode("utf-8")),
                top_logprobs=[
                    ChatTopLogprob(
                        token=t.token, logprob=_finite(t.logprob), bytes=list(t.token.encode("utf-8"))
                    )
                    for t in lp.top
                ],
            )
            for lp in lps
        ]
    )


# -- the server -----------------------------------------------------------------------------------------


class Server:
    def __init__(self, engine: AsyncEngine, served_model_name: str) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.metrics = ServerMetrics(engine, served_model_name)
        self.created = int(time.time())
        self._running_ids: set[str] = set()

    # -- checks shared by both endpoints -----------------------------------------------------------
    def check_request(self, req: SamplingFields, unsupported: tuple[str, str] | None) -> None:
        if req.model is not None and req.model != self.model_name:
            raise self.model_not_found(req.model)
        if unsupported is not None:
            raise bad_request(*unsupported)
        if not self.engine.is_ready():
            raise APIError(503, "The engine is not ready to serve requests.")

    def model_not_found(self, name: str) -> APIError:
        return APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def max_tokens_for(self, req: SamplingFields, num_prompt_tokens: int, prompt_param: str) -> int:
        limit = self.engine.max_model_len
        what = "messages" if prompt_param == "messages" else "prompt"
        if num_prompt_tokens >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, your {what} resulted in "
                f"{num_prompt_tokens} tokens, which leaves no room for the completion. "
                f"Please reduce the length of the {what}.",
                param=prompt_param,
                code="context_length_exceeded",
            )
        requested = req.requested_max_tokens()
        if requested is None:
            return limit - num_prompt_tokens
        if num_prompt_tokens + requested > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the {what}, "
                f"{requested} in the completion). Please reduce the length of the {what} or completion.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        return requested

    def make_jobs(
        self, req: SamplingFields, base_id: str, prompts: Sequence[list[int]], prompt_param: str
    ) -> list[Job]:
        jobs: list[Job] = []
        for p, prompt_ids in enumerate(prompts):
            params = req.sampling_params(self.max_tokens_for(req, len(prompt_ids), prompt_param))
            for i in range(req.n):
                index = p * req.n + i
                seeded = params
                if params.seed is not None and i > 0:
                    seeded = dataclasses.replace(params, seed=params.seed + i)
                request_id = base_id if len(prompts) * req.n == 1 else f"{base_id}-{index}"
                jobs.append(Job(index, p, request_id, prompt_ids, seeded))
        return jobs

    def claim(self, response_id: str) -> Callable[[], None]:
        """Reserves a response id for one running request; returns its release."""
        if response_id in self._running_ids:
            raise bad_request(f"Request id {response_id!r} is already in use by a running request.")
        self._running_ids.add(response_id)
        return lambda: self._running_ids.discard(response_id)

    # -- completions -------------------------------------------------------------------------------
    def tokenize_prompts(self, req: CompletionRequest) -> tuple[list[list[int]], list[str]]:
        """Token ids of each prompt, and its text (for echo)."""
        tok = self.engine.tokenizer
        ids: list[list[int]] = []
        texts: list[str] = []
        vocab = tok.vocab_size
        for prompt in req.prompts():
            if isinstance(prompt, str):
                ids.append(tok.encode(prompt, add_special_tokens=req.add_special_tokens))
                texts.append(prompt)
            else:
                bad = [t for t in prompt if not 0 <= t < vocab]
                if bad:
                    raise bad_request(
                        f"Prompt token ids out of range [0, {vocab}): {bad[:5]}", param="prompt"
                    )
                ids.append(list(prompt))
                texts.append(tok.decode(prompt) if req.echo else "")
        for i, prompt_ids in enumerate(ids):
            if not prompt_ids:
                raise bad_request(f"Prompt {i} is empty (it has no tokens).", param="prompt")
        return ids, texts

    async def completions(self, request: Request) -> Response:
        arrived = time.monotonic()
        req = await parse_body(request, CompletionRequest)
        self.check_request(req, req.unsupported())
        prompt_ids, prompt_texts = self.tokenize_prompts(req)
        response_id = f"cmpl-{request.state.request_id}"
        jobs = self.make_jobs(req, response_id, prompt_ids, "prompt")
        release = self.claim(response_id)
        if req.stream:
            chunks = self._completion_chunks(req, response_id, jobs, prompt_texts, arrived)
            return SSEResponse(sse_events(chunks, "prompt"), on_close=release)
        try:
            results = await unless_disconnected(request, collect(self.engine, jobs, self.metrics, arrived))
        except Exception as exc:
            raise engine_error(exc, "prompt") from exc
        finally:
            release()
        if results is None:
            return Response(status_code=499)
        choices = []
        for job, r in zip(jobs, results, strict=True):
            echo = prompt_texts[job.prompt_index] if req.echo else ""
            lp = completion_logprobs(r.logprobs, 0) if r.logprobs is not None else None
            choices.append(
                CompletionChoice(
                    index=job.index, text=echo + r.text, logprobs=lp, finish_reason=r.finish_reason
                )
            )
        body = CompletionResponse(
            id=response_id, model=self.model_name, choices=choices, usage=self._usage(jobs, results)
        )
        return Response(body.model_dump_json(), media_type="application/json")

    async def _completion_chunks(
        self,
        req: CompletionRequest,
        response_id: str,
        jobs: list[Job],
        prompt_texts: list[str],
        arrived: float,
    ) -> AsyncGenerator[BaseModel, None]:
        created = int(time.time())

        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionChunk:
            return CompletionChunk(
                id=response_id, created=created, model=self.model_name, choices=choices, usage=usage
            )

        if req.echo:
            for job in jobs:
                yield chunk([CompletionChoice(index=job.index, text=prompt_texts[job.prompt_index])])
        offsets = [0] * len(jobs)
        prompt_tokens = [len(job.prompt_ids) for job in jobs]
        output_tokens = [0] * len(jobs)
        async with aclosing(run_jobs(self.engine, jobs, self.metrics, arrived)) as outputs:
            async for job, out in outputs:
                output_tokens[job.index] = out.num_output_tokens
                lp = None
                if out.new_logprobs is not None:
                    lp = completion_logprobs(out.new_logprobs, offsets[job.index])
                    offsets[job.index] += sum(len(t.token) for t in out.new_logprobs)
                if out.new_text or out.new_logprobs or out.finished:
                    reason = out.finish_reason if out.finished else None
                    yield chunk(
                        [
                            CompletionChoice(
                                index=job.index, text=out.new_text, logprobs=lp, finish_reason=reason
                            )
                        ]
                    )
        if req.include_usage:
            yield chunk([], self._usage_from_counts(jobs, prompt_tokens, output_tokens))

    # -- chat --------------------------------------------------------------------------------------
    def tokenize_chat(self, req: ChatCompletionRequest) -> list[int]:
        try:
            return self.engine.tokenizer.encode_chat(
                req.template_messages(),
                add_generation_prompt=req.add_generation_prompt,
                tools=req.tools,
                **req.template_kwargs(),
            )
        except ChatTemplateError as exc:
            raise bad_request(str(exc), param="messages") from None

    async def chat(self, request: Request) -> Response:
        arrived = time.monotonic()
        req = await parse_body(request, ChatCompletionRequest)
        self.check_request(req, req.unsupported())
        prompt_ids = self.tokenize_chat(req)
        if not prompt_ids:
            raise bad_request("The chat template produced an empty prompt.", param="messages")
        response_id = f"chatcmpl-{request.state.request_id}"
        jobs = self.make_jobs(req, response_id, [prompt_ids], "messages")
        release = self.claim(response_id)
        if req.stream:
            chunks = self._chat_chunks(req, response_id, jobs, arrived)
            return SSEResponse(sse_events(chunks, "messages"), on_close=release)
        try:
            results = await unless_disconnected(request, collect(self.engine, jobs, self.metrics, arrived))
        except Exception as exc:
            raise engine_error(exc, "messages") from exc
        finally:
            release()
        if results is None:
            return Response(status_code=499)
        choices = [
            ChatChoice(
                index=job.index,
                message=ChatResponseMessage(content=r.text),
                logprobs=chat_logprobs(r.logprobs) if r.logprobs is not None else None,
                finish_reason=r.finish_reason,
            )
            for job, r in zip(jobs, results, strict=True)
        ]
        body = ChatCompletionResponse(
            id=response_id, model=self.model_name, choices=choices, usage=self._usage(jobs, results)
        )
        return Response(body.model_dump_json(), media_type="application/json")

    async def _chat_chunks(
        self, req: ChatCompletionRequest, response_id: str, jobs: list[Job], arrived: float
    ) -> AsyncGenerator[BaseModel, None]:
        created = int(time.time())

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=response_id, created=created, model=self.model_name, choices=choices, usage=usage
            )

        for job in jobs:
            yield chunk([ChatChunkChoice(index=job.index, delta=DeltaMessage(role="assistant", content=""))])
        prompt_tokens = [len(job.prompt_ids) for job in jobs]
        output_tokens = [0] * len(jobs)
        async with aclosing(run_jobs(self.engine, jobs, self.metrics, arrived)) as outputs:
            async for job, out in outputs:
                output_tokens[job.index] = out.num_output_tokens
                if out.new_text or out.new_logprobs:
                    lp = chat_logprobs(out.new_logprobs) if out.new_logprobs is not None else None
                    yield chunk(
                        [
                            ChatChunkChoice(
                                index=job.index, delta=DeltaMessage(content=out.new_text), logprobs=lp
                            )
                        ]
                    )
                if out.finished:
                    yield chunk(
                        [
                            ChatChunkChoice(
                                index=job.index, delta=DeltaMessage(), finish_reason=out.finish_reason
                            )
                        ]
                    )
        if req.include_usage:
            yield chunk([], self._usage_from_counts(jobs, prompt_tokens, output_tokens))

    # -- usage -------------------------------------------------------------------------------------
    def _usage(self, jobs: Sequence[Job], results: Sequence[ChoiceResult]) -> Usage:
        return self._usage_from_counts(
            jobs, [len(j.prompt_ids) for j in jobs], [r.num_output_tokens for r in results]
        )

    @staticmethod
    def _usage_from_counts(
        jobs: Sequence[Job], prompt_tokens: Sequence[int], output_tokens: Sequence[int]
    ) -> Usage:
        """Each distinct prompt counts once, however many choices it has."""
        per_prompt = {job.prompt_index: n for job, n in zip(jobs, prompt_tokens, strict=True)}
        prompt_total = sum(per_prompt.values())
        return Usage.of(prompt_total, sum(output_tokens))

    # -- the small routes --------------------------------------------------------------------------
    def model_card(self) -> ModelCard:
        return ModelCard(
            id=self.model_name,
            created=self.created,
            root=self.model_name,
            max_model_len=self.engine.max_model_len,
        )


def create_app(engine: AsyncEngine, served_model_name: str) -> FastAPI:
    server = Server(engine, served_model_name)
    app = FastAPI(title="Ferrum", summary="OpenAI-compatible LLM inference server", version="0.1.0")
    app.state.server = server
    install_error_handlers(app)
    app.add_middleware(RequestIdMiddleware)

    @app.get("/health")
    async def health() -> JSONResponse:
        if engine.is_ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable"}, status_code=503)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        return ModelList(data=[server.model_card()])

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str) -> ModelCard:
        if model_id != served_model_name:
            raise server.model_not_found(model_id)
        return server.model_card()

    @app.get("/metrics")
    async def metrics() -> Response:
        body, content_type = server.metrics.render()
        return Response(body, media_type=content_type)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await server.completions(request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat_completions(request: Request) -> Response:
        return await server.chat(request)

    return app
