"""OpenAI reply shapes: completion and chat objects, and their streamed chunks.

A `OpenAIReply` is built once per HTTP request (id, created, model name, kind) and turns item
progress into JSON. Streaming sends deltas of the text safe to show; their concatenation is
exactly the non-streamed text.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

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

    def __post_init__(self):
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex
        self.created = self.created or int(time.time())

    # ---- logprobs ----------------------------------------------------------------------------
    def _logprobs(self, prog: ItemProgress, start: int, end: int, text_offset: int = 0):
        if not self.call.logprobs:
            return None
        ids = prog.output_ids[start:end]
        lps = prog.output_logprobs[start:end]
        texts = [self.tok.token_text(t) for t in ids]
        if self.chat:
            return {"content": [{"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")),
                                 "top_logprobs": []} for s, lp in zip(texts, lps)]}
        offsets, pos = [], text_offset
        for s in texts:
            offsets.append(pos)
            pos += len(s)
        return {"tokens": texts, "token_logprobs": lps, "top_logprobs": None, "text_offset": offsets}

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
        if self.chat:
            c["message"] = {"role": "assistant", "content": prog.text}
        else:
            c["text"] = prog.text
        c["logprobs"] = self._logprobs(prog, 0, len(prog.output_ids))
        c["finish_reason"] = finish_reason(prog)
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
        ntok = len(prog.output_ids) if delta or prog.finished else cur.tokens
        if not delta and not prog.finished and cur.started:
            return None
        choice: dict = {"index": prog.item.index}
        if self.chat:
            choice["delta"] = {"content": delta} if cur.started else {"role": "assistant", "content": delta}
        else:
            choice["text"] = delta
        choice["logprobs"] = self._logprobs(prog, cur.tokens, ntok, cur.chars)
        choice["finish_reason"] = finish_reason(prog)
        if prog.finished:
            choice["matched_stop"] = matched_stop(prog)
        cur.chars, cur.tokens, cur.started, cur.done = len(text), ntok, True, prog.finished
        return self._chunk([choice])

    def usage_chunk(self, progs: list[ItemProgress]) -> dict | None:
        return self._chunk([], self.usage(progs)) if self.call.include_usage else None
