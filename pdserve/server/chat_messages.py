"""Chat `messages` checked and made ready for the chat template.

Roles are OpenAI's (system, developer, user, assistant, tool); any other role is a 400 naming
it. Content is a string, null (assistant only) or a list of text parts (joined with newlines).
An assistant message's `tool_calls[].function.arguments` (a JSON string) is decoded to an
object, which is what chat templates iterate over (as vLLM and transformers' users do); a
`tool` message needs `tool_call_id`.
"""

from __future__ import annotations

import json

from ..core.errors import BadRequest

ROLES = ("system", "developer", "user", "assistant", "tool")


def _content_text(content, k: int, role: str) -> str:
    if content is None:
        if role != "assistant":
            raise BadRequest(f"messages[{k}] ({role}) needs content")
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise BadRequest(f"messages[{k}].content: only text parts are supported, got {kind!r}")
            parts.append(part["text"])
        return "\n".join(parts)
    raise BadRequest(f"messages[{k}].content must be a string or a list of parts")


def _tool_calls(calls, k: int) -> list[dict]:
    if not isinstance(calls, list):
        raise BadRequest(f"messages[{k}].tool_calls must be a list")
    out = []
    for j, c in enumerate(calls):
        where = f"messages[{k}].tool_calls[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise BadRequest(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                             "\"arguments\"}}}")
        if c.get("type", "function") != "function":
            raise BadRequest(f"{where}.type must be \"function\"")
        args = fn.get("arguments")
        if args is None:
            args = {}
        elif isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError as e:
                raise BadRequest(f"{where}.function.arguments is not valid JSON: {e}") from None
        if not isinstance(args, dict):
            raise BadRequest(f"{where}.function.arguments must be a JSON object")
        out.append({**c, "type": "function", "function": {**fn, "arguments": args}})
    return out


def chat_messages(body: dict) -> list[dict]:
    """The checked messages, content as text and tool-call arguments as objects."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise BadRequest("messages must be a non-empty list")
    out = []
    for k, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise BadRequest(f"messages[{k}] must be an object with a string role")
        role = m["role"]
        if role not in ROLES:
            raise BadRequest(f"messages[{k}].role {role!r} is not one of {list(ROLES)}")
        msg = dict(m)
        msg["content"] = _content_text(m.get("content"), k, role)
        if m.get("name") is not None and not isinstance(m["name"], str):
            raise BadRequest(f"messages[{k}].name must be a string")
        if m.get("tool_calls") is not None:
            if role != "assistant":
                raise BadRequest(f"messages[{k}]: only assistant messages carry tool_calls")
            msg["tool_calls"] = _tool_calls(m["tool_calls"], k)
        if role == "tool" and not isinstance(m.get("tool_call_id"), str):
            raise BadRequest(f"messages[{k}] (tool) needs a string tool_call_id")
        out.append(msg)
    return out
