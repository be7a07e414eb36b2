"""The OpenAI-compatible HTTP API over an EngineClient (in-process or an engine process).

Routes: GET /health (liveness), /ready (readiness, with the start-up phase), /version,
/v1/models, /v1/models/{id}, /v1/backends, /metrics; POST /v1/completions and
/v1/chat/completions (each streaming, SSE, or not), /tokenize, /detokenize. Every request body is a
pydantic model in /openapi.json; errors are OpenAI-shaped with a fitting 4xx.

Behaviour worth knowing:
- HTTP comes up before the model is loaded: /health answers 200 at once; model routes answer 503
  (with Retry-After) until /ready does 200, and again while the server drains.
- A request without `model` is served by the served model; any other name is a 404.
- `max_tokens` left out means "up to the end of the context" (max_model_len - prompt tokens).
- `n` > 1 fans out to n engine requests with ids f"{id}-{i}"; a seed s gives them seeds s + i.
  A list of prompts gives len(prompts) * n choices, indexed prompt-major as OpenAI does.
- Admission (ferrum.server.admission) refuses work past the limits with 429/503 and Retry-After;
  `timeout` and `priority` (extensions) set a request's deadline and its place in the queue.
- A client that goes away aborts its engine requests: streams through the closed generators,
  non-streaming requests through a disconnect watcher.
- X-Request-Id is honoured (and echoed) when given, else a uuid4 hex is used; the response id is
  "cmpl-<id>" or "chatcmpl-<id>". Two running requests may not share an id (400).
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from ferrum.config.server_settings import ServerSettings
from ferrum.engine.async_engine import EngineClient
from ferrum.engine.limits import PromptTooLongError
from ferrum.engine.outputs import RequestOutput
from ferrum.server.admission import Admission, Ticket
from ferrum.server.auth import ApiKeyMiddleware
from ferrum.server.body import parse_body
from ferrum.server.body_limit import BodyLimitMiddleware
from ferrum.server.chat_output import ChatOutput, ChatPlan, plan_chat
from ferrum.server.completion_output import CompletionOutput
from ferrum.server.errors import APIError, ErrorResponse, bad_request, install_error_handlers
from ferrum.server.jobs import ChoiceResult, Job, collect, engine_error, run_jobs, unless_disconnected
from ferrum.server.logprobs import chat_logprobs, completion_logprobs, vllm_prompt_logprobs
from ferrum.server.logs import RequestLogMiddleware, log_request, mark_logged
from ferrum.server.metrics import ServerMetrics
from ferrum.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    ModelQuantization,
    SamplingFields,
    TokenizeRequest,
    TokenizeResponse,
    Usage,
)
from ferrum.server.request_id import RequestIdMiddleware
from ferrum.server.responses import ResponseObject, ResponsesRequest, ResponsesShape
from ferrum.server.sse import SSEResponse, named_sse_events, sse_events
from ferrum.server.state import ServerState
from ferrum.server.ui import install_chat_page
from ferrum.tokenizer import ChatTemplateError
from ferrum.weights.quantization.scheme import QuantizationConfig

BackendCards = Callable[[], list[dict[str, Any]]]


def ferrum_version() -> str:
    try:
        return importlib.metadata.version("ferrum")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


class Server:
    def __init__(
        self,
        served_model_name: str,
        settings: ServerSettings,
        state: ServerState,
        backends: BackendCards | None = None,
        quantization: QuantizationConfig | None = None,
    ) -> None:
        self.model_name = served_model_name
        self.settings = settings
        self.state = state
        self.backends = backends or (lambda: [])
        self.quantization = model_quantization(quantization)
        self.engine: EngineClient | None = None
        self.metrics = ServerMetrics(served_model_name)
        self.metrics.state = state
        self.admission = Admission(settings.limits, self._max_running, self._abort, self.metrics.rejected)
        self.metrics.in_flight = lambda: self.admission.in_flight
        self.metrics.waiting_tokens = lambda: self.admission.waiting_tokens
        self.created = int(time.time())
        self._running_ids: set[str] = set()

    def attach(self, engine: EngineClient) -> None:
        """The loaded model's engine: model routes serve from now on (once the state is ready)."""
        self.engine = engine
        self.metrics.engine = engine

    def _max_running(self) -> int:
        return self.engine.stats().max_num_seqs if self.engine is not None else 0

    def _abort(self, request_id: str) -> None:
        if self.engine is not None:
            asyncio.ensure_future(self.engine.abort(request_id))

    # -- checks shared by the model routes ---------------------------------------------------------
    def serving_engine(self) -> EngineClient:
        """The engine, when the server takes requests; else the 503 that says why."""
        if self.state.draining:
            self.admission.refuse("shutting_down")
        if not self.state.ready or self.engine is None:
            self.admission.refuse("not_ready")
        if not self.engine.is_ready():
            raise APIError(503, "The engine is not running; see the server log.", code="engine_not_running")
        return self.engine

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise self.model_not_found(name)

    def check_request(self, req: SamplingFields, unsupported: tuple[str, str] | None) -> EngineClient:
        engine = self.serving_engine()
        self.check_model(req.model)
        if unsupported is not None:
            raise bad_request(*unsupported)
        limits = self.settings.limits
        if req.n > limits.max_n:
            raise bad_request(f"n is {req.n}; this server allows at most {limits.max_n}.", param="n")
        asked = req.requested_max_tokens()
        if limits.max_tokens is not None and asked is not None and asked > limits.max_tokens:
            param = "max_completion_tokens" if isinstance(req, ChatCompletionRequest) and \
                req.max_completion_tokens is not None else "max_tokens"
            raise bad_request(f"{param} is {asked}; this server allows at most {limits.max_tokens}.", param=param)
        return engine

    def model_not_found(self, name: str) -> APIError:
        return APIError(404, f"The model `{name}` does not exist.", param="model", code="model_not_found")

    def max_tokens_for(self, engine: EngineClient, req: SamplingFields, num_prompt_tokens: int,
                       prompt_param: str) -> int:
        """The request's completion length by the engine's limits (ferrum.engine.limits) and the
        server's, or an OpenAI-style 400 saying which part is too long."""
        what = "messages" if prompt_param == "messages" else "prompt"
        try:
            n = engine.limits.max_tokens(num_prompt_tokens, req.requested_max_tokens())
        except PromptTooLongError as exc:
            if exc.max_tokens is None:
                message = (
                    f"This model's maximum context length is {exc.max_model_len} tokens. However, your {what} "
                    f"resulted in {num_prompt_tokens} tokens, which leaves no room for the completion. "
                    f"Please reduce the length of the {what}."
                )
                param = prompt_param
            else:
                message = (
                    f"This model's maximum context length is {exc.max_model_len} tokens. However, you requested "
                    f"{num_prompt_tokens + exc.max_tokens} tokens ({num_prompt_tokens} in the {what}, "
                    f"{exc.max_tokens} in the completion). Please reduce the length of the {what} or completion."
                )
                param = "max_tokens"
            raise bad_request(message, param=param, code="context_length_exceeded") from None
        cap = self.settings.limits.max_tokens
        return min(n, cap) if cap is not None else n

    def make_jobs(
        self, engine: EngineClient, req: SamplingFields, base_id: str, prompts: Sequence[list[int]], prompt_param: str
    ) -> list[Job]:
        jobs: list[Job] = []
        for p, prompt_ids in enumerate(prompts):
            params = req.sampling_params(self.max_tokens_for(engine, req, len(prompt_ids), prompt_param))
            try:
                engine.limits.check_biased_ids([t for t, _ in params.logit_bias])
            except ValueError as exc:
                raise bad_request(str(exc), param="logit_bias") from None
            for i in range(req.n):
                index = p * req.n + i
                seeded = params
                if params.seed is not None and i > 0:
                    seeded = dataclasses.replace(params, seed=params.seed + i)
                request_id = base_id if len(prompts) * req.n == 1 else f"{base_id}-{index}"
                jobs.append(Job(index, p, request_id, prompt_ids, seeded))
        return jobs

    def admit(self, request: Request, req: SamplingFields, response_id: str, jobs: Sequence[Job], arrived: float,
              route: str, prompt: object) -> tuple[Ticket, Callable[[int], None]]:
        """Claims the response id and admits the jobs; returns the ticket and its release, which
        takes the HTTP status and writes the request's log line (call it exactly once)."""
        if response_id in self._running_ids:
            raise bad_request(f"Request id {response_id!r} is already in use by a running request.")
        ticket = self.admission.admit([j.request_id for j in jobs], [len(j.prompt_ids) for j in jobs],
                                      arrived=arrived, timeout_s=req.timeout, priority=req.priority)
        self._running_ids.add(response_id)
        mark_logged(request.state)
        prompt_tokens = sum({j.prompt_index: len(j.prompt_ids) for j in jobs}.values())

        def release(status: int) -> None:
            self._running_ids.discard(response_id)
            self.admission.release(ticket)
            unfinished = len(ticket.finish_reasons) < len(jobs)
            outcome = ticket.end_reason or ("disconnected" if status == 499 or (status == 200 and unfinished)
                                            else "ok" if status == 200 else "error")
            log_request(
                self.settings.logging, id=response_id, route=route, status=status, outcome=outcome,
                finish_reasons=",".join(sorted(set(ticket.finish_reasons.values()))) or None,
                prompt_tokens=prompt_tokens, completion_tokens=sum(ticket.output_tokens.values()),
                choices=len(jobs), priority=req.priority or None, queue_s=ticket.queue_time_s,
                ttft_s=ticket.first_token_s, duration_s=time.monotonic() - arrived, prompt=prompt,
            )

        return ticket, release

    async def run_to_end(self, request: Request, engine: EngineClient, jobs: list[Job], ticket: Ticket,
                         release: Callable[[int], None], param: str) -> list[ChoiceResult] | None:
        """A non-streaming request's results (None: the client left). Raises the ticket's end error
        (deadline, shutdown) or the engine's."""
        status = 500
        try:
            results = await unless_disconnected(request, collect(engine, jobs, self.metrics, ticket))
            ended = ticket.end_error()
            if ended is not None:
                status = ended.status_code
                raise ended
            status = 499 if results is None else 200
            return results
        except APIError as exc:
            status = exc.status_code
            raise
        except Exception as exc:
            raise engine_error(exc, param) from exc
        finally:
            release(status)

    # -- completions -------------------------------------------------------------------------------
    def tokenize_prompts(self, engine: EngineClient, req: CompletionRequest) -> tuple[list[list[int]], list[str]]:
        """Token ids of each prompt, and its text (for echo)."""
        tok = engine.tokenizer
        ids: list[list[int]] = []
        texts: list[str] = []
        vocab = min(tok.vocab_size, engine.limits.vocab_size)  # ids the tokenizer and the model both have
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
        engine = self.check_request(req, req.unsupported())
        prompt_ids, prompt_texts = self.tokenize_prompts(engine, req)
        response_id = f"cmpl-{request.state.request_id}"
        jobs = self.make_jobs(engine, req, response_id, prompt_ids, "prompt")
        ticket, release = self.admit(request, req, response_id, jobs, arrived, "completions", req.prompt)
        output = CompletionOutput(req, engine.tokenizer, prompt_texts)
        if req.stream:
            chunks = self._completion_chunks(engine, req, response_id, jobs, output, ticket)
            return SSEResponse(sse_events(chunks, "prompt"), on_close=lambda: release(200))
        results = await self.run_to_end(request, engine, jobs, ticket, release, "prompt")
        if results is None:
            return Response(status_code=499)
        if req.scores_only:  # the engine's one token is not part of the answer
            for r in results:
                r.num_output_tokens = 0
        choices = [output.choice(job, r) for job, r in zip(jobs, results, strict=True)]
        body = CompletionResponse(
            id=response_id, model=self.model_name, choices=choices, usage=self._usage(jobs, results)
        )
        return Response(body.model_dump_json(), media_type="application/json")

    async def _completion_chunks(
        self,
        engine: EngineClient,
        req: CompletionRequest,
        response_id: str,
        jobs: list[Job],
        output: CompletionOutput,
        ticket: Ticket,
    ) -> AsyncGenerator[BaseModel, None]:
        """The chunks: an echoed prompt first (with its logprobs, once the engine has them: with its first
        output), then the completion's pieces; a scoring request (max_tokens 0) sends no completion."""
        created = int(time.time())

        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> CompletionChunk:
            return CompletionChunk(
                id=response_id, created=created, model=self.model_name, choices=choices, usage=usage
            )

        def echo(job: Job, out: RequestOutput | None) -> CompletionChunk:
            logprobs = output.echoed(job, out.prompt_logprobs) if out is not None else None
            return chunk([CompletionChoice(index=job.index, text=output.prompt_texts[job.prompt_index],
                                           logprobs=logprobs)])

        if req.echo and not output.echoes_logprobs:
            for job in jobs:
                yield echo(job, None)
        offsets = [output.completion_offset(job) for job in jobs]
        prompt_tokens = [len(job.prompt_ids) for job in jobs]
        output_tokens = [0] * len(jobs)
        async with aclosing(run_jobs(engine, jobs, self.metrics, ticket)) as outputs:
            async for job, out in outputs:
                if output.echoes_logprobs and out.prompt_logprobs is not None:
                    yield echo(job, out)
                if req.scores_only:
                    if out.finished:
                        yield chunk([CompletionChoice(index=job.index, text="", finish_reason="length")])
                    continue
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
        ended = ticket.end_error()
        if ended is not None:
            raise ended
        if req.include_usage:
            yield chunk([], self._usage_from_counts(jobs, prompt_tokens, output_tokens))

    # -- chat --------------------------------------------------------------------------------------
    def chat_prompt(self, engine: EngineClient, req: ChatCompletionRequest) -> tuple[ChatPlan, list[int]]:
        """The request's plan (ferrum.server.chat_output) and its prompt: the conversation rendered with the
        model's chat template and encoded. A template that fails is a 400 with its message (saying so when
        the conversation holds tool turns, which some templates cannot take)."""
        plan = plan_chat(req, engine.tokenizer, self.settings.chat)
        try:
            ids = engine.tokenizer.encode_chat(plan.messages, add_generation_prompt=req.add_generation_prompt,
                                               tools=req.template_tools(), **req.template_kwargs())
        except ChatTemplateError as exc:
            if any(m.is_tool_turn for m in req.messages):
                raise bad_request(
                    "This model's chat template cannot render this conversation's tool calls or tool results "
                    f"(assistant tool_calls, role 'tool' or 'function' messages): {exc}", param="messages") from None
            raise bad_request(str(exc), param="messages") from None
        return plan, ids

    async def chat(self, request: Request) -> Response:
        arrived = time.monotonic()
        req = await parse_body(request, ChatCompletionRequest)
        return await self._serve_chat(request, req, arrived, f"chatcmpl-{request.state.request_id}")

    async def responses(self, request: Request) -> Response:
        """/v1/responses: served as a chat request (ferrum.server.responses), its result reshaped."""
        arrived = time.monotonic()
        req = await parse_body(request, ResponsesRequest)
        chat = req.to_chat()
        shape = ResponsesShape(req, f"resp_{request.state.request_id}", self.model_name)
        return await self._serve_chat(request, chat, arrived, f"chatcmpl-{request.state.request_id}", shape)

    async def _serve_chat(self, request: Request, req: ChatCompletionRequest, arrived: float, response_id: str,
                          shape: ResponsesShape | None = None) -> Response:
        engine = self.check_request(req, req.unsupported())
        plan, prompt_ids = self.chat_prompt(engine, req)
        output = plan.output
        if not prompt_ids:
            raise bad_request("The chat template produced an empty prompt.", param="messages")
        jobs = self.make_jobs(engine, req, response_id, [prompt_ids], "messages")
        route = "chat" if shape is None else "responses"
        ticket, release = self.admit(request, req, response_id, jobs, arrived, route, plan.messages)
        if req.stream:
            chunks = self._chat_chunks(engine, req, response_id, jobs, ticket, output)
            if shape is not None:
                events = named_sse_events(shape.events(chunks), "input")
                return SSEResponse(events, on_close=lambda: release(200))
            return SSEResponse(sse_events(chunks, "messages"), on_close=lambda: release(200))
        results = await self.run_to_end(request, engine, jobs, ticket, release, "messages")
        if results is None:
            return Response(status_code=499)
        choices = []
        for job, r in zip(jobs, results, strict=True):
            message, finish_reason = output.message(r.text, r.finish_reason)
            choices.append(ChatChoice(
                index=job.index,
                message=message,
                logprobs=chat_logprobs(r.logprobs) if r.logprobs is not None else None,
                finish_reason=finish_reason,
            ))
        prompt_logprobs = None
        if req.prompt_logprobs is not None and results[0].prompt_logprobs is not None:
            prompt_logprobs = vllm_prompt_logprobs(results[0].prompt_logprobs, req.prompt_logprobs)
        body = ChatCompletionResponse(
            id=response_id, model=self.model_name, choices=choices, usage=self._usage(jobs, results),
            prompt_logprobs=prompt_logprobs,
        )
        if shape is not None:
            return JSONResponse(shape.response(body))
        return Response(body.model_dump_json(), media_type="application/json")

    async def _chat_chunks(
        self, engine: EngineClient, req: ChatCompletionRequest, response_id: str, jobs: list[Job], ticket: Ticket,
        output: ChatOutput,
    ) -> AsyncGenerator[ChatCompletionChunk, None]:
        created = int(time.time())

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=response_id, created=created, model=self.model_name, choices=choices, usage=usage
            )

        for job in jobs:
            yield chunk([ChatChunkChoice(index=job.index, delta=DeltaMessage(role="assistant", content=""))])
        prompt_tokens = [len(job.prompt_ids) for job in jobs]
        output_tokens = [0] * len(jobs)
        streams = {job.index: output.stream() for job in jobs}
        async with aclosing(run_jobs(engine, jobs, self.metrics, ticket)) as outputs:
            async for job, out in outputs:
                output_tokens[job.index] = out.num_output_tokens
                delta = streams[job.index].feed(out.new_text) if out.new_text else None
                if delta is not None or out.new_logprobs:
                    lp = chat_logprobs(out.new_logprobs) if out.new_logprobs is not None else None
                    yield chunk([ChatChunkChoice(index=job.index, delta=delta or DeltaMessage(content=""),
                                                 logprobs=lp)])
                if out.finished:
                    last, finish_reason = streams[job.index].finish(out.finish_reason)
                    if last is not None:
                        yield chunk([ChatChunkChoice(index=job.index, delta=last)])
                    yield chunk([ChatChunkChoice(index=job.index, delta=DeltaMessage(),
                                                 finish_reason=finish_reason)])
        ended = ticket.end_error()
        if ended is not None:
            raise ended
        if req.include_usage:
            yield chunk([], self._usage_from_counts(jobs, prompt_tokens, output_tokens))

    # -- tokenizer routes --------------------------------------------------------------------------
    async def tokenize(self, request: Request) -> TokenizeResponse:
        req = await parse_body(request, TokenizeRequest)
        engine = self.serving_engine()
        self.check_model(req.model)
        if req.prompt is not None:
            tokens = engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        else:
            chat = req.chat_request()
            unsupported = chat.unsupported()
            if unsupported is not None:
                raise bad_request(*unsupported)
            _, tokens = self.chat_prompt(engine, chat)
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=engine.max_model_len)

    async def detokenize(self, request: Request) -> DetokenizeResponse:
        req = await parse_body(request, DetokenizeRequest)
        engine = self.serving_engine()
        self.check_model(req.model)
        vocab = engine.tokenizer.vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"Token ids out of range [0, {vocab}): {bad[:5]}", param="tokens")
        return DetokenizeResponse(prompt=engine.tokenizer.decode(req.tokens))

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
        engine = self.serving_engine()
        quantization = self.quantization
        load = engine.weight_load
        if load is not None and load.published is not None:  # the checkpoint's own format
            quantization = ModelQuantization(method=load.published, group_size=None, symmetric=None, skip=[],
                                             checkpoint=load.quantization)
        elif load is not None and load.chosen is not None:  # quantization auto: what it picked
            quantization = model_quantization(load.on_load)
        if load is not None and load.chosen is not None:
            quantization = (quantization or ModelQuantization(method="none", group_size=None, symmetric=None,
                                                              skip=[])).model_copy(
                update={"chosen": load.chosen})
        return ModelCard(
            id=self.model_name,
            created=self.created,
            root=self.model_name,
            max_model_len=engine.max_model_len,
            quantization=quantization,
            kv_cache_dtype=engine.stats().kv_cache_dtype or None,
        )


