"""The OpenAI-compatible wire format: request bodies (validated) and response bodies (serialized).

Request models check shapes only, with messages that name the field; value ranges are checked by
SamplingParams, and features the server lacks are refused by `unsupported()`, both as 400 errors.
Unknown fields are ignored, and a missing `model` means the served model (as vLLM does).
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_serializer,
    model_validator,
)

from ferrum.engine.sampling_params import (
    SamplingParams,
    SamplingParamsError,
    StructuredKind,
    StructuredOutput,
)
from ferrum.engine.structured import StructuredOutputError, checked_grammar

FinishReason = Literal["stop", "length", "abort", "tool_calls"]
MAX_N = 128


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- requests -----------------------------------------------------------------------------------------


def _json_spec(schema: Any, param: str) -> StructuredOutput:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise SamplingParamsError(f"{param}: the JSON schema is not valid JSON ({exc})", param) from None
    if isinstance(schema, bool) or not isinstance(schema, dict):
        schema = {} if schema is True else schema
        if not isinstance(schema, dict):
            raise SamplingParamsError(f"{param}: a JSON schema must be an object", param)
    return StructuredOutput("json", json.dumps(schema, sort_keys=True), param)


class StreamOptions(BaseModel):
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, any JSON object, or JSON following a schema (always enforced,
    `strict` or not)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type 'json_schema' needs a json_schema object with a schema")
        return self


class StructuredOutputsField(BaseModel):
    """vLLM's `structured_outputs`: exactly one of json (a JSON schema), regex, choice, grammar (Lark in
    llguidance's dialect, or GBNF)."""

    model_config = ConfigDict(extra="ignore")

    json_: dict[str, Any] | str | bool | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class SamplingFields(BaseModel):
    """What both endpoints accept for sampling and stopping, and Ferrum's extensions (sent with the
    OpenAI client's `extra_body`): `timeout` (seconds: the request's deadline), `priority` (lower
    is admitted first), and vLLM's sampling fields (top_k, min_p, repetition_penalty, ...)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    n: int = Field(1, ge=1, le=MAX_N)
    best_of: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100], "
                                                "added to the logits before sampling")
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = Field(
        None, description="vLLM: output constrained to a JSON schema, a regex, a choice of strings or a grammar")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM (older name): structured_outputs.json")
    guided_regex: str | None = Field(None, description="vLLM (older name): structured_outputs.regex")
    guided_choice: list[str] | None = Field(None, description="vLLM (older name): structured_outputs.choice")
    guided_grammar: str | None = Field(None, description="vLLM (older name): structured_outputs.grammar")
    json_schema: dict[str, Any] | None = Field(None, description="llama-server: output constrained to this JSON schema")
    grammar: str | None = Field(None, description="llama-server: output constrained to this GBNF grammar")
    user: str | None = None
    timeout: float | None = Field(None, gt=0, description="Ferrum: seconds before the request is ended "
                                  "with a request_timeout error (default: the server's limits.request_timeout_s)")
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1, description="Ferrum (as vLLM): waiting requests with "
                          "a lower value are admitted first")
    prompt_logprobs: int | None = Field(None, description="vLLM: the logprob of every prompt token (null for the "
                                        "first), with the N most likely tokens at each position; not with stream")

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_shape(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if isinstance(value, list) and all(isinstance(s, str) for s in value):
            return value
        raise ValueError("must be a string or a list of strings")

    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def token_biases(self) -> tuple[tuple[int, float], ...]:
        out = []
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise SamplingParamsError(f"logit_bias keys must be token ids, got {key!r}", "logit_bias") from None
            out.append((token, float(bias)))
        return tuple(out)

    def structured_output(self) -> StructuredOutput | None:
        """The one grammar the request asks for (any of the accepted spellings), compiled once to check
        it; SamplingParamsError when it is malformed or when two are given."""
        asked: list[StructuredOutput] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(StructuredOutput("json", '{"type": "object"}', "response_format"))
        elif rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
            asked.append(_json_spec(rf.json_schema.schema_, "response_format.json_schema.schema"))
        so = self.structured_outputs
        if so is not None:
            if so.json_ is not None:
                asked.append(_json_spec(so.json_, "structured_outputs.json"))
            if so.json_object:
                asked.append(StructuredOutput("json", '{"type": "object"}', "structured_outputs.json_object"))
            if so.regex is not None:
                asked.append(StructuredOutput("regex", so.regex, "structured_outputs.regex"))
            if so.choice is not None:
                asked.append(StructuredOutput("choice", json.dumps(so.choice), "structured_outputs.choice"))
            if so.grammar is not None:
                asked.append(StructuredOutput("grammar", so.grammar, "structured_outputs.grammar"))
        fields: tuple[tuple[str, StructuredKind], ...] = (
            ("guided_json", "json"), ("json_schema", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
            ("guided_grammar", "grammar"), ("grammar", "grammar"))
        for name, kind in fields:
            value = getattr(self, name)
            if value is None:
                continue
            if kind == "json":
                asked.append(_json_spec(value, name))
            else:
                asked.append(StructuredOutput(kind, json.dumps(value) if kind == "choice" else value, name))
        if not asked:
            return None
        if len(asked) > 1:
            names = ", ".join(a.param for a in asked)
            raise SamplingParamsError(f"only one structured output may be asked for, got {names}", asked[1].param)
        try:
            checked_grammar(asked[0])
        except StructuredOutputError as exc:
            raise SamplingParamsError(str(exc), exc.param) from None
        return asked[0]

    def requested_logprobs(self) -> int | None:
        raise NotImplementedError

    def requested_prompt_logprobs(self) -> int | None:
        """How many top tokens the engine scores at each prompt position (None: no prompt logprobs)."""
        return self.prompt_logprobs

    def common_unsupported(self) -> tuple[str, str] | None:
        """(message, param) for a feature the server does not have, else None."""
        if self.prompt_logprobs is not None and self.stream:
            return "prompt_logprobs is not supported with stream (as in vLLM)", "prompt_logprobs"
        if self.best_of is not None and self.best_of != self.n:
            return (
                f"best_of must equal n (got best_of={self.best_of}, n={self.n}); best_of > n is unsupported",
                "best_of",
            )
        if self.stream_options is not None and not self.stream:
            return "stream_options is only allowed when stream is true", "stream_options"
        return None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        """Raises SamplingParamsError for out-of-range values."""
        given: dict[str, Any] = {
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
        }
        values = {k: v for k, v in given.items() if v is not None}
        return SamplingParams(
            logit_bias=self.token_biases(),
            structured=self.structured_output(),
            max_tokens=max_tokens,
            stop=self.stop_strings(),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            ignore_eos=self.ignore_eos,
            logprobs=self.requested_logprobs(),
            prompt_logprobs=self.requested_prompt_logprobs(),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            **values,
        )

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(SamplingFields):
    """`echo` with `logprobs` also gives the prompt tokens' logprobs (the first is null), ahead of the
    completion's; with `max_tokens` 0 (allowed with echo or prompt_logprobs) the prompt is only scored."""

    prompt: Prompt
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    add_special_tokens: bool = True

    @field_validator("prompt", mode="before")
    @classmethod
    def _prompt_shape(cls, value: Any) -> Any:
        shape = "must be a string, a list of strings, a list of token ids or a list of token-id lists"
        if isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError(shape)
        if not value:
            raise ValueError("must not be empty")
        if all(isinstance(p, str) for p in value) or all(_is_int(t) for t in value):
            return value
        if all(isinstance(p, list) and all(_is_int(t) for t in p) for p in value):
            if not all(value):
                raise ValueError("token-id lists must not be empty")
            return value
        raise ValueError(shape)

    def prompts(self) -> list[str] | list[list[int]]:
        """One entry per prompt: texts, or token-id lists."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, str) for x in p):
            return [x for x in p if isinstance(x, str)]
        if all(_is_int(x) for x in p):
            return [[x for x in p if isinstance(x, int)]]
        return [x for x in p if isinstance(x, list)]

    @property
    def scores_only(self) -> bool:
        """max_tokens 0 with echo or prompt_logprobs: the prompt is scored and nothing generated (the
        engine runs one token, which is left out, as in vLLM)."""
        return self.max_tokens == 0 and (self.echo or self.prompt_logprobs is not None)

    def requested_max_tokens(self) -> int | None:
        return 1 if self.scores_only else self.max_tokens

    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def requested_prompt_logprobs(self) -> int | None:
        """echo with logprobs N scores the prompt with the top N; prompt_logprobs asks for its own N."""
        asked = self.prompt_logprobs
        if not self.echo or self.logprobs is None:
            return asked
        if asked is None:
            return self.logprobs
        # both: the larger, unless prompt_logprobs is out of range (SamplingParams then says so)
        return max(asked, self.logprobs) if 0 <= asked <= SamplingParams.MAX_LOGPROBS else asked

    def unsupported(self) -> tuple[str, str] | None:
        if self.suffix is not None:
            return "suffix is not supported", "suffix"
        return self.common_unsupported()


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: str


class FunctionCallIn(BaseModel):
    """A function call in an assistant message sent back: arguments as OpenAI sends them (JSON text), or as
    an object."""

    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str | dict[str, Any] = "{}"

    def arguments_object(self) -> Any:
        """The arguments as an object, as chat templates expect them (text that is not JSON stays text)."""
        if not isinstance(self.arguments, str):
            return self.arguments
        try:
            return json.loads(self.arguments) if self.arguments.strip() else {}
        except json.JSONDecodeError:
            return self.arguments


class ToolCallIn(BaseModel):
    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(BaseModel):
    """One message of a conversation. Besides OpenAI's current shapes, the older ones: role "function" (a
    function's result, named by `name`) and an assistant's `function_call`."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    function_call: FunctionCallIn | None = None
    tool_call_id: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _content_shape(cls, value: Any) -> Any:
        if value is None or isinstance(value, str):
            return value
        if not isinstance(value, list):
            raise ValueError("must be a string or a list of content parts")
        for i, part in enumerate(value):
            if not isinstance(part, dict):
                raise ValueError(f"part {i} must be an object like {{'type': 'text', 'text': '...'}}")
            kind = part.get("type")
            if kind != "text":
                raise ValueError(f"part {i} has type {kind!r}; only 'text' content parts are supported")
            if not isinstance(part.get("text"), str):
                raise ValueError(f"part {i} needs a string 'text'")
        return value

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and (self.tool_calls or self.function_call)):
            raise ValueError(f"a {self.role} message needs content")
        if (self.tool_calls or self.function_call) and self.role != "assistant":
            raise ValueError(f"only assistant messages carry tool calls, not {self.role} messages")
        if self.role == "function" and not self.name:
            raise ValueError("a function message needs the function's name")
        return self

    @property
    def is_tool_turn(self) -> bool:
        """A call to a tool, or a tool's result."""
        return self.role in ("tool", "function") or bool(self.tool_calls or self.function_call)

    def calls(self) -> list[ToolCallIn]:
        """The tool calls of an assistant message (an older `function_call` as one)."""
        if self.function_call is not None:
            return [*(self.tool_calls or []), ToolCallIn(function=self.function_call)]
        return list(self.tool_calls or [])

    def text(self) -> str:
        if isinstance(self.content, list):
            return "\n".join(part.text for part in self.content)
        return self.content or ""


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation as chat templates take it (the shapes of HF transformers' chat-template documents):
    content always one string ("" for an assistant turn that only calls tools); each call as
    {"id", "type": "function", "function": {"name", "arguments": <object>}}; each result as role "tool" with
    its `tool_call_id` and the `name` of the function it answers (the older role "function" and
    `function_call` become these)."""
    out: list[dict[str, Any]] = []
    name_of: dict[str, str] = {}  # call id -> function name
    last_id_of: dict[str, str] = {}  # function name -> the id of its latest call
    for i, m in enumerate(messages):
        message: dict[str, Any] = {"role": "tool" if m.role == "function" else m.role, "content": m.text()}
        if m.name is not None:
            message["name"] = m.name
        calls = m.calls()
        if calls:
            message["tool_calls"] = []
            for j, call in enumerate(calls):
                call_id = call.id or f"call_{i}_{j}"
                name_of[call_id] = call.function.name
                last_id_of[call.function.name] = call_id
                message["tool_calls"].append({"id": call_id, "type": "function", "function": {
                    "name": call.function.name, "arguments": call.function.arguments_object()}})
        if m.role in ("tool", "function"):
            call_id = m.tool_call_id or (last_id_of.get(m.name, "") if m.name else "")
            if call_id:
                message["tool_call_id"] = call_id
            name = m.name or name_of.get(call_id)
            if name:
                message["name"] = name
        out.append(message)
    return out


_RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "add_generation_prompt", "tools", "self"})


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"] = "function"
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    # the grammar of tool calls (set by the server: ferrum.server.chat_output), in place of any answer format
    _tool_grammar: StructuredOutput | None = PrivateAttr(None)

    def use_tool_grammar(self, grammar: str) -> None:
        self._tool_grammar = StructuredOutput("grammar", grammar, "tool_choice")

    def answer_format(self) -> StructuredOutput | None:
        """The structured output asked for the answer (response_format and the other spellings)."""
        return super().structured_output()

    def structured_output(self) -> StructuredOutput | None:
        if self._tool_grammar is None:
            return self.answer_format()
        try:
            checked_grammar(self._tool_grammar)
        except StructuredOutputError as exc:
            raise SamplingParamsError(f"tool_choice: the tools' parameters do not compile: {exc}",
                                      "tools") from None
        return self._tool_grammar

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def requested_logprobs(self) -> int | None:
        if not self.logprobs:
            return None
        return self.top_logprobs or 0

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def forced_tool(self) -> str | None:
        """The function a named tool_choice forces, else None."""
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    @property
    def calls_tools(self) -> bool:
        """Tools are given and may be called (tool_choice is not "none")."""
        return bool(self.tools) and self.tool_choice != "none"

    def template_kwargs(self) -> dict[str, Any]:
        return dict(self.chat_template_kwargs or {})

    def unsupported(self) -> tuple[str, str] | None:
        if self.top_logprobs is not None and not self.logprobs:
            return "top_logprobs requires logprobs to be true", "top_logprobs"
        if self.top_logprobs is not None and not 0 <= self.top_logprobs <= SamplingParams.MAX_LOGPROBS:
            return (
                f"top_logprobs must be between 0 and {SamplingParams.MAX_LOGPROBS}, got {self.top_logprobs}",
                "top_logprobs",
            )
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            return "tool_choice needs tools", "tool_choice"
        if isinstance(self.tool_choice, NamedToolChoice) and self.tools:
            names = [t.function.name for t in self.tools]
            if self.tool_choice.function.name not in names:
                return (f"tool_choice names {self.tool_choice.function.name!r}, which is not among the tools "
                        f"({', '.join(names)})", "tool_choice")
        reserved = _RESERVED_TEMPLATE_KWARGS.intersection(self.chat_template_kwargs or {})
        if reserved:
            return f"chat_template_kwargs may not set {sorted(reserved)}", "chat_template_kwargs"
        return self.common_unsupported()


# -- responses ----------------------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> Usage:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's Logprob: one token's logprob at a prompt position, its rank (1: the most likely) and text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# vLLM's prompt_logprobs: per prompt token (null for the first), token id -> its Logprob, for the
# prompt's own token and the top N
PromptLogprobs = list[dict[int, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: FinishReason | None = None
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=lambda v: v is None)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallOut(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None  # with --reasoning-parser: the model's thinking
    tool_calls: list[ToolCallOut] | None = None  # absent unless the model called tools


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=lambda v: v is None)  # vLLM's


class DeltaFunction(BaseModel):
    name: str | None = None
    arguments: str = ""

    @model_serializer(mode="plain")
    def _without_nulls(self) -> dict[str, Any]:
        return {"name": self.name, "arguments": self.arguments} if self.name is not None else {
            "arguments": self.arguments}


class DeltaToolCall(BaseModel):
    """A streamed piece of a tool call: the first has id, type and the function's name; the ones after it
    carry fragments of the arguments."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunction

    @model_serializer(mode="plain")
    def _without_nulls(self) -> dict[str, Any]:
        out: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            out["id"] = self.id
            out["type"] = self.type or "function"
        out["function"] = self.function.model_dump()
        return out


class DeltaMessage(BaseModel):
    """A streamed piece of the message; absent fields are left out, not sent as null."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="plain")
    def _without_nulls(self) -> dict[str, Any]:
        pairs = (("role", self.role), ("content", self.content), ("reasoning_content", self.reasoning_content),
                 ("tool_calls", [t.model_dump() for t in self.tool_calls] if self.tool_calls else None))
        return {k: v for k, v in pairs if v is not None}


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class CompletionChunk(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelQuantization(BaseModel):
    """How the served model's linear layers' weights are stored: quantized as they loaded, or as the
    published checkpoint stored them (`checkpoint` describes its format; method is its name)."""

    method: str  # int8 | int4 | fp8; a published checkpoint's format: gptq | awq | fp8 | compressed-tensors | gguf
    group_size: int | None  # int4: inputs per scale; null for int8 and fp8 (one scale per output channel)
    symmetric: bool | None  # null for a published checkpoint (its config says, per layer)
    skip: list[str]  # linear layers kept in the serving dtype
    checkpoint: str | None = None  # a published checkpoint's format, described
    chosen: str | None = None  # what `quantization: auto` picked for the device, and why


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "ferrum"
    root: str
    parent: str | None = None
    max_model_len: int
    quantization: ModelQuantization | None = None  # null: weights served unquantized
    kv_cache_dtype: str | None = None  # what the KV cache holds: the serving dtype, or int8


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# -- tokenizer routes ---------------------------------------------------------------------------------


class TokenizeRequest(BaseModel):
    """Either `prompt` (text) or `messages` (rendered with the chat template first)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    tools: list[ToolDef] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self

    def chat_request(self) -> ChatCompletionRequest:
        """The messages as a chat request, so that they are rendered exactly as a chat completion's."""
        return ChatCompletionRequest(messages=self.messages or [], tools=self.tools,
                                     add_generation_prompt=self.add_generation_prompt,
                                     chat_template_kwargs=self.chat_template_kwargs)


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
