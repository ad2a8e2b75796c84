"""One chat choice's answer text -> OpenAI message fields: `reasoning_content` (reasoning
parser), `content` and `tool_calls` (tool parser), whole or as streamed deltas.

`ChatOutput.delta(text, final)` takes the choice's visible text so far and returns what is new
since the last call, in OpenAI's delta shape (a tool call comes whole in one delta: index, id,
type, name and arguments). `message(text)` is the non-streamed message. Both run the same
parsers on the same text, so the deltas concatenate to the message.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from .reasoning import THINK_END, ReasoningParser
from .tool_parsers import ToolCall, ToolParser


def tool_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def call_json(call: ToolCall, call_id: str, index: int | None = None) -> dict:
    out = {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
    return out if index is None else {"index": index, **out}


@dataclass(frozen=True)
class ChatShape:
    """How a request's answers are read: the reasoning split (None: none) and the tool parser
    (None: tools are not parsed; for a forced tool_choice, one that reads the grammar's JSON).
    `tool_calls_finish`: finish_reason is "tool_calls" when calls were found (OpenAI says
    "stop" for a named tool_choice)."""

    reasoning: ReasoningParser | None = None
    tools: ToolParser | None = None
    tool_calls_finish: bool = True
    stream_reasoning: bool = True  # SGLang's: False sends the reasoning in one delta once it ended

    @property
    def plain(self) -> bool:
        return self.reasoning is None and self.tools is None


@dataclass
class ChatOutput:
    shape: ChatShape
    reasoning_sent: int = 0
    content_sent: int = 0
    ids: list[str] = field(default_factory=list)  # one per tool call sent

    def _parts(self, text: str, final: bool) -> tuple[str | None, str, tuple[ToolCall, ...]]:
        reasoning = None
        if self.shape.reasoning is not None:
            r = self.shape.reasoning.split(text, final)
            reasoning, text = r.reasoning, r.content
        parser = self.shape.tools
        if parser is None:
            return reasoning, text, ()
        s = parser.split(text, final)
        return reasoning, s.content, s.calls

    def message(self, text: str) -> dict:
        reasoning, content, calls = self._parts(text, True)
        msg: dict = {"role": "assistant", "content": content if content or not calls else None}
        if reasoning is not None:
            msg["reasoning_content"] = reasoning or None
        if calls:
            msg["tool_calls"] = [call_json(c, tool_call_id()) for c in calls]
        return msg

    def delta(self, text: str, final: bool) -> dict:
        """The new part as a delta object (empty dict: nothing new)."""
        reasoning, content, calls = self._parts(text, final)
        out: dict = {}
        ended = final or bool(content) or bool(calls) or (self.shape.reasoning is not None and
                                                          THINK_END in text)
        if reasoning is not None and len(reasoning) > self.reasoning_sent and \
                (self.shape.stream_reasoning or ended):
            out["reasoning_content"] = reasoning[self.reasoning_sent:]
            self.reasoning_sent = len(reasoning)
        if len(content) > self.content_sent:
            out["content"] = content[self.content_sent:]
            self.content_sent = len(content)
        if len(calls) > len(self.ids):
            new = []
            for k in range(len(self.ids), len(calls)):
                self.ids.append(tool_call_id())
                new.append(call_json(calls[k], self.ids[k], k))
            out["tool_calls"] = new
        return out