# -- OpenAPI -----------------------------------------------------------------------------------------

_REQUEST_MODELS: tuple[type[BaseModel], ...] = (CompletionRequest, ChatCompletionRequest, ResponsesRequest,
                                                 TokenizeRequest, DetokenizeRequest)


def _json_body(model: type[BaseModel]) -> dict[str, Any]:
    """openapi_extra for a route that parses its own body (see ferrum.server.body) as `model`."""
    schema = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


def _errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    return {status: {"model": ErrorResponse, "description": "An OpenAI-style error"} for status in statuses}


def _streaming(model: type[BaseModel]) -> dict[int | str, dict[str, Any]]:
    return {200: {"model": model, "description": "The response; with `stream`, server-sent events of chunks",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


def _openapi(app: FastAPI) -> Callable[[], dict[str, Any]]:
    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in _REQUEST_MODELS:
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
            app.openapi_schema = schema
        return app.openapi_schema

    return build


def model_quantization(config: QuantizationConfig | None) -> ModelQuantization | None:
    """The served model's quantization as /v1/models shows it (symmetric resolved to the method's own)."""
    if config is None or config.published or config.auto:  # the loaded checkpoint, or auto's pick, says (model_card)
        return None
    grouped = config.scheme.grouped
    return ModelQuantization(method=config.method, group_size=config.group_size if grouped else None,
                             symmetric=bool(config.symmetric) if grouped else True, skip=list(config.skip))


def backend_card(backend: Any, selected: bool) -> dict[str, Any]:
    """A registered backend as JSON: name, kind, version, whether it serves this model, its
    probed capabilities and status."""
    from ferrum.dtypes import dtype_name

    caps = backend.capabilities()
    status = backend.status()
    return {
        "name": backend.name,
        "kind": backend.kind,
        "version": backend.version(),
        "selected": selected,
        "capabilities": {
            "dtypes": sorted(dtype_name(d) for d in caps.supported_dtypes),
            "devices": list(caps.devices),
            "max_batch_size": caps.max_batch_size,
            "max_sequence_length": caps.max_sequence_length,
            "paged_attention": caps.paged_attention,
            "flash_attention": caps.flash_attention,
            "cuda_graphs": caps.cuda_graphs,
            "quantization": sorted(caps.quantization),
            "quantization_needs": dict(caps.quantization_needs),
            "total_memory_bytes": caps.total_memory_bytes,
            "free_memory_bytes": caps.free_memory_bytes,
            "extras": {str(k): str(v) for k, v in caps.extras.items()},
        },
        "status": dataclasses.asdict(status),
    }


def create_app(
    engine: EngineClient | None,
    served_model_name: str,
    settings: ServerSettings | None = None,
    state: ServerState | None = None,
    backends: BackendCards | None = None,
    quantization: QuantizationConfig | None = None,
) -> FastAPI:
    """The app. With an engine and no state, it serves at once (tests, embedding); `ferrum serve`
    passes the state and attaches the engine once loaded (`app.state.server.attach`). `quantization`:
    the served model's, as /v1/models shows it."""
    settings = settings or ServerSettings()
    if state is None:
        state = ServerState()
        if engine is not None:
            state.set_ready()
    server = Server(served_model_name, settings, state, backends, quantization)
    if engine is not None:
        server.attach(engine)
    app = FastAPI(title="Ferrum", summary="OpenAI-compatible LLM inference server", version=ferrum_version(),
                  root_path=settings.api.root_path)
    app.state.server = server
    app.openapi = _openapi(app)  # type: ignore[method-assign]
    # middleware, innermost first: errors -> body limit -> API keys -> request log -> request id -> CORS
    install_error_handlers(app)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.limits.max_body_bytes)
    keys = settings.api.all_keys()
    if keys:
        app.add_middleware(ApiKeyMiddleware, keys=keys, metrics_open=not settings.api.metrics_require_key,
                           ui_open=settings.api.ui)
    app.add_middleware(RequestLogMiddleware, config=settings.logging)
    app.add_middleware(RequestIdMiddleware)
    if settings.api.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(settings.api.cors_origins), allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["X-Request-Id", "Retry-After"])

    if settings.api.ui:
        install_chat_page(app)

    @app.get("/health", tags=["operations"])
    async def health() -> JSONResponse:
        """Liveness: 200 while the process serves HTTP, whatever the model's state."""
        return JSONResponse({"status": "ok", "phase": state.phase})

    @app.get("/ready", tags=["operations"], responses={503: {"description": "Not ready: the phase and why"}})
    async def ready() -> JSONResponse:
        """Readiness: 200 once the model is loaded and warmed up; 503 before (with the phase:
        fetching, loading with progress, warming, failed with the reason) and while draining."""
        status, body = state.readiness()
        return JSONResponse(body, status_code=status)

    @app.get("/version", tags=["operations"])
    async def version() -> JSONResponse:
        return JSONResponse({"version": ferrum_version()})

    @app.get("/v1/models", tags=["models"], responses=_errors(401, 503))
    async def list_models() -> ModelList:
        return ModelList(data=[server.model_card()])

    @app.get("/v1/models/{model_id:path}", tags=["models"], responses=_errors(401, 404, 503))
    async def get_model(model_id: str) -> ModelCard:
        if model_id != served_model_name:
            raise server.model_not_found(model_id)
        return server.model_card()

    @app.get("/v1/backends", tags=["operations"], responses=_errors(401))
    async def list_backends() -> JSONResponse:
        """The registered compute backends: capabilities, status, and which one serves the model."""
        return JSONResponse({"object": "list", "data": server.backends()})

    @app.get("/metrics", tags=["operations"])
    async def metrics() -> Response:
        body, content_type = server.metrics.render()
        return Response(body, media_type=content_type)

    model_errors = _errors(400, 401, 404, 408, 413, 429, 503)

    @app.post("/v1/completions", response_model=None, tags=["inference"], openapi_extra=_json_body(CompletionRequest),
              responses={**_streaming(CompletionResponse), **model_errors})
    async def completions(request: Request) -> Response:
        return await server.completions(request)

    @app.post("/v1/chat/completions", response_model=None, tags=["inference"],
              openapi_extra=_json_body(ChatCompletionRequest),
              responses={**_streaming(ChatCompletionResponse), **model_errors})
    async def chat_completions(request: Request) -> Response:
        return await server.chat(request)

    @app.post("/v1/responses", response_model=None, tags=["inference"], openapi_extra=_json_body(ResponsesRequest),
              responses={**_streaming(ResponseObject), **model_errors})
    async def responses(request: Request) -> Response:
        """OpenAI's Responses API, stateless (no previous_response_id): text in and out, function tools,
        streaming events."""
        return await server.responses(request)

    @app.post("/tokenize", tags=["tokenizer"], openapi_extra=_json_body(TokenizeRequest),
              responses=_errors(400, 401, 404, 413, 503))
    async def tokenize(request: Request) -> TokenizeResponse:
        return await server.tokenize(request)

    @app.post("/detokenize", tags=["tokenizer"], openapi_extra=_json_body(DetokenizeRequest),
              responses=_errors(400, 401, 404, 413, 503))
    async def detokenize(request: Request) -> DetokenizeResponse:
        return await server.detokenize(request)

    return app
