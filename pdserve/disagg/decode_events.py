"""The decode machine's events (what happened) and effects (what its driver must do), the
answers its two requests get: Resolved (which prefill DP rank holds a room, and where it
listens) and Reservation (pages), and what it says about one room: the KvReq and KvAbort its
prefill gets and the HandoffDone its caller gets when it is over. Plain data and the functions
that build it; the rules are in decode_machine, and the threads and HTTP that find a Resolved
are rank_resolver's, which this module does not import.

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
Messages: kv_req, kv_abort (to the prefill), room_report with room_meta (to the caller: ranks,
         how long each part took, pages reused and moved, the transfer's rate, admission).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from ..core.failures import FailureCause
from ..transfer.base import Endpoint
from . import wire
from .decode_rooms import DecodeRoom, DecodeState
from .handoff import Event, HandoffDone, HandoffState, write_meta
from .local_facts import LocalFacts

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


# ---- what a room says: to its prefill, and to its caller once over ----------------------------
D, H = DecodeState, HandoffState


def kv_req(r: DecodeRoom, dp_rank: int, local: LocalFacts) -> wire.KvReq:
    """The request for `r`'s KV to its resolved prefill rank: where to write (the pages it
    reserved, less those it reuses) and what this decode is (`local`)."""
    res, got = r.resolved, r.reservation
    assert res is not None and got is not None
    return wire.KvReq(room=r.room, dst_pages=got.pages[got.reused_pages:], prompt_len=r.prompt_len,
                      layout=local.layout, endpoint=local.endpoint, page_size=local.page_size,
                      kv_dtype=local.kv_dtype, fingerprint=local.fingerprint, backend=local.backend,
                      decode_rank=dp_rank, prefill_rank=res.rank, prefill_instance=res.instance_id,
                      reused_pages=got.reused_pages, reused_key=got.reused_key)


def kv_abort(r: DecodeRoom, dp_rank: int, local: LocalFacts) -> SendAbort:
    """Tell `r`'s prefill rank the room is off, with the reason it failed."""
    assert r.resolved is not None and r.resolved.info is not None
    return SendAbort(r.room, r.resolved.info.peer(), wire.KvAbort(
        room=r.room, reason=r.reason, decode_rank=dp_rank, endpoint=local.endpoint))


def room_report(r: DecodeRoom, dp_rank: int, retry_after: int) -> HandoffDone[wire.KvDone]:
    """`r` as its caller hears it: ok (DONE) or not, reason, its KvDone, meta, stages."""
    return HandoffDone(r.room, r.rid, r.state is D.DONE, r.reason, r.aux, room_meta(r, dp_rank, retry_after),
                       dict(r.stages))


def room_meta(r: DecodeRoom, dp_rank: int, retry_after: int) -> dict[str, Any]:
    """The meta_info of `r`; `retry_after` is what a refused room tells its client."""
    h = r.handoff
    d: dict[str, Any] = {"bootstrap_room": r.room, "decode_dp_rank": dp_rank}
    if r.state in (D.FAILED, D.QUARANTINED):
        d["failure_cause"] = r.cause.value
    if r.refused:
        d.update(admission="refused", admission_refused=r.refused, retry_after_s=retry_after)
    if r.resolved is not None:
        d.update(prefill_dp_rank=r.resolved.rank, dp_rank_path=r.resolved.path, resolve_s=r.resolved.seconds)
        got = r.reservation
        if got is not None:
            d["prealloc_wait_s"] = r.entered[D.SENDING] - r.entered[D.RESERVING]
            d["kv_reused_pages"] = got.reused_pages  # already on this decode: not moved
            d["kv_transferred_pages"] = len(got.pages) - got.reused_pages
    if H.WAITING_FOR_INPUT in h.entered:
        d["bootstrap_s"] = h.entered[H.WAITING_FOR_INPUT] - h.created
        d["waiting_s"] = h.entered[h.state] - h.entered[H.WAITING_FOR_INPUT]
    if r.aux is not None and r.aux.write is not None:
        d.update(write_meta(r.aux.write))
    return d
