"""GrammarSpec -> llguidance grammar text, and the check that makes a bad spec a 400.

llguidance was chosen over xgrammar by scripts/grammar_lib_bench.py (docs/benchmarks.md,
"Structured outputs"): both compile a JSON schema in under 10 ms and mask a token in tens of
microseconds over SmolLM2's vocabulary, but llguidance does not import torch, so the HTTP front
validates grammars with the library itself.
"""

from __future__ import annotations

import functools

import llguidance

from ..core.errors import BadRequest
from ..core.grammar_spec import GrammarKind, GrammarSpec

# JSON output as OpenAI's and vLLM's: one line, ", " and ": " separators, no free whitespace
# (a small model left free whitespace can pad a finished object forever)
JSON_OPTIONS = {"whitespace_flexible": False}
ANY_OBJECT_SCHEMA = '{"type": "object"}'


def _lark_choice(choices_json: str) -> str:
    return llguidance.grammar_from("choice", choices_json)


_BUILDERS = {
    GrammarKind.JSON_SCHEMA: lambda t: llguidance.LLMatcher.grammar_from_json_schema(t, defaults=JSON_OPTIONS),
    GrammarKind.JSON_OBJECT: lambda t: llguidance.LLMatcher.grammar_from_json_schema(
        ANY_OBJECT_SCHEMA, defaults=JSON_OPTIONS),
    GrammarKind.REGEX: llguidance.LLMatcher.grammar_from_regex,
    GrammarKind.CHOICE: _lark_choice,
    GrammarKind.GRAMMAR: lambda t: llguidance.grammar_from("grammar", t),  # GBNF or Lark
}


@functools.lru_cache(maxsize=512)
def compile_spec(spec: GrammarSpec) -> str:
    """The llguidance grammar for `spec`, checked; a bad schema/regex/grammar -> 400 with the
    library's message. Cached: a front sees the same schema again and again."""
    try:
        grammar = _BUILDERS[spec.kind](spec.text)
    except ValueError as e:
        raise BadRequest(f"{spec.describe()} is invalid: {e}") from None
    err = llguidance.LLMatcher.validate_grammar(grammar)
    if err:
        raise BadRequest(f"{spec.describe()} is invalid: {err.strip()}")
    return grammar


def check_spec(spec: GrammarSpec | None) -> None:
    """400 unless `spec` (if any) compiles."""
    if spec is not None:
        compile_spec(spec)
