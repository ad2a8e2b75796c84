"""Strict JSON request bodies for every HTTP edge: RFC 8259 only (no NaN/Infinity), bounded
nesting, no unpaired UTF-16 surrogates (they are not text: a tokenizer or a reply that echoes
them would fail later), and an object at the top. Anything else is a BadRequest naming why."""

from __future__ import annotations

import json
import re
from typing import Any, NoReturn

from .errors import BadRequest

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")  # \ud800-\udfff: valid only in pairs


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


def loads_object(raw: bytes, what: str = "the request body") -> dict[str, Any]:
    """`raw` as a JSON object, or BadRequest (400) saying what is wrong with it."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise BadRequest(f"{what} is not valid JSON: nested too deeply") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"{what} is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise BadRequest(f"{what} must be a JSON object, got {type(body).__name__}")
    if _SURROGATE_ESCAPE.search(raw):
        try:
            json.dumps(body, ensure_ascii=False).encode("utf-8")
        except (UnicodeEncodeError, RecursionError):
            raise BadRequest(f"{what} holds an unpaired UTF-16 surrogate escape (\\ud800-\\udfff), "
                             "which is not text") from None
    return body
