"""Structured-output fields of an OpenAI-route body -> one checked GrammarSpec (or None).

Accepted, at most one per request: OpenAI `response_format` {text | json_object | json_schema
(`json_schema.schema`; `strict` either way: the schema is always enforced)}; vLLM's
`structured_outputs` {json | regex | choice | grammar | json_object} and its older
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`; SGLang's top-level `regex`,
`ebnf` and `json_schema`. Refused by name: `structural_tag` (every spelling), vLLM's
`whitespace_pattern` / `disable_additional_properties`, a `guided_decoding_backend` other
than llguidance, and min_tokens with a constraint (the grammar may end first). Every spec is
compiled here (grammar/compiler.py: no torch), so a bad schema,
regex or grammar is a 400 with the library's message before any worker sees it.
"""

from __future__ import annotations

from ..core.errors import BadRequest
from ..core.grammar_spec import (
    GrammarSpec,
    choice_spec,
    grammar_spec,
    json_object_spec,
    json_schema_spec,
    only_one,
    regex_spec,
)
from ..core.sampling import SamplingParams, unsupported
from ..grammar.compiler import check_spec

OUR_BACKENDS = ("auto", "guidance", "llguidance")  # vLLM's names for the library we use
# vLLM structured_outputs / guided_* keys -> spec builders
_VLLM = {"json": json_schema_spec, "regex": regex_spec, "choice": choice_spec, "grammar": grammar_spec}


def with_grammar(sampling: SamplingParams, spec: GrammarSpec | None) -> SamplingParams:
    """`sampling` constrained by `spec`, checked (400 if it does not compile). For server code
    that builds its own constraint too, e.g. tool_choice "required" / a named function:
    `with_grammar(sp, json_schema_spec(schema_dict, "tool_choice"))`."""
    if spec is None:
        return sampling
    if sampling.grammar is not None:
        only_one([sampling.grammar, spec])
    sampling = sampling.replace(grammar=spec)
    check_sampling(sampling)
    return sampling


def check_sampling(sampling: SamplingParams) -> None:
    """400 unless the grammar (if any) compiles and goes with the other fields."""
    if sampling.grammar is None:
        return
    check_spec(sampling.grammar)
    if sampling.min_new_tokens:
        raise unsupported(f"min_tokens (min_new_tokens) together with {sampling.grammar.describe()}",
                          " (the grammar may end before it, where only EOS can follow)")


def _response_format(rf: object) -> GrammarSpec | None:
    if not isinstance(rf, dict) or not isinstance(rf.get("type"), str):
        raise BadRequest("response_format must be an object with a string type")
    kind = rf["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return json_object_spec("response_format json_object")
    if kind == "json_schema":
        js = rf.get("json_schema")
        if not isinstance(js, dict):
            raise BadRequest("response_format.json_schema must be an object with a schema")
        if "schema" not in js:
            raise BadRequest("response_format.json_schema.schema is required")
        if js.get("strict") is not None and not isinstance(js["strict"], bool):
            raise BadRequest("response_format.json_schema.strict must be a boolean")
        return json_schema_spec(js["schema"], "response_format.json_schema.schema")
    if kind == "structural_tag":
        raise unsupported("response_format type 'structural_tag'", " (json_object and json_schema are)")
    raise BadRequest(f"response_format type {kind!r} is unknown (text, json_object, json_schema)")


def _vllm_structured(so: object) -> list[GrammarSpec]:
    if not isinstance(so, dict):
        raise BadRequest("structured_outputs must be an object")
    found = [build(so[k], f"structured_outputs.{k}") for k, build in _VLLM.items() if so.get(k) is not None]
    jo = so.get("json_object")
    if jo is not None and not isinstance(jo, bool):
        raise BadRequest("structured_outputs.json_object must be a boolean")
    if jo:
        found.append(json_object_spec("structured_outputs.json_object"))
    if so.get("structural_tag") is not None:
        raise unsupported("structured_outputs.structural_tag")
    if so.get("whitespace_pattern") is not None:
        raise unsupported("structured_outputs.whitespace_pattern", " (JSON is written without free whitespace)")
    if so.get("disable_additional_properties"):
        raise unsupported("structured_outputs.disable_additional_properties")
    for flag in ("disable_fallback", "disable_any_whitespace"):  # both already hold: one backend, compact JSON
        if so.get(flag) is not None and not isinstance(so[flag], bool):
            raise BadRequest(f"structured_outputs.{flag} must be a boolean")
    if not found:
        raise BadRequest("structured_outputs names no constraint (json, regex, choice, grammar or json_object)")
    return found


def parse_structured(body: dict) -> GrammarSpec | None:
    """The one constraint an OpenAI-route body asks for, checked; None when it asks for none."""
    found: list[GrammarSpec] = []
    if body.get("response_format") is not None:
        spec = _response_format(body["response_format"])
        found += [spec] if spec else []
    if body.get("structured_outputs") is not None:
        found += _vllm_structured(body["structured_outputs"])
    for k, build in _VLLM.items():
        if body.get(f"guided_{k}") is not None:
            found.append(build(body[f"guided_{k}"], f"guided_{k}"))
    backend = body.get("guided_decoding_backend")
    if backend is not None and backend not in OUR_BACKENDS:
        raise unsupported(f"guided_decoding_backend={backend!r}", " (this server uses llguidance)")
    if body.get("guided_whitespace_pattern") is not None:
        raise unsupported("guided_whitespace_pattern", " (JSON is written without free whitespace)")
    if body.get("json_schema") is not None:  # SGLang's extras on its OpenAI routes
        found.append(json_schema_spec(body["json_schema"], "json_schema"))
    if body.get("regex") is not None:
        found.append(regex_spec(body["regex"], "regex"))
    if body.get("ebnf") is not None:
        found.append(grammar_spec(body["ebnf"], "ebnf"))
    if body.get("structural_tag") is not None:
        raise unsupported("structural_tag", " (json_schema, regex and ebnf are)")
    spec = only_one(found)
    check_spec(spec)
    return spec
