"""OpenAI's Responses API (`POST /v1/responses`) on top of chat completions.

A Responses request is turned into a chat request (`ResponsesRequest.to_chat`: `instructions` as the system
message, `input` items as messages, function tools, `text.format` as response_format, max_output_tokens),
served by the same path as /v1/chat/completions, and its result turned back: a `response` object with
`message` and `function_call` output items, or, streaming, the Responses event sequence (response.created,
output items and content parts added, output_text / function_call_arguments deltas and their done events,
response.completed). Stateless: responses are not stored, so `previous_response_id` is refused (400) and
`store` is reported false; send the whole conversation in `input`.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag, ValidationError, field_validator

from ferrum.engine.sampling_params import SamplingParamsError
from ferrum.server.errors import bad_request
from ferrum.server.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ResponseFormat,
)

# -- the request ------------------------------------------------------------------------------------------


class InputText(BaseModel):
    """A text part of a message's content (a refusal from an earlier response counts as its text)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str = ""
    refusal: str | None = None

    def value(self) -> str:
        return self.refusal or "" if self.type == "refusal" else self.text


def _text(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "".join(p.value() for p in content)


class InputMessage(BaseModel):
    """A message: the easy form ({"role", "content"}), or an input or output message item."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]


class FunctionCallItem(BaseModel):
    """A function call from an earlier response, sent back."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(BaseModel):
    """A function's result, for the call with `call_id`: text, or a list of text parts."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str
    output: str | list[InputText]


class ReasoningItem(BaseModel):
    """An earlier response's reasoning, sent back: not shown to the model again (as chat templates drop the
    thinking of earlier turns)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["reasoning"]


_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


def _item_type(item: Any) -> str | None:
    if isinstance(item, dict):
        return str(item.get("type", "message"))
    return getattr(item, "type", None)


InputItem = Annotated[
    Annotated[InputMessage, Tag("message")] | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")] | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(_item_type),
]


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="ignore")

    format: TextFormat = Field(default_factory=TextFormat)


class NamedFunctionChoice(BaseModel):
    type: Literal["function"]
    name: str


class AllowedTools(BaseModel):
    """tool_choice {"type": "allowed_tools", "mode", "tools"}: only these functions, called as `mode` says."""

    type: Literal["allowed_tools"]
    mode: Literal["auto", "required"]
    tools: list[NamedFunctionChoice]


