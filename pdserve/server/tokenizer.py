"""The front's tokenizer: a model directory's tokenizer.json (the `tokenizers` library) plus
tokenizer_config.json (special tokens, chat template). No transformers, no torch."""

from __future__ import annotations

import json
import os

from tokenizers import Tokenizer

from ..core.errors import BadRequest
from .chat_template import ChatTemplate, template_source

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token",
                      "mask_token")


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
