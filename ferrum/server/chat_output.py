"""How a chat request is put to the model and its output read back: plain text, or content and tool calls,
with a reasoning model's thinking apart (ferrum.server.reasoning).

`plan_chat` looks at the request once (its messages, tools, tool_choice and answer format, the server's `chat`
settings, the model's chat template) and returns a `ChatPlan`:
- the conversation as the chat template takes it: earlier tool calls and their results in the shapes
  templates know, and, for a template with no place for tool calls, each call written into its turn's text
  the way the model writes it;
- the `ChatOutput`, which turns each choice's text into the response message, or, streaming, into OpenAI's
  deltas; and on the request, the grammar that makes the tool choice hold (ferrum.server.tool_calls).

Tool choices, as OpenAI defines them: "none" reads no calls; "auto" lets the model answer or call (with an
answer format, the answer follows it); "required" makes it call one function or more (one when
`parallel_tool_calls` is false); a named function makes it call exactly that one, once. A forced choice
wins over an answer format (as in vLLM): the output is the call. What cannot work is a 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ferrum.config.server_settings import ChatConfig
from ferrum.engine.outputs import FinishReason as EngineFinishReason
from ferrum.server.errors import bad_request
from ferrum.server.protocol import (
    ChatCompletionRequest,
    ChatResponseMessage,
    DeltaFunction,
    DeltaMessage,
    DeltaToolCall,
    FinishReason,
    FunctionCall,
    ToolCallOut,
    template_messages,
)
from ferrum.server.reasoning import FORMATS as REASONING_FORMATS
from ferrum.server.reasoning import ReasoningFormat, ReasoningStream, split_reasoning
from ferrum.server.tool_calls import CallDelta, ToolCallStream, ToolFormat, ToolParserError, tool_format
from ferrum.tokenizer import Tokenizer


@dataclass(frozen=True)
class ChatOutput:
    tools: ToolFormat | None = None  # None: no tool calls are read from the output
    max_calls: int | None = None  # 1 when parallel_tool_calls is false or a function is named
    reasoning: ReasoningFormat | None = None  # None: no thinking part is separated
    names: frozenset[str] | None = None  # the functions that may be called: a "call" to another is content

    def message(
        self, text: str, finish_reason: EngineFinishReason | None
    ) -> tuple[ChatResponseMessage, FinishReason | None]:
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = split_reasoning(self.reasoning, text)
        if self.tools is None:
            return ChatResponseMessage(content=text, reasoning_content=reasoning), finish_reason
        stream = ToolCallStream(self.tools, self.max_calls, self.names)
        stream.feed(text)
        stream.finish()
        calls = [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in stream.calls]
        content = stream.content if stream.content or not calls else None
        message = ChatResponseMessage(content=content, reasoning_content=reasoning, tool_calls=calls or None)
        return message, _finish(finish_reason, bool(calls))

    def stream(self) -> ChoiceStream:
        return ChoiceStream(ToolCallStream(self.tools, self.max_calls, self.names) if self.tools is not None else None,
                            ReasoningStream(self.reasoning) if self.reasoning is not None else None)


class ChoiceStream:
    """One choice's deltas: `feed` each new piece of text, `finish` at its end."""

    def __init__(self, calls: ToolCallStream | None, reasoning: ReasoningStream | None) -> None:
        self._calls = calls
        self._reasoning = reasoning

    def feed(self, text: str) -> DeltaMessage | None:
        thought = ""
        if self._reasoning is not None:
            thought, text = self._reasoning.feed(text)
        if self._calls is None:
            return _delta(text, [], thought)
        return _delta(*self._calls.feed(text), thought)

    def finish(self, finish_reason: EngineFinishReason | None) -> tuple[DeltaMessage | None, FinishReason | None]:
        thought = text = ""
        if self._reasoning is not None:
            thought, text = self._reasoning.finish()
        if self._calls is None:
            return _delta(text, [], thought), finish_reason
        content, calls = self._calls.feed(text)
        more, last_calls = self._calls.finish()
        delta = _delta(content + more, calls + last_calls, thought)
        return delta, _finish(finish_reason, bool(self._calls.calls))


def _delta(content: str, calls: list[CallDelta], thought: str = "") -> DeltaMessage | None:
    if not content and not calls and not thought:
        return None
    tool_calls = [
        DeltaToolCall(index=c.index, id=c.id, type="function" if c.id else None,
                      function=DeltaFunction(name=c.name, arguments=c.arguments))
        for c in calls
    ]
    return DeltaMessage(content=content or None, reasoning_content=thought or None, tool_calls=tool_calls or None)


def _finish(reason: EngineFinishReason | None, called: bool) -> FinishReason | None:
    return "tool_calls" if called and reason == "stop" else reason


@dataclass(frozen=True)
class ChatPlan:
    messages: list[dict[str, Any]]  # the conversation as the chat template gets it
    output: ChatOutput


def plan_chat(req: ChatCompletionRequest, tokenizer: Tokenizer, settings: ChatConfig) -> ChatPlan:
    """The request's plan (see the module docstring); sets the tool grammar on `req` where one is needed."""
    reasoning = REASONING_FORMATS[settings.reasoning_parser] if settings.reasoning_parser else None
    messages = template_messages(req.messages)
    history = any(m.is_tool_turn for m in req.messages)
    if not req.calls_tools and not history:
        return ChatPlan(messages, ChatOutput(reasoning=reasoning))
    tools = req.template_tools()
    template = tokenizer.template_for(tools)
    try:
        fmt = tool_format(settings.tool_call_parser, template)
    except ToolParserError as exc:
        raise bad_request(str(exc), param="tools") from None
    if history and fmt is not None and "tool_calls" not in (template or ""):
        messages = _calls_as_text(messages, fmt)
    if not req.calls_tools:
        return ChatPlan(messages, ChatOutput(reasoning=reasoning))
    if fmt is None:
        raise bad_request(
            "This model's chat template shows no tool-call format Ferrum knows, so tool calls could not be "
            "read from its output; start the server with --tool-call-parser hermes, llama3_json or mistral "
            "(the format the model was trained to write), or send tool_choice 'none'.", param="tools")
    assert tools is not None
    forced = req.forced_tool()
    one = forced is not None or req.parallel_tool_calls is False
    answer = req.answer_format()  # checked even where a forced choice leaves it unused
    try:
        if req.tool_choice == "required" or forced is not None:
            req.use_tool_grammar(fmt.grammar(tools, forced, parallel=not one))
        elif answer is not None and answer.kind == "json":  # "auto": calls, or an answer in the format
            req.use_tool_grammar(fmt.grammar(tools, None, parallel=not one, otherwise=f"%json {answer.spec}"))
    except ToolParserError as exc:
        raise bad_request(str(exc), param="tool_choice") from None
    names = frozenset(t["function"]["name"] for t in tools)
    return ChatPlan(messages, ChatOutput(fmt, 1 if one else None, reasoning, names))


def _calls_as_text(messages: list[dict[str, Any]], fmt: ToolFormat) -> list[dict[str, Any]]:
    """Assistant turns with their tool calls written into the text, for a template that would drop them."""
    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            written = fmt.render([(c["function"]["name"], c["function"]["arguments"]) for c in calls])
            message = {**message, "content": "\n".join(filter(None, [message["content"], written]))}
        out.append(message)
    return out
