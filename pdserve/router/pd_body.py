"""Body transforms of a PD request: client body checks, rooms and PD fields per leg, logprob merge.

Rooms: one scalar room for a single request; a list for batched input (`text`/`input_ids`/
`prompt` lists) or `n > 1`, item-major: index i * n + j is item i, sample j. Every try of a
request mints fresh rooms.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Any

import msgspec

from pdserve.core.errors import BadRequest
from pdserve.core.pd_vocab import ROOM_BITS

_decoder = msgspec.json.Decoder()
_encoder = msgspec.json.Encoder()


class Route(str, enum.Enum):
    GENERATE = "/generate"
    COMPLETIONS = "/v1/completions"
    CHAT = "/v1/chat/completions"


def parse_client_body(raw: bytes) -> dict:
    try:
        body = _decoder.decode(raw)
    except msgspec.DecodeError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    except RecursionError:  # msgspec's depth limit
        raise BadRequest("request body is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        raise BadRequest(f"request body must be a JSON object, got {type(body).__name__}")
    return body


def encode(obj: Any) -> bytes:
    return _encoder.encode(obj)


def decode(raw: bytes) -> Any:
    return _decoder.decode(raw)


MAX_SAMPLES = 64  # the servers' own limit on n; rooms are minted per sample, so it must be checked here


def _positive_int(value: Any, name: str) -> int:
    if value is None:
        return 1
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadRequest(f"{name} must be a positive integer, got {value!r}")
    if value > MAX_SAMPLES:
        raise BadRequest(f"{name}={value} is over the limit of {MAX_SAMPLES} samples per prompt")
    return value


def _sample_count(route: Route, body: dict) -> int:
    if route is not Route.GENERATE:
        return _positive_int(body.get("n"), "n")
    sp = body.get("sampling_params")
    if isinstance(sp, list):  # per-item sampling params of a batch; they share n
        sp = sp[0] if sp else None
    if sp is None:
        return 1
    if not isinstance(sp, dict):
        raise BadRequest(f"sampling_params must be an object, got {type(sp).__name__}")
    return _positive_int(sp.get("n"), "sampling_params.n")


def _batch_size(route: Route, body: dict) -> int | None:
    """Number of items of a batched request, None for a single one."""
    if route is Route.CHAT:
        return None
    fields = ("text", "input_ids") if route is Route.GENERATE else ("prompt",)
    for name in fields:
        value = body.get(name)
        if not isinstance(value, list):
            continue
        if not value:
            raise BadRequest(f"{name} is an empty list")
        if isinstance(value[0], int) and not isinstance(value[0], bool) and name != "text":
            return None  # one prompt given as token ids
        return len(value)
    return None


@dataclass(frozen=True)
class RequestShape:
    """What the router needs to know about a client request before routing it."""

    route: Route
    room_count: int | None  # None: one scalar room
    stream: bool
    return_logprob: bool


def inspect_request(route: Route, body: dict) -> RequestShape:
    """Check the fields the router relies on (400 on bad ones) and normalize chat's max_tokens."""
    items, n = _batch_size(route, body), _sample_count(route, body)
    if route is Route.CHAT and "max_tokens" in body:
        body.setdefault("max_completion_tokens", body.pop("max_tokens"))
    lp = body.get("return_logprob")
    return RequestShape(
        route=route,
        room_count=None if items is None and n == 1 else (items or 1) * n,
        stream=bool(body.get("stream")),
        return_logprob=any(lp) if isinstance(lp, list) else bool(lp),
    )


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _token_key(ids: Any) -> tuple | None:
    """Token ids (one list, or a batch of lists flattened in order) as a tuple; None if not ids."""
    if not isinstance(ids, list) or not ids:
        return None
    if all(_is_id(x) for x in ids):
        return tuple(ids)
    if all(isinstance(item, list) and all(_is_id(x) for x in item) for item in ids):
        return tuple(x for item in ids for x in item) or None
    return None


def _text_key(text: Any) -> str | None:
    if isinstance(text, str):
        return text or None
    if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
        return " ".join(text) or None  # a batch: its items joined, as sglang-router joins prompt lists
    return None


def _content_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts: the text ones, joined
        return " ".join(p["text"] for p in content
                        if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str))
    return None


