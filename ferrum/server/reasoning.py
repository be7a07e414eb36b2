"""Reasoning models: the thinking part of an output (`<think>...</think>`) separated from the answer, as
`reasoning_content` beside `content`, whole or as a stream.

    qwen3         thinking only inside <think>...</think> written by the model; an output without <think> is
                  all answer
    deepseek_r1   the chat template opens <think> in the prompt: everything up to </think> is thinking (a
                  leading <think> written by the model is dropped too); an output that never closes it is all
                  thinking
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    starts_inside: bool  # the output begins in the thinking part
    open_tag: str = "<think>"
    close_tag: str = "</think>"


FORMATS = {"qwen3": ReasoningFormat("qwen3", False), "deepseek_r1": ReasoningFormat("deepseek_r1", True)}


class ReasoningStream:
    """`feed(text)` -> (reasoning, answer) new since the last call; `finish()` the rest. Tags are never
    output, and a tag split across pieces is held back until it is whole."""

    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self._buffer = ""
        self._state = "start"  # start (nothing decided yet) | thinking | answer
        self.thought = False  # a thinking part was entered
        self.reasoning = ""
        self.answer = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buffer += text
        return self._drain(final=False)

    def finish(self) -> tuple[str, str]:
        return self._drain(final=True)

    def _drain(self, final: bool) -> tuple[str, str]:
        reasoning = answer = ""
        fmt = self.fmt
        while self._buffer:
            if self._state == "start":
                head = self._buffer.lstrip()
                if head.startswith(fmt.open_tag):
                    self._buffer = head[len(fmt.open_tag):]
                    self._state = "thinking"
                elif fmt.open_tag.startswith(head) and not final:
                    break  # could still become <think>
                else:
                    self._state = "thinking" if fmt.starts_inside else "answer"
                self.thought = self._state == "thinking"
                continue
            if self._state == "answer":
                if self.thought and not (self.answer or answer):  # the blank lines after </think>
                    self._buffer = self._buffer.lstrip("\n")
                answer += self._buffer
                self._buffer = ""
                break
            i = self._buffer.find(fmt.close_tag)
            if i >= 0:
                reasoning += self._buffer[:i]
                self._buffer = self._buffer[i + len(fmt.close_tag):]
                self._state = "answer"
                continue
            keep = 0 if final else _partial_suffix(self._buffer, fmt.close_tag)
            reasoning += self._buffer[:len(self._buffer) - keep]
            self._buffer = self._buffer[len(self._buffer) - keep:]
            break
        if final and self._buffer:  # an unfinished tag at the very end
            if self._state == "answer":
                answer += self._buffer
            else:
                reasoning += self._buffer
            self._buffer = ""
        self.reasoning += reasoning
        self.answer += answer
        return reasoning, answer


def _partial_suffix(text: str, tag: str) -> int:
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[len(text) - n:]):
            return n
    return 0


def split_reasoning(fmt: ReasoningFormat, text: str) -> tuple[str | None, str]:
    """(reasoning or None when there was none, answer) of a whole output."""
    stream = ReasoningStream(fmt)
    stream.feed(text)
    stream.finish()
    return (stream.reasoning if stream.thought else None), stream.answer
