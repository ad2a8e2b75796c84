"""Chat templates rendered with jinja2 the way HF transformers renders them (same environment,
filters and globals), so a model's `chat_template` gives the same prompt text without transformers."""

from __future__ import annotations

import json
from datetime import datetime

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from ..core.errors import BadRequest

RESERVED_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt"})


class _GenerationBlock(Extension):
    """Accepts HF's `{% generation %}...{% endgeneration %}` tag and renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    """One compiled chat template plus the special-token strings it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str]):
        self.source = source
        self.special_tokens = dict(special_tokens)
        self._template = _environment().from_string(source)

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list | None = None, extra: dict | None = None) -> str:
        """The prompt text; a template error (e.g. raise_exception on a bad role order) is a 400."""
        taken = sorted(set(extra or ()) & RESERVED_NAMES)
        if taken:
            raise BadRequest(f"chat_template_kwargs must not set {taken} (they come from the request itself)")
        kwargs = {**self.special_tokens, **(extra or {})}
        try:
            return self._template.render(messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=add_generation_prompt, **kwargs)
        except jinja2.exceptions.TemplateError as e:
            raise BadRequest(f"chat template rejected the messages: {e}") from None


def template_source(tokenizer_config: dict, chat_template_file: str | None) -> str | None:
    """Pick the default template from tokenizer_config.json (a string or a list of named ones),
    or from a chat_template.jinja file next to it."""
    tpl = tokenizer_config.get("chat_template")
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    if not tpl and chat_template_file:
        with open(chat_template_file, encoding="utf-8") as f:
            tpl = f.read()
    return tpl or None
