"""The prefill machine's events (what happened) and effects (what its driver must do). Plain
data; the rules are in prefill_machine.

Events:  PrefillAccept (the prefill request), PrefillDone (pages + the engine's PrefillFacts),
         FromDecode (a typed wire message: KvReq / KvAbort), Malformed (one that did not parse),
         Fail (abort), MarkFailed (the front
         failed the room), Drop (the decode prefilled it itself), RoomRouted (the front sent a
         room homed here elsewhere), WriteReturned (a page-write job came back, ok or not), and
         the shared Tick (deadlines, reaping, expiry).
Effects: Send (a message to a peer; optionally one more on success / on failure), StartWrite
         (write pages to the decode, then send its KvDone), PrefillReport (a finished room:
         HandoffDone).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Union, cast

import msgspec

from ..core.failures import FailureCause
from ..core.kv_layout import KVLayout
from ..core.logprobs import TopLogprobs
from ..transfer.base import Endpoint, WriteResult
from . import wire
from .handoff import Event, HandoffDone


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
