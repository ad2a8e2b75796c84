"""`reasoning_content`: the `<think>...</think>` part of a reasoning model's answer, split off
by `--reasoning-parser` (vLLM's and SGLang's names `deepseek_r1` and `qwen3`).

Like the tool parsers, a reasoning parser is a pure function of the text so far that holds back
what could still be a tag, so streamed deltas concatenate to the non-streamed split.
- deepseek_r1: the template opens `<think>` in the prompt, so the answer starts inside the
  reasoning (a leading `<think>` is skipped if the model writes it); everything before
  `</think>` is reasoning, and an answer with no `</think>` is all reasoning.
- qwen3: reasoning only when the answer starts with `<think>` (thinking can be switched off by
  the template's enable_thinking); then up to `</think>`, or to the end if it never closes.
"""

from __future__ import annotations

from dataclasses import dataclass

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str
    content: str


def _held(text: str, marker: str) -> int:
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


@dataclass(frozen=True)
class ReasoningParser:
    """`split(text, final)`: every non-final result is a prefix (field by field) of any later
    one. `implicit_start`: the answer begins inside the reasoning (deepseek_r1)."""

    name: str
    implicit_start: bool

    def split(self, text: str, final: bool) -> ReasoningSplit:
        lead = len(text) - len(text.lstrip())
        body = text[lead:]
        if body.startswith(THINK_START):
            inner = body[len(THINK_START):]
        elif not final and THINK_START.startswith(body):
            return ReasoningSplit("", "")  # empty so far, or maybe the start tag
        elif self.implicit_start:
            inner = text
        else:
            return ReasoningSplit("", text)
        end = inner.find(THINK_END)
        if end < 0:
            return ReasoningSplit(inner if final else inner[:len(inner) - _held(inner, THINK_END)], "")
        return ReasoningSplit(inner[:end], inner[end + len(THINK_END):])


REASONING_PARSERS = {"deepseek_r1": ReasoningParser("deepseek_r1", True),
                     "qwen3": ReasoningParser("qwen3", False)}


def make_reasoning_parser(name: str) -> ReasoningParser | None:
    """The parser for `--reasoning-parser` ('' = none); an unknown name is a ValueError."""
    if not name:
        return None
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not supported; choose one of "
                         f"{sorted(REASONING_PARSERS)}")
    return REASONING_PARSERS[name]
