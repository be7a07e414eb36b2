"""The OpenAI-compatible HTTP API over an EngineClient (in-process or an engine process).

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

import dataclasses
import time
from collections.abc import AsyncGenerator, Callable, Sequence
from contextlib import aclosing

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel

from ferrum.engine.async_engine import EngineClient
from ferrum.engine.limits import PromptTooLongError
from ferrum.server.body import parse_body
from ferrum.server.errors import APIError, bad_request, install_error_handlers
from ferrum.server.jobs import ChoiceResult, Job, collect, engine_error, run_jobs, unless_disconnected
from ferrum.server.logprobs import chat_logprobs, completion_logprobs
from ferrum.server.metrics import ServerMetrics
from ferrum.server.protocol import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    CompletionChoice,
    CompletionChunk,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    ModelCard,
    ModelList,
    SamplingFields,
    Usage,
)
from ferrum.server.request_id import RequestIdMiddleware
from ferrum.server.sse import SSEResponse, sse_events
from ferrum.tokenizer import ChatTemplateError


class Server:
    def __init__(self, engine: EngineClient, served_model_name: str) -> None:
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
        """The request's completion length by the engine's limits (ferrum.engine.limits), or an
        OpenAI-style 400 saying which part is too long."""
        what = "messages" if prompt_param == "messages" else "prompt"
        try:
            return self.engine.limits.max_tokens(num_prompt_tokens, req.requested_max_tokens())
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


def create_app(engine: EngineClient, served_model_name: str) -> FastAPI:
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
