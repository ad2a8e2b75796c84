"""The control messages between a decode worker and a prefill worker, as typed structs.

decode -> prefill  KvReq    where to write a room's KV (pages, KVLayout, endpoint) and the facts
                            both sides must agree on (page size, KvDtype, model, BackendName)
decode -> prefill  KvAbort  the decode gave the room up
prefill -> decode  KvDone   the pages landed; the prefill's first token and its WriteResult
prefill -> decode  KvFail   the room failed on the prefill, with a reason and a FailureCause
prefill -> decode  KvMoved  the worker the decode addressed forwarded its KvReq to the rank that
                            holds the room (zero-round-trip rendezvous for any DP method)
On the transfer backend they travel as msgpack maps tagged by "t" (`to_wire` / `from_wire`); the
typed values inside (KVLayout, KvDtype, BackendName) travel as their own maps and strings, and
`from_wire` checks them: a malformed one is a BadMessage naming the room and the field.
The KvDone of a room is sent after its page writes, so it arrives after the pages landed. A
prefill answers every KvAbort with KvDone or KvFail, and sends KvFail only once no write of
that room can still land: until then the decode keeps the room's pages.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from ..core.kv_layout import KVLayout
from ..core.logprobs import TopLogprobs
from ..core.pd_vocab import BackendName, KvDtype
from ..transfer.base import Endpoint, WriteResult

KV_REQ = "kv_req"
KV_ABORT = "kv_abort"
KV_DONE = "kv_done"
KV_FAIL = "kv_fail"
KV_MOVED = "kv_moved"


class _Msg(msgspec.Struct, tag_field="t", kw_only=True, omit_defaults=True):
    room: int


class KvReq(_Msg, tag=KV_REQ):
    dst_pages: list[int]  # for the prompt's pages after the reused ones
    prompt_len: int
    layout: KVLayout  # decoded and checked (KVLayout.__post_init__) as part of the message
    endpoint: Endpoint  # the decode worker's transfer endpoint: every answer goes there
    page_size: int
    kv_dtype: KvDtype  # an unknown name does not decode: the prefill refuses the KvReq naming the room
    fingerprint: dict[str, Any]
    backend: BackendName
    decode_rank: int
    prefill_rank: int | None = None  # the rank the decode addressed
    prefill_instance: str = ""  # the bootstrap instance it resolved against ("" = not known)
    forwarded_by: int | None = None  # set by the rank that forwarded it to the holder
    reused_pages: int = 0  # leading full pages of the prompt the decode's own cache holds
    reused_key: str = ""  # page key (core.page_keys) of the last of them: both sides must agree


class KvAbort(_Msg, tag=KV_ABORT):
    reason: str = ""
    decode_rank: int | None = None
    endpoint: Endpoint | None = None  # the decode's endpoint (a forwarded abort has another sender)


class KvDone(_Msg, tag=KV_DONE):
    """The prefill's facts (prefill_events.PrefillFacts, the same names) and its page write."""

    prefill_rank: int
    first_token: int
    first_logprob: float | None = None
    first_top_logprobs: TopLogprobs | None = None  # (token id, logprob), most likely first
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[TopLogprobs | None] | None = None
    prompt_len: int | None = None
    cached_tokens: int = 0
    write: WriteResult | None = None  # what the page write moved and when (set by the write job)


class KvFail(_Msg, tag=KV_FAIL):
    prefill_rank: int | None = None
    reason: str = ""
    cause: str = "internal"


class KvMoved(_Msg, tag=KV_MOVED):
    prefill_rank: int  # the rank that holds the room
    endpoint: Endpoint  # its transfer endpoint: later aborts go straight there


Message = Union[KvReq, KvAbort, KvDone, KvFail, KvMoved]


class BadMessage(ValueError):
    """A control message that is not one of ours or has a field of the wrong type: `kind` (its
    "t") and `room` (None unless an integer) are what could be read of it, `detail` what is wrong."""

    def __init__(self, kind: object, room: object, detail: str) -> None:
        super().__init__(f"malformed {kind!r} control message for room {room}: {detail}")
        self.kind, self.detail = kind, detail
        self.room = room if isinstance(room, int) and not isinstance(room, bool) else None


def to_wire(msg: Message) -> dict[str, Any]:
    out: dict[str, Any] = msgspec.to_builtins(msg)
    return out


def from_wire(d: object) -> Message:
    """The typed message of a received map; BadMessage naming what is wrong."""
    try:
        msg: Message = msgspec.convert(d, Message)
        return msg
    except msgspec.ValidationError as e:
        kind = d.get("t") if isinstance(d, dict) else type(d).__name__
        room = d.get("room") if isinstance(d, dict) else None
        raise BadMessage(kind, room, str(e)) from None

