"""OpenAI reply shapes: completion and chat objects, and their streamed chunks.

A `OpenAIReply` is built once per HTTP request (id, created, model name, kind) and turns item
progress into JSON. Streaming sends deltas of the text safe to show; their concatenation is
exactly the non-streamed text. A chat call with a reasoning or tool parser (`call.shape`) reads
each choice's text through server/chat_output.py into reasoning_content, content and tool_calls.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from .chat_output import ChatOutput
from .openai_logprobs import CompletionLogprobs, chat_content
from .openai_protocol import OpenAICall
from .request_state import ItemProgress
from .tokenizer import ServerTokenizer


def finish_reason(prog: ItemProgress) -> str | None:
    if not prog.finished or prog.finish_reason is None:
        return None
    return str(prog.finish_reason.get("type", "stop"))


def matched_stop(prog: ItemProgress):
    return (prog.finish_reason or {}).get("matched") if prog.finished else None


@dataclass
class _Cursor:
    """What one choice has streamed so far."""

    chars: int = 0
    tokens: int = 0
    started: bool = False
    done: bool = False


@dataclass
class OpenAIReply:
    call: OpenAICall
    tok: ServerTokenizer
    model: str
    chat: bool
    id: str = ""
    created: int = 0
    cursors: dict[int, _Cursor] = field(default_factory=dict)
    outputs: dict[int, ChatOutput] = field(default_factory=dict)  # chat choices read by call.shape

    def __post_init__(self):
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = self.created or int(time.time())

    # ---- logprobs ----------------------------------------------------------------------------
    def _echo(self, prog: ItemProgress) -> str:
        """Completions echo: the prompt text put before this choice's output ("" without echo)."""
        texts = self.call.echo_texts
        return "" if texts is None else texts[prog.item.index // self.call.n]

    def _logprobs(self, prog: ItemProgress, start: int, end: int, text_offset: int = 0,
                  with_prompt: bool = False):
        """Output tokens [start, end) (text from text_offset of the output); `with_prompt`: the
        echoed prompt's tokens before them."""
        if not self.call.logprobs:
            return None
        ids, lps = prog.output_ids[start:end], prog.output_logprobs[start:end]
        tops = prog.output_top_logprobs[start:end]
        if self.chat:
            return chat_content(self.tok, ids, lps, tops)
        build = CompletionLogprobs(self.tok, self.call.top_logprobs)
        out = build.build(ids, lps, tops, len(self._echo(prog)) + text_offset)
        if with_prompt and self.call.echo_texts is not None:
            prompt = prog.item.input_ids
            plps = prog.input_logprobs or [None] * len(prompt)
            out = build.join(build.build(prompt, plps, prog.input_top_logprobs or [], 0), out)
        return out

    # ---- whole replies -----------------------------------------------------------------------
    def usage(self, progs: list[ItemProgress]) -> dict:
        n = self.call.n
        firsts = [p for p in progs if p.item.index % n == 0]
        prompt = sum(p.prompt_tokens for p in firsts)
        completion = sum(len(p.output_ids) for p in progs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": sum(p.cached_tokens for p in firsts)}}

    def _choice(self, prog: ItemProgress) -> dict:
        c: dict = {"index": prog.item.index}
        calls = False
        if self.chat and not self.call.shape.plain:
            c["message"] = ChatOutput(self.call.shape).message(prog.text)
            calls = bool(c["message"].get("tool_calls"))
        elif self.chat:
            c["message"] = {"role": "assistant", "content": prog.text}
        else:
            c["text"] = self._echo(prog) + prog.text
        c["logprobs"] = self._logprobs(prog, 0, len(prog.output_ids), with_prompt=True)
        c["finish_reason"] = self._finish_reason(prog, calls)
        c["matched_stop"] = matched_stop(prog)
        return c

    def full(self, progs: list[ItemProgress]) -> dict:
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model,
                "choices": [self._choice(p) for p in sorted(progs, key=lambda p: p.item.index)],
                "usage": self.usage(progs)}

    # ---- streaming ---------------------------------------------------------------------------
    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        out = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
               "created": self.created, "model": self.model, "choices": choices}
        if self.call.include_usage:
            out["usage"] = usage
        return out

    def chunk(self, prog: ItemProgress) -> dict | None:
        """The next chunk for this choice, or None when nothing new is safe to show."""
        cur = self.cursors.setdefault(prog.item.index, _Cursor())
        if cur.done:
            return None
        text = prog.visible_text()
        delta = text[cur.chars:]
        shaped = None  # chat read by call.shape: the new reasoning / content / tool calls
        if self.chat and not self.call.shape.plain:
            shaped = self._chat_output(prog.item.index).delta(text, prog.finished)
        new = bool(delta) if shaped is None else bool(shaped)
        ntok = len(prog.output_ids) if new or prog.finished else cur.tokens
        if not new and not prog.finished and cur.started:
            return None
        choice: dict = {"index": prog.item.index}
        if self.chat:
            d = {"content": delta} if shaped is None else shaped
            choice["delta"] = d if cur.started else {"role": "assistant", "content": "", **d}
        else:
            choice["text"] = delta if cur.started else self._echo(prog) + delta
        choice["logprobs"] = self._logprobs(prog, cur.tokens, ntok, cur.chars, with_prompt=not cur.started)
        choice["finish_reason"] = self._finish_reason(
            prog, shaped is not None and bool(self._chat_output(prog.item.index).ids))
        if prog.finished:
            choice["matched_stop"] = matched_stop(prog)
        cur.chars, cur.tokens, cur.started, cur.done = len(text), ntok, True, prog.finished
        return self._chunk([choice])

    def _chat_output(self, index: int) -> ChatOutput:
        return self.outputs.setdefault(index, ChatOutput(self.call.shape))

    def _finish_reason(self, prog: ItemProgress, tool_calls: bool) -> str | None:
        """OpenAI's "tool_calls" for an answer that stopped after calling tools (auto/required)."""
        reason = finish_reason(prog)
        if reason == "stop" and tool_calls and self.call.shape.tool_calls_finish:
            return "tool_calls"
        return reason

    def usage_chunk(self, progs: list[ItemProgress]) -> dict | None:
        return self._chunk([], self.usage(progs)) if self.call.include_usage else None

    # ---- migration (server/resume.py) --------------------------------------------------------
    def resume(self, progs) -> None:
        """A continuation: its choice already streamed the replayed text and tokens elsewhere."""
        for prog in progs:
            if prog.item.resume is not None:
                self.cursors[prog.item.index] = _Cursor(len(prog.visible_text()), len(prog.output_ids), True)
                if self.chat and not self.call.shape.plain:  # its parts so far were sent elsewhere
                    self._chat_output(prog.item.index).delta(prog.visible_text(), False)

    def streamed_tokens(self, index: int) -> int:
        """Output tokens whose text (and logprobs) this choice's chunks have carried so far."""
        cur = self.cursors.get(index)
        return cur.tokens if cur else 0