class ResponsesRequest(BaseModel):
    """What /v1/responses accepts (text in and out, function tools; no stored state)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | AllowedTools | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    seed: int | None = None

    @field_validator("input", mode="before")
    @classmethod
    def _item_types(cls, value: Any) -> Any:
        for i, item in enumerate(value if isinstance(value, list) else []):
            kind = _item_type(item)
            if kind == "item_reference":
                raise ValueError(f"item {i}: item_reference needs stored responses, which Ferrum does not keep "
                                 "(stateless); send the items themselves")
            if isinstance(item, dict) and kind not in _ITEM_TYPES:
                raise ValueError(f"item {i} has type {kind!r}, which is not supported; Ferrum takes "
                                 f"{', '.join(_ITEM_TYPES)} items (function tools only)")
        return value

    def to_chat(self) -> ChatCompletionRequest:
        if self.previous_response_id is not None:
            raise bad_request("previous_response_id is not supported: Ferrum keeps no responses (stateless); "
                              "send the whole conversation in input", param="previous_response_id")
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        items = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        for item in items:
            if isinstance(item, InputMessage):
                role = "system" if item.role == "developer" else item.role
                messages.append({"role": role, "content": _text(item.content)})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                    messages[-1]["tool_calls"].append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
        if not messages:
            raise bad_request("input must hold at least one message", param="input")
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "max_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream, "seed": self.seed,
            "parallel_tool_calls": self.parallel_tool_calls,
        }
        tools = self.tools or []
        choice = self.tool_choice
        if isinstance(choice, AllowedTools):
            allowed = {t.name for t in choice.tools}
            missing = allowed - {t.name for t in tools}
            if missing:
                raise bad_request(f"tool_choice.tools names {sorted(missing)}, not among the tools",
                                  param="tool_choice.tools")
            tools = [t for t in tools if t.name in allowed]
            choice = choice.mode
        if tools:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in tools]
        if choice is not None:
            body["tool_choice"] = (choice if isinstance(choice, str) else
                                   {"type": "function", "function": {"name": choice.name}})
        fmt = self.text.format if self.text is not None else None
        if fmt is not None and fmt.type != "text":
            if fmt.type == "json_object":
                body["response_format"] = ResponseFormat(type="json_object")
            else:
                if fmt.schema_ is None:
                    raise bad_request("text.format of type json_schema needs a schema", param="text.format.schema")
                body["response_format"] = {"type": "json_schema", "json_schema": {
                    "name": fmt.name or "response", "schema": fmt.schema_, "strict": fmt.strict}}
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        try:
            chat = ChatCompletionRequest.model_validate(body)
        except ValidationError as exc:  # what the chat request refuses, named in this request's terms
            first = exc.errors()[0]
            where = ".".join(str(p) for p in first["loc"])
            raise bad_request(f"{where}: {first['msg']}", param="input" if where.startswith("messages") else where) \
                from None
        try:
            chat.answer_format()
        except SamplingParamsError as exc:  # a bad text.format, named as such
            message = str(exc).replace("response_format.json_schema.schema", "text.format.schema")
            raise bad_request(message, param="text.format.schema") from None
        return chat


# -- the response -------------------------------------------------------------------------------------------


class ResponseObject(BaseModel):
    """The `response` object (for the API's schema; built as a dict by ResponsesShape)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress"]
    model: str
    output: list[dict[str, Any]]
    usage: dict[str, Any] | None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    store: bool = False


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponsesShape:
    """Turns one chat result (or stream of chunks) into the Responses API's object (or events)."""

    def __init__(self, req: ResponsesRequest, response_id: str, model: str) -> None:
        self.req = req
        self.id = response_id
        self.model = model
        self.created = int(time.time())

    def _envelope(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                  incomplete: str | None = None) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format.model_dump(by_alias=True, exclude_none=True) if req.text else {"type": "text"}
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status, "model": self.model,
            "output": output, "usage": usage, "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "temperature": req.temperature if req.temperature is not None else 1.0,
            "top_p": req.top_p if req.top_p is not None else 1.0,
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "tool_choice": (req.tool_choice if isinstance(req.tool_choice, str) or req.tool_choice is None
                            else req.tool_choice.model_dump()) or "auto",
            "parallel_tool_calls": req.parallel_tool_calls is not False, "text": {"format": fmt},
            "previous_response_id": None, "store": False, "metadata": req.metadata or {}, "user": req.user,
        }

    @staticmethod
    def _usage(prompt: int, completion: int) -> dict[str, Any]:
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": completion,
                "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt + completion}

    def response(self, chat: ChatCompletionResponse) -> dict[str, Any]:
        choice = chat.choices[0]
        output: list[dict[str, Any]] = []
        if choice.message.content:
            output.append(_message_item(_id("msg"), choice.message.content, "completed"))
        for call in choice.message.tool_calls or []:
            output.append(_call_item(_id("fc"), call.id, call.function.name, call.function.arguments, "completed"))
        length = choice.finish_reason == "length"
        usage = self._usage(chat.usage.prompt_tokens, chat.usage.completion_tokens)
        return self._envelope("incomplete" if length else "completed", output, usage,
                              "max_output_tokens" if length else None)

    async def events(self, chunks: AsyncGenerator[ChatCompletionChunk, None]) -> AsyncGenerator[dict[str, Any], None]:
        seq = 0

        def event(kind: str, **fields: Any) -> dict[str, Any]:
            nonlocal seq
            seq += 1
            return {"type": kind, "sequence_number": seq - 1, **fields}

        yield event("response.created", response=self._envelope("in_progress", [], None))
        yield event("response.in_progress", response=self._envelope("in_progress", [], None))
        output: list[dict[str, Any]] = []
        text_item: dict[str, Any] | None = None
        calls: dict[int, dict[str, Any]] = {}  # chat tool-call index -> output item
        finish = None
        usage = None

        def close_text() -> list[dict[str, Any]]:
            nonlocal text_item
            if text_item is None:
                return []
            item, text_item = text_item, None
            index = output.index(item)
            item["status"] = "completed"
            part = item["content"][0]
            return [event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                          text=part["text"]),
                    event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                          part=part),
                    event("response.output_item.done", output_index=index, item=item)]

        async for chunk in chunks:
            if chunk.usage is not None:
                usage = self._usage(chunk.usage.prompt_tokens, chunk.usage.completion_tokens)
            for c in chunk.choices:
                delta = c.delta
                if delta.content:
                    if text_item is None:
                        text_item = _message_item(_id("msg"), "", "in_progress")
                        output.append(text_item)
                        index = len(output) - 1
                        yield event("response.output_item.added", output_index=index,
                                    item={**text_item, "content": []})
                        yield event("response.content_part.added", item_id=text_item["id"], output_index=index,
                                    content_index=0, part={"type": "output_text", "text": "", "annotations": []})
                    text_item["content"][0]["text"] += delta.content
                    yield event("response.output_text.delta", item_id=text_item["id"],
                                output_index=output.index(text_item), content_index=0, delta=delta.content)
                for tc in delta.tool_calls or []:
                    if tc.index not in calls:
                        for e in close_text():
                            yield e
                        item = _call_item(_id("fc"), tc.id or _id("call"), tc.function.name or "", "", "in_progress")
                        calls[tc.index] = item
                        output.append(item)
                        yield event("response.output_item.added", output_index=len(output) - 1, item=dict(item))
                    item = calls[tc.index]
                    if tc.function.arguments:
                        item["arguments"] += tc.function.arguments
                        yield event("response.function_call_arguments.delta", item_id=item["id"],
                                    output_index=output.index(item), delta=tc.function.arguments)
                if c.finish_reason is not None:
                    finish = c.finish_reason
        for e in close_text():
            yield e
        for item in calls.values():
            index = output.index(item)
            item["status"] = "completed"
            yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                        arguments=item["arguments"])
            yield event("response.output_item.done", output_index=index, item=item)
        length = finish == "length"
        final = self._envelope("incomplete" if length else "completed", output, usage,
                               "max_output_tokens" if length else None)
        yield event("response.incomplete" if length else "response.completed", response=final)


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}
