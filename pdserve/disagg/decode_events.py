"""The decode machine's events (what happened) and effects (what its driver must do), and the
answers its two requests get: Resolved (which prefill DP rank holds a room, and where it
listens) and Reservation (pages). Plain data; the rules are in decode_machine, and the threads
and HTTP that find a Resolved are rank_resolver's, which this module does not import.

Events:  DecodeAccept (a PD request: room, prefill address, hint), RankResolved (the resolver's
         Resolved: rank + endpoint, or an error), PagesReserved (the answer to a Reserve: pages,
         none free yet, or an error), KvReqSent (the kv_req send job came back, ok or not),
         FromPrefill (a typed wire message: KvDone / KvFail / KvMoved), Malformed (one that did
         not parse), PeerGone (a prefill address, or some of its ranks, is gone), PeerAlive (a
         heartbeat answer with the prefill's instance id), Abort, and the shared Tick.
Effects: Resolve / CancelResolve (the rank resolver), Reserve (ask for pages: a synchronous
         round trip, see there), SendKvReq (background; comes back as one KvReqSent), SendAbort
         (a KvAbort, best effort), GiveUp (/fail_room at the prefill's bootstrap service, best
         effort), Invalidate (forget what is cached about an address), Log, DecodeReport (a
         finished room: HandoffDone; the caller frees or uses its pages now, unless `held`),
         Release (a room reported `held` left the machine: the caller frees its pages now).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from ..core.failures import FailureCause
from ..transfer.base import Endpoint
from . import wire
from .handoff import Event, HandoffDone

if TYPE_CHECKING:  # only named in an annotation: the table module holds locks and clocks
    from .bootstrap_table import RankInfo


# ---- the answers to a Resolve and a Reserve ---------------------------------------------------
@dataclass
class Resolved:
    """A room's prefill rank and that rank's registration, or why they could not be found."""

    room: int
    addr: str
    rank: int | None = None
    path: str = ""
    info: RankInfo | None = None
    instance_id: str = ""
    error: str | None = None
    seconds: float = 0.0
    cause: FailureCause = FailureCause.RESOLVE  # why it failed, when `error` is set
    topology_at: float = 0.0  # time.time() when the topology was in hand
    resolved_at: float = 0.0  # time.time() when the rank and its endpoint were known


@dataclass(frozen=True)
class Reservation:
    """Pages for a prompt's KV: `pages[:reused_pages]` already hold it (this decode's prefix
    cache, pinned until the room ends), the rest are for the prefill to write."""

    pages: list[int]
    reused_pages: int = 0
    reused_key: str = ""  # core.page_keys key of the last reused page


# ---- events ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class DecodeAccept(Event):
    """A PD request for `room` arrived at this decode."""

    room: int
    rid: str
    addr: str  # the prefill's bootstrap address
    prompt_len: int
    hint: int | None  # the prefill DP rank the request named, if any


@dataclass(frozen=True)
class RankResolved(Event):
    result: Resolved  # a rank and endpoint, or an error


@dataclass(frozen=True)
class PagesReserved(Event):
    """The answer to a Reserve effect: `got`, or None while the pool is full, or `error`. `now`
    is the time of the step that asked; `wall` is the reservation's stage stamp."""

    room: int
    got: Reservation | None = None
    error: str | None = None  # why the pool can never hold it


@dataclass(frozen=True)
class KvReqSent(Event):
    """A SendKvReq's job came back: `error` (the whole failure reason) or None."""

    room: int
    sent_at: float  # time.time() just before the send (the metadata_sent stage)
    error: str | None = None


@dataclass(frozen=True)
class FromPrefill(Event):
    """A typed control message from a prefill worker (KvDone, KvFail or KvMoved)."""

    msg: wire.Message


@dataclass(frozen=True)
class Malformed(Event):
    """A control message for `room` that did not parse (wire.BadMessage)."""

    room: int
    kind: object  # its "t"
    error: str


@dataclass(frozen=True)
class PeerGone(Event):
    addr: str
    reason: str
    ranks: frozenset[int] | None = None  # only the rooms resolved to these ranks; None: all of addr's


@dataclass(frozen=True)
class PeerAlive(Event):
    addr: str
    instance: str


@dataclass(frozen=True)
class Abort(Event):
    room: int
    reason: str


# ---- effects --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Resolve:
    addr: str
    room: int
    hint: int | None


@dataclass(frozen=True)
class CancelResolve:
    addr: str
    room: int


@dataclass(frozen=True)
class Reserve:
    """Ask for pages: a synchronous round trip. The driver calls its reserve function when it
    carries this out and steps the answer, PagesReserved with this step's `now`, before any
    other event (the admission round relies on it). It is always a step's last effect."""

    room: int
    rid: str
    prompt_len: int


@dataclass(frozen=True)
class SendKvReq:
    """Send `req` to the resolved rank (background); answer with KvReqSent exactly once."""

    room: int
    resolved: Resolved
    req: wire.KvReq


@dataclass(frozen=True)
class SendAbort:
    """Best effort, no answer expected here: the prefill answers on the wire."""

    room: int
    peer: Endpoint
    msg: wire.KvAbort


@dataclass(frozen=True)
class GiveUp:
    """Tell the prefill's bootstrap service the room is off (/fail_room), best effort."""

    addr: str
    room: int
    reason: str


@dataclass(frozen=True)
class Invalidate:
    """Forget what is cached about this prefill address (its endpoint may be stale)."""

    addr: str


@dataclass(frozen=True)
class Log:
    level: int
    message: str
    room: int


@dataclass(frozen=True)
class DecodeReport:
    """A room is over: its caller answers the client now, and frees (or uses) its pages, unless
    `held`: then the room stays (QUARANTINED) and a Release names it when its pages may go."""

    done: HandoffDone[wire.KvDone]
    addr: str
    held: bool = False


@dataclass(frozen=True)
class Release:
    """A room reported `held` left the machine: no write can reach its pages now; free them."""

    room: int
    rid: str
    addr: str


DecodeEffect = Union[Resolve, CancelResolve, Reserve, SendKvReq, SendAbort, GiveUp, Invalidate, Log,
                     DecodeReport, Release]
