"""Tool calls parsed out of a chat model's text: Hermes/Qwen `<tool_call>{json}</tool_call>` blocks
and Llama 3 JSON (`{"name": ..., "parameters": ...}`, `;`-separated), under vLLM's
`--tool-call-parser` names, or detected from the chat template.

A parser is a pure function of the text so far: `split(text, final)` returns the content and the
complete tool calls found. While `final` is False it holds back what could still turn out to be
part of a call, so every result is a prefix of the next one; streaming sends the difference
between two results and the non-streamed reply is `split(whole, final=True)`. Both therefore
agree by construction.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON text, as OpenAI's function.arguments


@dataclass(frozen=True)
class ToolSplit:
    content: str  # text outside the calls that is safe to show now
    calls: tuple[ToolCall, ...] = ()


def _call_from(obj, args_keys: tuple[str, ...]) -> ToolCall | None:
    """A ToolCall from a decoded JSON object {"name": str, <args key>: object}, or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in args_keys if k in obj), None)
    args = {} if key is None else obj[key]
    if isinstance(args, str):  # some models write the arguments already encoded
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _partial_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ToolParser(ABC):
    """Contract: `split(text, final)` is deterministic, and for a text t2 that extends t1,
    split(t1, False) is a prefix of split(t2, f) (content is a string prefix, calls a tuple
    prefix). Text that is not a well-formed call is returned as content, never dropped."""

    name: str = ""

    @abstractmethod
    def split(self, text: str, final: bool) -> ToolSplit:
        ...


class HermesToolParser(ToolParser):
    """`<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>` blocks (Hermes 2/3,
    Qwen 2.5/3). Text before the first block is content; after a call, whitespace between
    blocks is dropped and other text is content; a block that does not parse is content."""

    name = "hermes"
    START, END = "<tool_call>", "</tool_call>"

    def split(self, text: str, final: bool) -> ToolSplit:
        content, calls, pos = "", [], 0
        while True:
            i = text.find(self.START, pos)
            if i < 0:
                tail = text[pos:]
                if not final:
                    tail = tail[:len(tail) - _partial_prefix(tail, self.START)]
                content += self._gap(tail, bool(calls))
                break
            content += self._gap(text[pos:i], bool(calls))
            j = text.find(self.END, i)
            if j < 0 and not final:
                break
            inner = text[i + len(self.START):] if j < 0 else text[i + len(self.START):j]
            end = len(text) if j < 0 else j + len(self.END)
            call = self._parse(inner)
            if call is None:
                content += text[i:end]
            else:
                calls.append(call)
            pos = end
        if (calls or not final) and not content.strip():
            content = ""  # whitespace alone waits, and is dropped next to calls
        return ToolSplit(content, tuple(calls))

    @staticmethod
    def _gap(text: str, after_call: bool) -> str:
        return "" if after_call and not text.strip() else text

    @staticmethod
    def _parse(inner: str) -> ToolCall | None:
        try:
            obj = json.loads(inner)
        except ValueError:
            return None
        return _call_from(obj, ("arguments", "parameters"))


class Llama3JsonToolParser(ToolParser):
    """Llama 3.x JSON tool calls: the whole answer is `{"name": ..., "parameters": {...}}`
    objects separated by `;` (optionally after `<|python_tag|>`). An answer that does not start
    with `{` is plain content; objects that do not parse as calls, and what follows them, are
    content."""

    name = "llama3_json"
    TAG = "<|python_tag|>"

    def split(self, text: str, final: bool) -> ToolSplit:
        body = text.lstrip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].lstrip()
        elif not final and self.TAG.startswith(body):
            return ToolSplit("")  # empty, or maybe the start of the tag
        if not body.startswith("{"):
            return ToolSplit(text if final or body else "")
        dec = json.JSONDecoder()
        calls, pos = [], 0
        while pos < len(body):
            try:
                obj, end = dec.raw_decode(body, pos)
            except ValueError:
                break
            call = _call_from(obj, ("parameters", "arguments"))
            if call is None:
                break
            calls.append(call)
            pos = end
            rest = body[pos:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            pos = len(body) - len(rest)
        if not calls:
            return ToolSplit(text if final else "")
        tail = body[pos:]
        return ToolSplit(tail if final and tail.strip() else "", tuple(calls))


TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}


def make_tool_parser(name: str) -> ToolParser:
    """The parser for a `--tool-call-parser` name; an unknown name is a ValueError listing ours."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not supported; choose one of "
                         f"{sorted(TOOL_PARSERS)} or leave it empty to detect it from the chat template")
    return TOOL_PARSERS[name]()


def detect_tool_parser(template: str | None) -> ToolParser | None:
    """The parser a chat template's own tool-call format implies, or None (no tools in it)."""
    if not template or "tools" not in template:
        return None
    if HermesToolParser.START in template:
        return HermesToolParser()
    if '"parameters"' in template or "python_tag" in template or "ipython" in template:
        return Llama3JsonToolParser()
    return None
