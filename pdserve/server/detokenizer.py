"""Incremental detokenization: turn a growing list of token ids into text deltas whose
concatenation equals decoding the whole list at once.

Each step decodes a short window (a few ids already shown + the new ones) and emits only
what the window adds beyond the already-shown part; text ending in an incomplete UTF-8
character (U+FFFD) is held back until the next id completes it or the request finishes.
"""

from __future__ import annotations

from typing import Protocol

REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 5  # prompt ids used as left context, so the first output id gets its leading space


class Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Feed ids with `add`, collect text deltas; `flush` returns what is held back at the end.

    `context` (e.g. the prompt's last ids) is decoded for spacing only and never emitted.
    """

    def __init__(self, tokenizer: Decoder, context: list[int] | None = None,
                 skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = list(context or [])[-CONTEXT_TOKENS:]
        self.prefix_offset = 0  # window start
        self.read_offset = len(self.ids)  # ids before this are already emitted (or context)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _delta(self, final: bool) -> str:
        shown = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) <= len(shown) or (full.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        delta = full[len(shown):]
        self.text += delta
        return delta

    def add(self, token_id: int) -> str:
        """Append one id; returns the newly complete text (maybe empty)."""
        self.ids.append(token_id)
        return self._delta(final=False)

    def flush(self) -> str:
        """At the end: whatever is still held back, incomplete characters included."""
        if self.read_offset >= len(self.ids):
            return ""
        return self._delta(final=True)
