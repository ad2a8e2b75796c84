"""What a request's output must match (structured outputs), as it travels in SamplingParams.

A GrammarSpec is plain data (kind + text), so it pickles to the workers and rides the same
body to a prefill and a decode; pdserve/grammar turns it into a matcher and checks it. The
constructors here are what the API parsers and server code (tool_choice) build specs with.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass
from typing import Any, Callable

from .errors import BadRequest


class GrammarKind(enum.Enum):
    JSON_SCHEMA = "json_schema"  # text: the schema, as JSON
    JSON_OBJECT = "json_object"  # any JSON object; text is ""
    REGEX = "regex"  # text: the regular expression (the output must match it whole)
    CHOICE = "choice"  # text: a JSON list of the allowed strings
    GRAMMAR = "grammar"  # text: an EBNF grammar (GBNF as llama.cpp / xgrammar, or Lark)


@dataclass(frozen=True)
class GrammarSpec:
    kind: GrammarKind
    text: str = ""
    source: str = ""  # the request field it came from, for error messages

    def describe(self) -> str:
        return self.source or self.kind.value


def json_schema_spec(schema: object, source: str = "json_schema") -> GrammarSpec:
    """A JSON schema given as a dict (or its JSON text) -> spec; not a JSON object -> 400."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise BadRequest(f"{source} is not valid JSON: {e}") from None
    if isinstance(schema, bool):  # JSON Schema allows true (anything) and false (nothing)
        raise BadRequest(f"{source} must be a JSON schema object, got {schema!r}")
    if not isinstance(schema, dict):
        raise BadRequest(f"{source} must be a JSON schema object, got {type(schema).__name__}")
    # key order kept: properties are generated in the schema's order
    return GrammarSpec(GrammarKind.JSON_SCHEMA, json.dumps(schema), source)


def json_object_spec(source: str = "json_object") -> GrammarSpec:
    return GrammarSpec(GrammarKind.JSON_OBJECT, "", source)


def regex_spec(pattern: object, source: str = "regex") -> GrammarSpec:
    if not isinstance(pattern, str) or not pattern:
        raise BadRequest(f"{source} must be a non-empty string")
    return GrammarSpec(GrammarKind.REGEX, pattern, source)


def choice_spec(choices: object, source: str = "choice") -> GrammarSpec:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise BadRequest(f"{source} must be a non-empty list of strings")
    if any(c == "" for c in choices):
        raise BadRequest(f"{source} must not contain empty strings")
    return GrammarSpec(GrammarKind.CHOICE, json.dumps(choices), source)


def grammar_spec(text: object, source: str = "grammar") -> GrammarSpec:
    if not isinstance(text, str) or not text.strip():
        raise BadRequest(f"{source} must be a non-empty grammar string")
    return GrammarSpec(GrammarKind.GRAMMAR, text, source)


def only_one(found: list[GrammarSpec]) -> GrammarSpec | None:
    """At most one constraint per request (as vLLM and SGLang): two -> 400 naming both."""
    if len(found) > 1:
        raise BadRequest(f"give only one structured-output constraint, got {found[0].describe()} and "
                         f"{found[1].describe()}")
    return found[0] if found else None


def from_sglang_sampling(obj: dict[str, Any], label: Callable[[str], str]) -> GrammarSpec | None:
    """SGLang's `sampling_params` json_schema (JSON text; an object is taken too) / regex / ebnf;
    `label(key)` spells the field for errors."""
    found = []
    if obj.get("json_schema") is not None:
        found.append(json_schema_spec(obj["json_schema"], label("json_schema")))
    if obj.get("regex") is not None:
        found.append(regex_spec(obj["regex"], label("regex")))
    if obj.get("ebnf") is not None:
        found.append(grammar_spec(obj["ebnf"], label("ebnf")))
    return only_one(found)
