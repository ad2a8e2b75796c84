"""OpenAI `tools` and `tool_choice` on /v1/chat/completions -> a `ToolRequest`.

`tool_choice`: "none" (tools still go to the template, as vLLM does, but the answer is not
parsed), "auto" (the default with tools: calls are parsed from the answer by the server's tool
parser), "required" and a named function (the answer is forced by a grammar: `forced_schema`
is the JSON schema, `forced_parser` reads the constrained answer). `parallel_tool_calls: false`
allows one call (a schema with maxItems 1, or only the first parsed call). The legacy
`functions` / `function_call` fields are refused by name.
"""

from __future__ import annotations

import enum
import json
import re
from dataclasses import dataclass

from ..core.errors import BadRequest
from ..core.sampling import unsupported
from .protocol import opt_bool
from .tool_parsers import ToolCall, ToolParser, ToolSplit

FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # OpenAI's rule for a function name


class ToolChoice(str, enum.Enum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict] | None  # as given, for the chat template; None without tools
    choice: ToolChoice = ToolChoice.NONE
    function: str | None = None  # the named function
    parallel: bool = True  # parallel_tool_calls: False allows one call at most

    @property
    def forced(self) -> bool:
        return self.choice in (ToolChoice.REQUIRED, ToolChoice.NAMED)

    def parameters(self, name: str) -> dict:
        fn = next(t["function"] for t in self.tools or () if t["function"]["name"] == name)
        return fn.get("parameters") or {"type": "object", "properties": {}}


def _check_tool(k: int, t) -> str:
    where = f"tools[{k}]"
    if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
        raise BadRequest(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}")
    fn = t["function"]
    name = fn.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise BadRequest(f"{where}.function.name must be 1-64 letters, digits, '_', '.' or '-'")
    if fn.get("description") is not None and not isinstance(fn["description"], str):
        raise BadRequest(f"{where}.function.description must be a string")
    if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
        raise BadRequest(f"{where}.function.parameters must be a JSON schema object")
    if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
        raise BadRequest(f"{where}.function.strict must be a boolean")
    return name


def parse_tools(body: dict) -> ToolRequest:
    """Check `tools` and `tool_choice` (400 naming what is wrong)."""
    for key in ("functions", "function_call"):
        if body.get(key) not in (None, "none", []):
            raise unsupported(key, " (deprecated by OpenAI; use tools and tool_choice)")
    tools = body.get("tools")
    if tools is not None and not isinstance(tools, list):
        raise BadRequest("tools must be a list")
    names = [_check_tool(k, t) for k, t in enumerate(tools or [])]
    if len(set(names)) != len(names):
        raise BadRequest(f"tools name a function twice: {sorted(n for n in set(names) if names.count(n) > 1)}")
    parallel = opt_bool(body, "parallel_tool_calls", True)
    choice = body.get("tool_choice")
    if choice is None:
        return ToolRequest(tools or None, ToolChoice.AUTO if tools else ToolChoice.NONE, None, parallel)
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise BadRequest(f"tool_choice {choice!r} is not one of 'none', 'auto', 'required' "
                             "or {\"type\": \"function\", \"function\": {\"name\": ...}}")
        kind, name = ToolChoice(choice), None
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        kind, name = ToolChoice.NAMED, choice["function"]["name"]
    else:
        raise BadRequest("tool_choice must be 'none', 'auto', 'required' or "
                         "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    if kind is not ToolChoice.NONE and not tools:
        raise BadRequest(f"tool_choice {choice!r} needs a non-empty tools list")
    if name is not None and name not in names:
        raise BadRequest(f"tool_choice names function {name!r}, which is not in tools {names}")
    return ToolRequest(tools or None, kind, name, parallel)


def forced_schema(req: ToolRequest) -> dict:
    """The JSON schema a grammar must hold a forced answer to: the named function's arguments,
    or (required) a non-empty list of {"name", "parameters"} objects, one kind per tool."""
    if req.choice is ToolChoice.NAMED:
        return req.parameters(req.function or "")
    items = [{"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                "parameters": req.parameters(t["function"]["name"])},
              "required": ["name", "parameters"], "additionalProperties": False} for t in req.tools or ()]
    out = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
    return out if req.parallel else {**out, "maxItems": 1}


class NamedCallParser(ToolParser):
    """The answer (a grammar held it to the function's parameters schema) is the arguments."""

    name = "named"

    def __init__(self, function: str):
        self.function = function

    def split(self, text: str, final: bool) -> ToolSplit:
        if not final:
            return ToolSplit("")
        try:
            args = json.loads(text)
        except ValueError:
            return ToolSplit(text)
        if not isinstance(args, dict):
            return ToolSplit(text)
        return ToolSplit("", (ToolCall(self.function, json.dumps(args, ensure_ascii=False)),))


class RequiredCallsParser(ToolParser):
    """The answer (a grammar held it to `forced_schema`) is a list of {"name", "parameters"}."""

    name = "required"

    def split(self, text: str, final: bool) -> ToolSplit:
        if not final:
            return ToolSplit("")
        try:
            items = json.loads(text)
        except ValueError:
            return ToolSplit(text)
        if not isinstance(items, list) or not all(
                isinstance(x, dict) and isinstance(x.get("name"), str) and isinstance(x.get("parameters"), dict)
                for x in items):
            return ToolSplit(text)
        return ToolSplit("", tuple(ToolCall(x["name"], json.dumps(x["parameters"], ensure_ascii=False))
                                   for x in items))


class FirstCallOnly(ToolParser):
    """parallel_tool_calls false with tool_choice auto: only the first call is returned."""

    def __init__(self, inner: ToolParser):
        self.inner, self.name = inner, inner.name

    def split(self, text: str, final: bool) -> ToolSplit:
        s = self.inner.split(text, final)
        return ToolSplit(s.content, s.calls[:1])


def forced_parser(req: ToolRequest) -> ToolParser:
    return NamedCallParser(req.function or "") if req.choice is ToolChoice.NAMED else RequiredCallsParser()
