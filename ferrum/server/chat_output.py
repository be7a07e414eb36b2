"""How a chat request's output is read back: plain text, or content and tool calls.

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
from ferrum.server.settings import ChatConfig
from ferrum.server.tool_calls import CallDelta, ToolCallStream, ToolFormat, ToolParserError, tool_format
from ferrum.tokenizer import Tokenizer


@dataclass(frozen=True)
class ChatOutput:
    tools: ToolFormat | None = None  # None: the output is plain content
    max_calls: int | None = None  # 1 when parallel_tool_calls is false

    def message(self, text: str, finish_reason: str | None) -> tuple[ChatResponseMessage, str | None]:
        if self.tools is None:
            return ChatResponseMessage(content=text), finish_reason
        stream = ToolCallStream(self.tools, self.max_calls)
        stream.feed(text)
        stream.finish()
        calls = [ToolCallOut(id=c.id, function=FunctionCall(name=c.name, arguments=c.arguments))
                 for c in stream.calls]
        content = stream.content if stream.content or not calls else None
        return ChatResponseMessage(content=content, tool_calls=calls or None), _finish(finish_reason, bool(calls))

    def stream(self) -> ChoiceStream:
        return ChoiceStream(ToolCallStream(self.tools, self.max_calls) if self.tools is not None else None)


class ChoiceStream:
    """One choice's deltas: `feed` each new piece of text, `finish` at its end."""

    def __init__(self, calls: ToolCallStream | None) -> None:
        self._calls = calls

    def feed(self, text: str) -> DeltaMessage | None:
        if self._calls is None:
            return DeltaMessage(content=text) if text else None
        return _delta(*self._calls.feed(text))

    def finish(self, finish_reason: str | None) -> tuple[DeltaMessage | None, str | None]:
        if self._calls is None:
            return None, finish_reason
        delta = _delta(*self._calls.finish())
        return delta, _finish(finish_reason, bool(self._calls.calls))


def _delta(content: str, calls: list[CallDelta]) -> DeltaMessage | None:
    if not content and not calls:
        return None
    tool_calls = [
        DeltaToolCall(index=c.index, id=c.id, type="function" if c.id else None,
                      function=DeltaFunction(name=c.name, arguments=c.arguments))
        for c in calls
    ]
    return DeltaMessage(content=content or None, tool_calls=tool_calls or None)


def _finish(reason: str | None, called: bool) -> str | None:
    return "tool_calls" if called and reason == "stop" else reason


def plan_chat_output(req: ChatCompletionRequest, tokenizer: Tokenizer, settings: ChatConfig) -> ChatOutput:
    """The request's output plan (see the module docstring); makes a forced tool choice a grammar on `req`."""
    if not req.calls_tools:
        return ChatOutput()
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
    return ChatOutput(fmt, None if parallel else 1)
