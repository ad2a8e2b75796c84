"""The front's tokenizer: a model directory's tokenizer.json (the `tokenizers` library) plus
tokenizer_config.json (special tokens, chat template). No transformers, no torch.

On the way back, `IncrementalDetokenizer` turns a growing list of token ids into text deltas
whose concatenation equals decoding the whole list at once: each step decodes a short window
(a few ids already shown + the new ones) and emits only what the window adds beyond the
already-shown part; text ending in an incomplete UTF-8 character (U+FFFD) is held back until the
next id completes it or the request finishes.
"""

from __future__ import annotations

import json
import os
from typing import Protocol

from tokenizers import Tokenizer

from ..core.errors import BadRequest
from .chat_template import ChatTemplate, template_source

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                      "mask_token")
REPLACEMENT_CHAR = "\ufffd"
CONTEXT_TOKENS = 5  # prompt ids used as left context, so the first output id gets its leading space


def _token_text(v) -> str | None:
    """tokenizer_config.json spells a special token as a string or as an AddedToken dict."""
    if isinstance(v, str):
        return v
    if isinstance(v, dict) and isinstance(v.get("content"), str):
        return v["content"]
    return None


class ServerTokenizer:
    """Encode, decode and render chat prompts for one model directory."""

    def __init__(self, tokenizer: Tokenizer, config: dict, chat_template: str | None, path: str = ""):
        self.path = path
        self._tok = tokenizer
        self.config = config
        self.special_tokens = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k)))}
        extra = [t for v in config.get("additional_special_tokens") or [] if (t := _token_text(v))]
        template_vars: dict = dict(self.special_tokens)
        if extra:
            template_vars["additional_special_tokens"] = extra
        self.chat_template = ChatTemplate(chat_template, template_vars) if chat_template else None

    @classmethod
    def from_dir(cls, model_dir: str) -> "ServerTokenizer":
        tok_file = os.path.join(model_dir, "tokenizer.json")
        if not os.path.isfile(tok_file):
            raise FileNotFoundError(f"no tokenizer.json in model directory {model_dir}")
        cfg_file = os.path.join(model_dir, "tokenizer_config.json")
        config: dict = {}
        if os.path.isfile(cfg_file):
            with open(cfg_file, encoding="utf-8") as f:
                config = json.load(f)
        jinja_file = os.path.join(model_dir, "chat_template.jinja")
        tpl = template_source(config, jinja_file if os.path.isfile(jinja_file) else None)
        return cls(Tokenizer.from_file(tok_file), config, tpl, model_dir)

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer knows, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token's text for logprob listings (special tokens kept)."""
        return self._tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list | None = None, extra: dict | None = None) -> str:
        if self.chat_template is None:
            raise BadRequest("this model has no chat template; use /v1/completions or /generate")
        return self.chat_template.render(messages, add_generation_prompt, tools, extra)

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list | None = None, extra: dict | None = None) -> list[int]:
        """Token ids of the rendered prompt; the template writes any BOS itself, so none is added."""
        text = self.apply_chat_template(messages, add_generation_prompt, tools, extra)
        return self.encode(text, add_special_tokens=False)


# ---- the way back: token ids -> text deltas

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