def _chat_text(messages: Any) -> str | None:
    """Every message's text joined by spaces (sglang-router's extract_text_for_routing): system, user
    (its text parts), assistant (content then reasoning_content, skipped when both are empty), tool."""
    if not isinstance(messages, list):
        return None
    texts = []
    for msg in messages:
        if not isinstance(msg, dict):
            continue
        content = _content_text(msg.get("content"))
        if msg.get("role") == "assistant":
            reasoning = msg.get("reasoning_content")
            reasoning = reasoning if isinstance(reasoning, str) else ""
            if content or reasoning:
                texts.append(f"{content or ''} {reasoning}".strip())
        elif content is not None:
            texts.append(content)
    return " ".join(texts) or None


def routing_key(route: Route, body: dict) -> str | tuple | None:
    """What cache_aware routes on: the request's token ids as a tuple when it gives them (`input_ids`
    on /generate, a token-id `prompt` on /v1/completions), else its text (`text`, `prompt`, or the
    chat messages' text). None when it has neither. Never raises on odd input."""
    if route is Route.GENERATE:
        return _token_key(body.get("input_ids")) or _text_key(body.get("text"))
    if route is Route.COMPLETIONS:
        prompt = body.get("prompt")
        return _token_key(prompt) or _text_key(prompt)
    return _chat_text(body.get("messages"))


class _RoomSource:
    """Random 63-bit rooms from the OS CSPRNG, drawn 4 KiB at a time (one syscall per 512 rooms)."""

    def __init__(self) -> None:
        self._buf, self._pos = b"", 0

    def next(self) -> int:
        if self._pos >= len(self._buf):
            self._buf, self._pos = os.urandom(4096), 0
        self._pos += 8
        return int.from_bytes(self._buf[self._pos - 8:self._pos], "little") >> (64 - ROOM_BITS)


_rooms = _RoomSource()
os.register_at_fork(after_in_child=_rooms.__init__)  # a forked child must not replay the parent's rooms


def mint_rooms(count: int | None) -> int | list[int]:
    if count is None:
        return _rooms.next()
    return [_rooms.next() for _ in range(count)]


def leg_bodies(body: dict, host: str, port: int | None, rooms: int | list[int],
               dp_ranks: tuple[int, int] | None = None, prefill_rid: str | None = None) -> tuple[bytes, bytes]:
    """The (prefill, decode) bodies: the client body plus PD fields; identical unless DP-aware or
    `prefill_rid` (a migration's prefill, whose old leg may still hold the rid) is given."""
    base = dict(body)
    base["bootstrap_host"] = host
    base["bootstrap_port"] = port
    base["bootstrap_room"] = rooms
    if dp_ranks is None:
        data = encode(base)
        return (data if prefill_rid is None else encode({**base, "rid": prefill_rid})), data
    prefill_rank, decode_rank = dp_ranks
    base.pop("data_parallel_rank", None)  # the deprecated alias would contradict our pick
    # Both legs name the prefill rank: decode contacts it with no query, and on a
    # follow_bootstrap_room prefill it pins the rank instead of being a routed/room conflict.
    base["disagg_prefill_dp_rank"] = prefill_rank
    prefill = encode({**base, "routed_dp_rank": prefill_rank, **({"rid": prefill_rid} if prefill_rid else {})})
    decode = encode({**base, "routed_dp_rank": decode_rank})
    return prefill, decode


def _merge_one(prefill: Any, decode: Any) -> None:
    if not (isinstance(prefill, dict) and isinstance(decode, dict)):
        return
    p_meta, d_meta = prefill.get("meta_info"), decode.get("meta_info")
    if not (isinstance(p_meta, dict) and isinstance(d_meta, dict)):
        return
    for key in ("input_token_logprobs", "input_top_logprobs"):
        p_lp = p_meta.get(key)
        if isinstance(p_lp, list):
            d_lp = d_meta.get(key)
            d_meta[key] = p_lp + (d_lp if isinstance(d_lp, list) else [])


def merge_input_logprobs(prefill_raw: bytes, decode_raw: bytes) -> bytes:
    """Decode's reply with the prefill's meta_info.input_token_logprobs (and input_top_logprobs)
    put in front (per item)."""
    try:
        prefill, decoded = decode(prefill_raw), decode(decode_raw)
    except msgspec.DecodeError:
        return decode_raw
    if isinstance(prefill, list) and isinstance(decoded, list):
        for p, d in zip(prefill, decoded):
            _merge_one(p, d)
    else:
        _merge_one(prefill, decoded)
    return encode(decoded)
