"""How a chat request's output is read back: plain text, or content and tool calls, with a reasoning model's
thinking apart (ferrum.server.reasoning).

`plan_chat_output` looks at the request once (its tools and tool_choice, the server's `chat` settings, the
model's chat template): it picks the tool-call format, makes "required" and named tool choices hold through
a grammar (ferrum.server.tool_calls), and refuses what cannot work with a 400. The `ChatOutput` it returns
turns each choice's text into the response message, or, streaming, into OpenAI's deltas.
"""

from __future__ import annotations

from dataclasses import dataclass

from ferrum.server.errors import bad_request
from ferrum.server.protocol import (
    ChatCompletionRequest,
    ChatResponseMessage,
    DeltaFunction,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCallOut,
)
from ferrum.server.reasoning import FORMATS as REASONING_FORMATS
from ferrum.server.reasoning import ReasoningFormat, ReasoningStream, split_reasoning
from ferrum.server.settings import ChatConfig
from ferrum.server.tool_calls import CallDelta, ToolCallStream, ToolFormat, ToolParserError, tool_format
from ferrum.tokenizer import Tokenizer


@dataclass(frozen=True)
class ChatOutput:
    tools: ToolFormat | None = None  # None: no tool calls are read from the output
    max_calls: int | None = None  # 1 when parallel_tool_calls is false
    reasoning: ReasoningFormat | None = None  # None: no thinking part is separated

    def message(self, text: str, finish_reason: str | None) -> tuple[ChatResponseMessage, str | None]:
        reasoning = None
        if self.reasoning is not None:
            reasoning, text = split_reasoning(self.reasoning, text)
        if self.tools is None:
            return ChatResponseMessage(content=text, reasoning_content=reasoning), finish_reason
        stream = ToolCallStream(self.tools, self.max_calls)
        stream.feed(text)
        stream.finish()
        calls = [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in stream.calls]
        content = stream.content if stream.content or not calls else None
        message = ChatResponseMessage(content=content, reasoning_content=reasoning, tool_calls=calls or None)
        return message, _finish(finish_reason, bool(calls))

    def stream(self) -> ChoiceStream:
        return ChoiceStream(ToolCallStream(self.tools, self.max_calls) if self.tools is not None else None,
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

    def finish(self, finish_reason: str | None) -> tuple[DeltaMessage | None, str | None]:
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


def _finish(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


def plan_chat_output(req: ChatCompletionRequest, tokenizer: Tokenizer, settings: ChatConfig) -> ChatOutput:
    """The request's output plan (see the module docstring); makes a forced tool choice a grammar on `req`."""
    reasoning = REASONING_FORMATS[settings.reasoning_parser] if settings.reasoning_parser else None
    if not req.calls_tools:
        return ChatOutput(reasoning=reasoning)
    tools = req.template_tools() or []
    try:
        fmt = tool_format(settings.tool_call_parser, tokenizer.template_for(tools))
    except ToolParserError as exc:
        raise bad_request(str(exc), param="tools") from None
    if fmt is None:
        raise bad_request(
            "This model's chat template shows no tool-call format Ferrum knows, so tool calls could not be "
            "read from its output; start the server with --tool-call-parser hermes, llama3_json or mistral "
            "(the format the model was trained to write), or send tool_choice 'none'.", param="tools")
    parallel = req.parallel_tool_calls is not False
    if req.tool_choice == "required" or req.forced_tool() is not None:
        try:
            req.force_tool_calls(fmt.grammar(tools, req.forced_tool(), parallel))
        except ToolParserError as exc:
            raise bad_request(str(exc), param="tool_choice") from None
    return ChatOutput(fmt, None if parallel else 1, reasoning)
