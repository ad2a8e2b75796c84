"""The prefill machine's events (what happened) and effects (what its driver must do), and what
it says about one room: the KvDone and KvFail its decode gets and the HandoffDone its caller gets
when it is over. Plain data and the functions that build it; the rules are in prefill_machine.

Events:  PrefillAccept (the prefill request), PrefillDone (pages + the engine's PrefillFacts),
         FromDecode (a typed wire message: KvReq / KvAbort), Malformed (one that did not parse),
         Fail (abort), MarkFailed (the front
         failed the room), Drop (the decode prefilled it itself), RoomRouted (the front sent a
         room homed here elsewhere), WriteReturned (a page-write job came back, ok or not), and
         the shared Tick (deadlines, reaping, expiry).
Effects: Send (a message to a peer; optionally one more on success / on failure), StartWrite
         (write pages to the decode, then send its KvDone), PrefillReport (a finished room:
         HandoffDone).
Messages: kv_done, kv_fail (to the decode), room_report with room_meta (to the caller: each
         handoff state's time, ranks, forwarding, the transfer's bytes and rate, failure cause).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Union, cast

import msgspec

from ..core.failures import FailureCause
from ..core.kv_layout import KVLayout
from ..core.logprobs import TopLogprobs
from ..transfer.base import Endpoint, WriteResult
from . import wire
from .handoff import Event, HandoffDone, HandoffState, write_meta, write_stages
from .prefill_rooms import PrefillRoom, RoomState


# ---- events -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PrefillAccept(Event):
    """The prefill request for `room` arrived (ValueError if the room is already in progress)."""

    room: int
    rid: str
    prompt_len: int
    prompt_ids: list[int] | None = None  # to check a decode's reused prefix


@dataclass(frozen=True)
class PrefillFacts:
    """The engine's facts about a finished prefill, named as the KvDone fields that carry them."""

    first_token: int | None  # None: the engine sampled none, so there is nothing to hand over
    first_logprob: float | None = None
    first_top_logprobs: TopLogprobs | None = None
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list[TopLogprobs | None] | None = None
    prompt_len: int | None = None
    cached_tokens: int = 0


@dataclass(frozen=True)
class PrefillDone(Event):
    room: int
    pages: list[int]
    aux: PrefillFacts


@dataclass(frozen=True)
class FromDecode(Event):
    """A typed control message from a decode worker (KvReq or KvAbort) and who sent it."""

    sender: Endpoint
    msg: wire.Message


@dataclass(frozen=True)
class Malformed(Event):
    """A decode's control message that did not parse (wire.BadMessage)."""

    room: int | None  # None: it had no integer room
    kind: object  # its "t"
    error: str  # what is wrong with it
    endpoint: Endpoint | None  # where it asks to be answered, if it names a descriptor


@dataclass(frozen=True)
class Fail(Event):
    room: int
    reason: str
    cause: FailureCause = FailureCause.ABORTED


@dataclass(frozen=True)
class MarkFailed(Event):
    room: int
    reason: str


@dataclass(frozen=True)
class Drop(Event):
    room: int
    reason: str


@dataclass(frozen=True)
class RoomRouted(Event):
    room: int
    rank: int
    endpoint: Endpoint


@dataclass(frozen=True)
class WriteReturned(Event):
    """A StartWrite's job came back: `error` None means the pages landed and the KvDone went out."""

    room: int
    error: str | None = None
    write: WriteResult | None = None  # the backend's, when the pages landed


# ---- effects ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Send:
    """Send `msg` to `peer`; then `on_sent` if it went out, else `on_error` (a KvFail whose reason
    gets ": <the error>" appended, see `failed`). A failed send without `on_error` is only logged."""

    peer: Endpoint
    msg: wire.Message
    on_sent: Send | None = None
    on_error: Send | None = None

    def failed(self, error: str) -> Send | None:
        """What to send instead, now that `msg` could not be sent because of `error`."""
        if self.on_error is None:
            return None
        m = cast(Union[wire.KvFail, wire.KvAbort], self.on_error.msg)
        return dataclasses.replace(self.on_error, msg=msgspec.structs.replace(m, reason=f"{m.reason}: {error}"))


@dataclass(frozen=True)
class StartWrite:
    """Write `src_pages` into the decode's `dst_pages`, then send `done` with the write's
    WriteResult in it; whatever happens, come back as one WriteReturned."""

    room: int
    peer: Endpoint
    layout: KVLayout  # the decode's, from its KvReq
    src_pages: list[int]
    dst_pages: list[int]
    done: wire.KvDone


@dataclass(frozen=True)
class PrefillReport:
    """A finished room for the worker: its pages may be released now."""

    done: HandoffDone[PrefillFacts]


PrefillEffect = Union[Send, StartWrite, PrefillReport]


# ---- what a room says: to its decode, and to its caller once over ----------------------------
H, R = HandoffState, RoomState


def kv_done(r: PrefillRoom, dp_rank: int) -> wire.KvDone:
    """The KvDone that follows `r`'s pages, carrying its PrefillFacts (the write job adds its
    WriteResult); TypeError (msgspec's, naming the field) when the engine sampled no first token."""
    facts = {f.name: getattr(r.aux, f.name) for f in dataclasses.fields(PrefillFacts)} if r.aux else {}
    return wire.KvDone(room=r.room, prefill_rank=dp_rank, **{k: v for k, v in facts.items() if v is not None})


def kv_fail(room: int, dp_rank: int, reason: str, cause: FailureCause) -> wire.KvFail:
    return wire.KvFail(room=room, prefill_rank=dp_rank, reason=reason, cause=cause.value)


def room_report(r: PrefillRoom, dp_rank: int) -> HandoffDone[PrefillFacts]:
    """`r` as its caller hears it: ok (SUCCESS) or not, reason, aux, meta, stages, dropped."""
    return HandoffDone(r.room, r.rid, r.state is R.SUCCESS, r.reason, r.aux, room_meta(r, dp_rank),
                       {**r.stages, **write_stages(r.write)}, r.state.dropped)


def room_meta(r: PrefillRoom, dp_rank: int) -> dict[str, Any]:
    d: dict[str, Any] = {f"prefill_{k}_s": v for k, v in r.handoff.durations().items()}  # as Handoff reports them
    d.update({"bootstrap_room": r.room, "prefill_dp_rank": dp_rank})
    if r.req is not None:
        d["decode_dp_rank"] = r.req.decode_rank
        if r.req.forwarded_by is not None:
            d["kv_req_forwarded_by"] = r.req.forwarded_by
    if r.state.dropped:
        d["disaggregation"] = "dropped"  # the decode prefilled it
    elif r.state.handoff is H.FAILED:
        d["failure_cause"] = r.cause.value
    if r.write is not None:
        d.update(write_meta(r.write))
    return d
