"""OpenAI logprobs objects from the engine's logprobs (all of the model's raw distribution).

Chat: `content` entries {token, logprob, bytes, top_logprobs: [{token, logprob, bytes}] x k}.
Completions: {tokens, token_logprobs, top_logprobs: [{token text: logprob}], text_offset}; each
dict holds the k most likely tokens and the chosen one (so up to k + 1 entries, as OpenAI
says), and top_logprobs is null when k is 0. With echo the prompt's tokens come first, the
first with a null logprob and null alternatives (nothing predicts it).
"""

from __future__ import annotations

from ..core.logprobs import TopLogprobs
from .tokenizer import ServerTokenizer


def _entry(text: str, lp: float) -> dict:
    return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}


def chat_content(tok: ServerTokenizer, ids: list[int], lps: list[float],
                 tops: list[TopLogprobs]) -> dict:
    """`choices[].logprobs` of a chat reply or chunk; `tops` may be shorter (k = 0: empty lists)."""
    content = []
    for i, (t, lp) in enumerate(zip(ids, lps)):
        e = _entry(tok.token_text(t), lp)
        e["top_logprobs"] = [_entry(tok.token_text(a), alp) for a, alp in tops[i]] if i < len(tops) else []
        content.append(e)
    return {"content": content}


class CompletionLogprobs:
    """Builds `choices[].logprobs` of a completion in pieces (echoed prompt, then output runs)."""

    def __init__(self, tok: ServerTokenizer, k: int):
        self.tok, self.k = tok, k

    def _top(self, token: int, lp: float | None, alts: TopLogprobs | None) -> dict | None:
        if lp is None:
            return None
        d: dict[str, float] = {}
        for a, alp in alts or []:  # tokens with the same text (byte pieces) keep the likeliest
            d.setdefault(self.tok.token_text(a), alp)
        d.setdefault(self.tok.token_text(token), lp)
        return d

    def build(self, ids: list[int], lps: list[float | None], tops: list[TopLogprobs | None],
              text_offset: int) -> dict:
        """The object for tokens `ids` whose text starts at `text_offset` in the choice's text."""
        texts = [self.tok.token_text(t) for t in ids]
        offsets, pos = [], text_offset
        for s in texts:
            offsets.append(pos)
            pos += len(s)
        top = None
        if self.k:
            top = [self._top(t, lp, tops[i] if i < len(tops) else None)
                   for i, (t, lp) in enumerate(zip(ids, lps))]
        return {"tokens": texts, "token_logprobs": list(lps), "top_logprobs": top, "text_offset": offsets}

    @staticmethod
    def join(first: dict, second: dict) -> dict:
        return {key: None if first[key] is None else first[key] + second[key] for key in first}
