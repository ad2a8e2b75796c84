"""The prefill side of the handoff as a pure machine: `PrefillHandoffs.step(event) -> effects`.

No threads, no I/O, no clock: every event carries its times (`now`, monotonic, for deadlines
and the Handoff's state times; `wall`, time.time(), for the stage stamps), so one sequence of
events always gives the same effects. kv_sender.PrefillSender is the driver that feeds it from
the worker loop and carries out its effects; tests step it by hand (test_prefill_machine.py).

Events:  Accept (the prefill request), PrefillDone (pages + the engine's aux facts), Received (a
         typed wire message: KvReq / KvAbort), Fail (abort), MarkFailed (the front failed the
         room), Drop (the decode prefilled it itself), RoomRouted (the front sent a room homed
         here elsewhere), WriteReturned (a page-write job came back, ok or not), Tick (deadlines,
         reaping, expiry).
Effects: Send (a message to a peer; optionally one more on success / on failure), StartWrite
         (write pages to the decode, then send its KvDone), Report (a finished room: HandoffDone).

A room's RoomState is the whole truth about it: which events it takes, whether a write may
still read its pages, whether its decode has spoken, how it is reported. TRANSITIONS lists the
moves (each checked; IllegalTransition otherwise); the rest of a room is data the events brought
(the KvReq, the decode's endpoint, pages, aux, the write's facts, reason and cause, times).
`room.handoff` is the room seen as a Handoff (HandoffState and when each was entered), derived
from its states and their times: what is reported (meta_info `prefill_<state>_s`).

  state \\ event     PrefillDone    KvReq              KvAbort | Fail, deadline   Drop       write ok  write error
  BOOTSTRAPPING     PREFILLED      WAITING_FOR_INPUT  FAILED* | FAILED_UNHEARD   DROPPED_U  -         -
  PREFILLED         .              TRANSFERRING       FAILED* | FAILED_UNHEARD   DROPPED_U  -         -
  WAITING_FOR_INPUT TRANSFERRING   . (duplicate)      FAILED*                    .          -         -
  TRANSFERRING      .              . (duplicate)      FAILING                    .          SUCCESS   FAILED*
  FAILING           .              . (duplicate)      .                          .          FAILED    FAILED*
  FAILED_UNHEARD    .              FAILED*            . (KvAbort: KvFail)        .          -         -
  DROPPED_UNHEARD   .              DROPPED*           . (KvAbort: KvFail)        .          -         -
  SUCCESS, FAILED, DROPPED: no moves; a KvAbort is answered with KvFail.
"*": the decode is sent KvFail. "." no move (PrefillDone still records pages and aux). "-" raises
IllegalTransition (a write result with no write out). In BOOTSTRAPPING and PREFILLED a KvReq is
checked first (compat, instance, doomed room, page counts, reused prefix key): a bad one goes to
FAILED*; so does a PrefillDone whose aux has no first token (no KvDone could follow the write).
MarkFailed acts as Fail. Tick applies the deadline, then reports and forgets every room
that ended with no write out (SUCCESS, FAILED[_UNHEARD], DROPPED[_UNHEARD]); a failed one is
remembered as doomed.

Rooms without a request here are notes, not rooms: `early` (a KvReq that came first), `doomed`
(rooms that cannot succeed here, remembered for failed_ttl), `dropped` (a drop that came first),
`routes` (rooms homed here that the front sent to another rank) and `forwarded` (KvReqs passed
on to their holder, so later aborts follow them).
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Union

import msgspec

from ..core.failures import FailureCause, rejection_cause
from ..core.page_keys import prefix_key
from ..core.timeline import Stage, transfer_stages
from ..transfer.base import peer_name
from . import wire
from .handoff import Handoff, HandoffDone, HandoffState, IllegalTransition, Side

H = HandoffState


class RoomState(str, enum.Enum):
    BOOTSTRAPPING = "bootstrapping"  # accepted; no KvReq; the prompt is being prefilled
    PREFILLED = "prefilled"  # accepted; its pages hold the KV; no KvReq yet
    WAITING_FOR_INPUT = "waiting_for_input"  # the decode's KvReq is here; still prefilling
    TRANSFERRING = "transferring"  # the page write (then the KvDone) is out
    FAILING = "failing"  # failed while its write is out: pages held, the decode told when it returns
    SUCCESS = "success"  # the KvDone went out after the pages
    FAILED = "failed"  # no write can land any more; the decode has its answer
    FAILED_UNHEARD = "failed_unheard"  # failed before its decode spoke: a KvReq gets KvFail
    DROPPED_UNHEARD = "dropped_unheard"  # ended without a transfer (the decode prefilled it)
    DROPPED = "dropped"  # dropped, and a KvReq that came anyway was answered

    @property
    def handoff(self) -> HandoffState:
        """The HandoffState it is reported as."""
        return _HANDOFF[self]

    @property
    def live(self) -> bool:
        """Still heading for success: the bootstrap deadline applies and a failure moves it."""
        return self in _LIVE

    @property
    def writing(self) -> bool:
        """A page write is out: it may still read the pages and land in the decode's."""
        return self in (RoomState.TRANSFERRING, RoomState.FAILING)

    @property
    def finished(self) -> bool:
        """Ended with no write out: reported (and its pages released) at the next Tick."""
        return not self.live and not self.writing

    @property
    def unheard(self) -> bool:
        """Ended before its decode spoke: the decode's KvReq, when it comes, is answered."""
        return self in (RoomState.FAILED_UNHEARD, RoomState.DROPPED_UNHEARD)

    @property
    def dropped(self) -> bool:
        return self in (RoomState.DROPPED_UNHEARD, RoomState.DROPPED)


R = RoomState
_HANDOFF = {R.BOOTSTRAPPING: H.BOOTSTRAPPING, R.PREFILLED: H.BOOTSTRAPPING,
            R.WAITING_FOR_INPUT: H.WAITING_FOR_INPUT, R.TRANSFERRING: H.TRANSFERRING, R.SUCCESS: H.SUCCESS,
            R.FAILING: H.FAILED, R.FAILED: H.FAILED, R.FAILED_UNHEARD: H.FAILED,
            R.DROPPED_UNHEARD: H.FAILED, R.DROPPED: H.FAILED}
_LIVE = frozenset({R.BOOTSTRAPPING, R.PREFILLED, R.WAITING_FOR_INPUT, R.TRANSFERRING})
_HEARD = {R.FAILED_UNHEARD: R.FAILED, R.DROPPED_UNHEARD: R.DROPPED}
_WAITING_FOR = {R.BOOTSTRAPPING: "the decode's metadata (kv_req)", R.PREFILLED: "the decode's metadata (kv_req)",
                R.WAITING_FOR_INPUT: "the prefill to finish", R.TRANSFERRING: "the KV write"}

TRANSITIONS: dict[RoomState, frozenset[RoomState]] = {
    R.BOOTSTRAPPING: frozenset({R.PREFILLED, R.WAITING_FOR_INPUT, R.FAILED, R.FAILED_UNHEARD, R.DROPPED_UNHEARD}),
    R.PREFILLED: frozenset({R.TRANSFERRING, R.FAILED, R.FAILED_UNHEARD, R.DROPPED_UNHEARD}),
    R.WAITING_FOR_INPUT: frozenset({R.TRANSFERRING, R.FAILED}),
    R.TRANSFERRING: frozenset({R.SUCCESS, R.FAILING, R.FAILED}),
    R.FAILING: frozenset({R.FAILED}),
    R.FAILED_UNHEARD: frozenset({R.FAILED}),
    R.DROPPED_UNHEARD: frozenset({R.DROPPED}),
    R.SUCCESS: frozenset(),
    R.FAILED: frozenset(),
    R.DROPPED: frozenset(),
}


# ---- events -----------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Event:
    now: float = 0.0  # time.monotonic() when it happened: deadlines, the Handoff's state times
    wall: float = 0.0  # time.time() when it happened: the room's stage stamps


@dataclass(frozen=True)
class Accept(Event):
    """The prefill request for `room` arrived (ValueError if the room is already in progress)."""

    room: int
    rid: str
    prompt_len: int
    prompt_ids: list[int] | None = None  # to check a decode's reused prefix


@dataclass(frozen=True)
class PrefillDone(Event):
    room: int
    pages: list[int]
    aux: dict  # the KvDone facts of _DONE_FIELDS: first token, logprobs, prompt_len, cached_tokens


@dataclass(frozen=True)
class Received(Event):
    sender: dict
    msg: wire.Message


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
    endpoint: dict


@dataclass(frozen=True)
class WriteFacts:
    """What a page write did (transfer.base.WriteResult), as KvDone and meta_info carry it."""

    bytes: int = 0
    transfer_s: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    writes: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class WriteReturned(Event):
    """A StartWrite's job came back: `error` None means the pages landed and the KvDone went out."""

    room: int
    error: str | None = None
    facts: WriteFacts | None = None


@dataclass(frozen=True)
class Tick(Event):
    """Time passed: bootstrap deadlines, reporting finished rooms, expiring notes."""


# ---- effects ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Send:
    """Send `msg` to `peer`; then `on_sent` if it went out, else `on_error` (a KvFail whose reason
    gets ": <the error>" appended, see `failed`). A failed send without `on_error` is only logged."""

    peer: dict
    msg: wire.Message
    on_sent: Send | None = None
    on_error: Send | None = None

    def failed(self, error: str) -> Send | None:
        """What to send instead, now that `msg` could not be sent because of `error`."""
        if self.on_error is None:
            return None
        m = self.on_error.msg
        return dataclasses.replace(self.on_error, msg=msgspec.structs.replace(m, reason=f"{m.reason}: {error}"))


@dataclass(frozen=True)
class StartWrite:
    """Write `src_pages` into the decode's `dst_pages`, then send `done` with the write's facts
    (bytes, timings) filled in; whatever happens, come back as one WriteReturned."""

    room: int
    peer: dict
    layout: dict
    src_pages: list[int]
    dst_pages: list[int]
    done: wire.KvDone


@dataclass(frozen=True)
class Report:
    """A finished room for the worker: its pages may be released now."""

    done: HandoffDone


Effect = Union[Send, StartWrite, Report]


# ---- the rooms and the notes ------------------------------------------------------------------
@dataclass
class PrefillRoom:
    """One accepted room. `state` decides everything; the rest is what the events brought."""

    room: int
    rid: str
    prompt_len: int
    prompt_ids: list[int] | None = None
    state: RoomState = RoomState.BOOTSTRAPPING
    entered: dict[RoomState, float] = field(default_factory=dict)  # state -> monotonic time
    req: wire.KvReq | None = None  # the decode's, once attached
    peer: dict | None = None  # where the decode hears from us (None exactly until it spoke)
    pages: list[int] | None = None  # set when the prefill finished
    aux: dict | None = None
    write: WriteFacts | None = None  # what its page write did, when it came back ok
    reason: str = ""  # set with the first failure
    cause: FailureCause = FailureCause.INTERNAL
    stages: dict[str, float] = field(default_factory=dict)  # Stage value -> wall time

    @property
    def created(self) -> float:
        return self.entered[RoomState.BOOTSTRAPPING]

    @property
    def handoff(self) -> Handoff:
        """The room as a Handoff (its HandoffState, reason, when each was first entered): what
        is reported. A KvReq that found the prefill done passes WaitingForInput at once."""
        entered: dict[HandoffState, float] = {}
        for s, t in self.entered.items():  # visit order: the table only moves forward
            if s.handoff is H.TRANSFERRING:
                entered.setdefault(H.WAITING_FOR_INPUT, t)
            entered.setdefault(s.handoff, t)
        return Handoff(self.room, Side.PREFILL, state=self.state.handoff, reason=self.reason,
                       created=self.created, entered=entered)


class Early(NamedTuple):
    """A KvReq that came before its request."""

    peer: dict
    req: wire.KvReq
    since: float


class Doomed(NamedTuple):
    """A room that cannot succeed here, remembered for `failed_ttl`."""

    reason: str
    since: float
    cause: FailureCause


class Dropped(NamedTuple):
    """A drop that came before the room's request."""

    reason: str
    since: float


class Route(NamedTuple):
    """Where the front sent a room whose home is this rank."""

    rank: int
    endpoint: dict
    since: float


class Forwarded(NamedTuple):
    """A KvReq this rank passed on to the holder; later aborts for the room follow it."""

    holder: dict
    since: float


_DONE_FIELDS = ("first_token", "first_logprob", "first_top_logprobs", "input_logprobs", "input_top_logprobs",
                "prompt_len", "cached_tokens")


def _done_fields(aux: dict) -> dict:
    """The KvDone fields of the engine's facts about a finished prefill."""
    return {k: aux[k] for k in _DONE_FIELDS if aux.get(k) is not None}


class PrefillHandoffs:
    """Every room of one prefill DP rank. `local` holds page_size, kv_dtype, fingerprint and
    backend (what a KvReq must agree with); `instance_id` is this server's bootstrap instance
    ("" = not checked)."""

    def __init__(self, dp_rank: int, local: dict, *, bootstrap_timeout: float, failed_ttl: float = 600.0,
                 instance_id: str = ""):
        self.dp_rank = dp_rank
        self.local = local
        self.bootstrap_timeout = bootstrap_timeout
        self.failed_ttl = failed_ttl
        self.instance_id = instance_id
        self.rooms: dict[int, PrefillRoom] = {}
        self.early: dict[int, Early] = {}
        self.doomed: dict[int, Doomed] = {}
        self.dropped: dict[int, Dropped] = {}
        self.routes: dict[int, Route] = {}
        self.forwarded: dict[int, Forwarded] = {}
        self._now = 0.0
        self._wall = 0.0
        self._out: list[Effect] = []

    def step(self, ev: Event) -> list[Effect]:
        handler = self._HANDLERS.get(type(ev))
        if handler is None:
            raise TypeError(f"not a prefill handoff event: {ev!r}")
        self._now, self._wall, self._out = ev.now, ev.wall, []
        handler(self, ev)
        out, self._out = self._out, []
        return out

    # ---- the room's moves -------------------------------------------------------------------
    def _move(self, r: PrefillRoom, to: RoomState, reason: str | None = None,
              cause: FailureCause = FailureCause.INTERNAL) -> None:
        if to not in TRANSITIONS[r.state]:
            raise IllegalTransition(f"room {r.room} (prefill): illegal move {r.state.value} -> {to.value}"
                                    + (f" (failed: {r.reason})" if r.reason else ""))
        if reason is not None:
            r.reason, r.cause = reason, cause
        r.state = to
        r.entered[to] = self._now

    def _fail(self, r: PrefillRoom, reason: str, cause: FailureCause, peer: dict | None = None) -> None:
        """Fail a live room (a failed one keeps its first reason, a succeeded one raises); `peer`
        is the decode's endpoint if it just spoke. A write that is out keeps the pages, and the
        decode waits for it."""
        if r.state.handoff is H.FAILED:
            return
        if r.peer is None:
            r.peer = peer
        if r.state is R.TRANSFERRING:
            self._move(r, R.FAILING, reason, cause)
        elif r.peer is None:
            self._move(r, R.FAILED_UNHEARD, reason, cause)
        else:
            self._move(r, R.FAILED, reason, cause)
            self._tell_failed(r)

    def _drop(self, r: PrefillRoom, reason: str) -> None:
        self._move(r, R.DROPPED_UNHEARD, f"room {r.room}: dropped: {reason}", FailureCause.ABORTED)

    def _tell_failed(self, r: PrefillRoom) -> None:
        self._send(r.peer, self._kv_fail(r.room, r.reason, r.cause))

    def _attach(self, r: PrefillRoom, req: wire.KvReq) -> None:
        page = self.local["page_size"]
        need = -(-r.prompt_len // page) - req.reused_pages
        reason = None
        if len(req.dst_pages) != need or req.prompt_len != r.prompt_len:
            reason = (f"room {r.room}: decode sent {len(req.dst_pages)} pages (reusing "
                      f"{req.reused_pages}) for {req.prompt_len} tokens, prefill has {r.prompt_len} "
                      f"tokens ({need + req.reused_pages} pages): the two legs got different prompts")
        elif req.reused_pages and not 0 < req.reused_pages <= r.prompt_len // page:
            reason = (f"room {r.room}: decode claims {req.reused_pages} reused pages of a "
                      f"{r.prompt_len}-token prompt ({r.prompt_len // page} full pages)")
        elif req.reused_pages and (r.prompt_ids is None or
                                   prefix_key(r.prompt_ids, page, req.reused_pages) != req.reused_key):
            reason = (f"room {r.room}: decode dp_rank {req.decode_rank} holds {req.reused_pages} pages of "
                      f"another prefix (key {req.reused_key[:16]}...) than this prompt's: prefix hash "
                      "mismatch")
        if reason is not None:
            return self._fail(r, reason, FailureCause.INCOMPATIBLE, peer=req.endpoint)
        r.peer, r.req = req.endpoint, req
        r.stages[Stage.METADATA_RECEIVED.value] = self._wall
        if r.state is R.PREFILLED:
            self._start_write(r)
        else:
            self._move(r, R.WAITING_FOR_INPUT)

    def _start_write(self, r: PrefillRoom) -> None:
        req = r.req
        try:
            done = wire.KvDone(room=r.room, prefill_rank=self.dp_rank, **_done_fields(r.aux or {}))
        except TypeError as e:  # the engine's facts lack the first token: nothing to hand over
            return self._fail(r, self._write_failed(r, str(e)), FailureCause.TRANSFER)
        self._move(r, R.TRANSFERRING)
        src = r.pages[req.reused_pages:][:len(req.dst_pages)]  # the decode holds the reused ones
        self._out.append(StartWrite(r.room, r.peer, req.layout, src, list(req.dst_pages), done))

    def _write_failed(self, r: PrefillRoom, error: str) -> str:
        return (f"room {r.room}: KV transfer from prefill dp_rank {self.dp_rank} to decode "
                f"{peer_name(r.peer)} failed: {error}")

    # ---- notes about rooms with no request here -----------------------------------------------
    def _doom(self, room: int, reason: str, cause: FailureCause) -> None:
        """Remember that `room` cannot succeed here; tell a decode whose KvReq is queued."""
        self.doomed[room] = Doomed(reason, self._now, cause)
        if room in self.early:
            self._refuse(self.early.pop(room).peer, room, reason, cause)

    def _refuse(self, peer: dict, room: int, reason: str, cause: FailureCause) -> None:
        """Doom a room that has no request here and answer its decode with KvFail."""
        self.doomed[room] = Doomed(reason, self._now, cause)
        self._send(peer, self._kv_fail(room, reason, cause))

    def _forward(self, req: wire.KvReq, route: Route) -> None:
        """Pass the decode's KvReq to the holder, then tell the decode where it went (KvMoved); if
        the holder cannot be reached the decode hears KvFail from here."""
        room = req.room
        self.forwarded[room] = Forwarded(route.endpoint, self._now)
        why = (f"room {room}: prefill dp_rank {self.dp_rank} could not forward the KV request to "
               f"dp_rank {route.rank} that holds the room")
        self._out.append(Send(
            route.endpoint, msgspec.structs.replace(req, forwarded_by=self.dp_rank),
            on_sent=Send(req.endpoint, wire.KvMoved(room=room, prefill_rank=route.rank, endpoint=route.endpoint)),
            on_error=Send(req.endpoint, self._kv_fail(room, why, FailureCause.TRANSFER))))

    def _send(self, peer: dict, msg: wire.Message) -> None:
        self._out.append(Send(peer, msg))

    def _kv_fail(self, room: int, reason: str, cause: FailureCause) -> wire.KvFail:
        return wire.KvFail(room=room, prefill_rank=self.dp_rank, reason=reason, cause=cause.value)

    # ---- events -------------------------------------------------------------------------------
    def _on_accept(self, ev: Accept) -> None:
        room = ev.room
        if room in self.rooms:
            raise ValueError(f"room {room} is already in progress on prefill dp_rank {self.dp_rank}")
        r = PrefillRoom(room, ev.rid, ev.prompt_len, ev.prompt_ids, entered={R.BOOTSTRAPPING: self._now})
        self.rooms[room] = r
        if room in self.dropped:
            self._drop(r, self.dropped.pop(room).reason)
        elif room in self.doomed:
            self._fail(r, self.doomed[room].reason, self.doomed[room].cause)
        elif room in self.early:
            self._attach(r, self.early.pop(room).req)

    def _on_prefill_done(self, ev: PrefillDone) -> None:
        r = self.rooms.get(ev.room)
        if r is None:
            return
        r.pages, r.aux = ev.pages, ev.aux  # recorded in any state: the pages are held until reported
        r.stages[Stage.PREFILL_DONE.value] = ev.wall
        if r.state is R.BOOTSTRAPPING:
            self._move(r, R.PREFILLED)
        elif r.state is R.WAITING_FOR_INPUT:
            self._start_write(r)

    def _on_fail(self, ev: Fail) -> None:
        r = self.rooms.get(ev.room)
        if r is not None and r.state.live:
            self._fail(r, ev.reason, ev.cause)

    def _on_mark_failed(self, ev: MarkFailed) -> None:
        """The front failed the room (rejected it, or its decode gave it up): it ends here if in
        progress, and a KvReq for it (queued or later) is answered with the reason."""
        cause = rejection_cause(ev.reason)
        r = self.rooms.get(ev.room)
        if r is not None and r.state.live:
            self._fail(r, ev.reason, cause)
        self._doom(ev.room, ev.reason, cause)

    def _on_drop(self, ev: Drop) -> None:
        """The room's decode prefilled it itself: end it with no transfer, now or when its request
        arrives. A room whose KvReq already came is being served and is left alone."""
        r = self.rooms.get(ev.room)
        if r is None:
            self.dropped[ev.room] = Dropped(ev.reason, self._now)
        elif r.state in (R.BOOTSTRAPPING, R.PREFILLED):
            self._drop(r, ev.reason)

    def _on_room_routed(self, ev: RoomRouted) -> None:
        """The front sent `room` (homed here) to `rank`: a KvReq for it here goes on there."""
        room = ev.room
        route = self.routes[room] = Route(ev.rank, ev.endpoint, self._now)
        if room in self.early and room not in self.rooms:
            self._forward(self.early.pop(room).req, route)
        elif room in self.doomed:  # its decode gave up here already: the holder must free it too
            self._send(ev.endpoint, wire.KvAbort(room=room, reason=self.doomed[room].reason))

    def _on_received(self, ev: Received) -> None:
        if isinstance(ev.msg, wire.KvReq):
            self._on_kv_req(ev.msg)
        elif isinstance(ev.msg, wire.KvAbort):
            self._on_kv_abort(ev.sender, ev.msg)

    def _on_kv_req(self, msg: wire.KvReq) -> None:
        room, peer = msg.room, msg.endpoint
        r = self.rooms.get(room)
        if r is not None and r.state not in (R.BOOTSTRAPPING, R.PREFILLED):
            if r.state.unheard:  # ended before its decode spoke: answer it now
                r.peer = peer
                self._move(r, _HEARD[r.state])
                self._tell_failed(r)
            return  # else a duplicate: this room already has its decode
        if r is None and room in self.routes and msg.forwarded_by is None:
            return self._forward(msg, self.routes[room])
        problem, cause = self._kv_req_problem(msg)
        if problem is not None:
            if r is None:
                self.early.pop(room, None)
                self._refuse(peer, room, problem, cause)
            else:
                self._fail(r, problem, cause, peer=peer)
        elif r is None:
            self.early[room] = Early(peer, msg, self._now)
        else:
            self._attach(r, msg)

    def _kv_req_problem(self, msg: wire.KvReq) -> tuple[str | None, FailureCause]:
        room = msg.room
        problem = wire.compat_problem(self.local, msg)
        if problem is not None:
            return (f"room {room}: decode dp_rank {msg.decode_rank} cannot use prefill dp_rank "
                    f"{self.dp_rank}: {problem}"), FailureCause.INCOMPATIBLE
        if self.instance_id and msg.prefill_instance and msg.prefill_instance != self.instance_id:
            return (f"room {room}: the decode resolved prefill dp_rank {self.dp_rank} on bootstrap "
                    f"instance {msg.prefill_instance}, but this server is instance {self.instance_id}: "
                    "the prefill restarted and lost the room"), FailureCause.PEER_GONE
        if room in self.doomed:
            return self.doomed[room].reason, self.doomed[room].cause
        return None, FailureCause.INTERNAL

    def _on_kv_abort(self, sender: dict, msg: wire.KvAbort) -> None:
        """Fail the room and always answer (KvDone or KvFail): the decode keeps its pages until
        it knows no write of ours can still land in them."""
        room = msg.room
        sender = msg.endpoint or sender  # a forwarded abort comes from the home rank
        reason = f"room {room}: decode dp_rank {msg.decode_rank} aborted it: {msg.reason}"
        r = self.rooms.get(room)
        if r is None:
            holder = self.forwarded[room].holder if room in self.forwarded else (
                self.routes[room].endpoint if room in self.routes else None)
            if holder is not None:  # the holder answers the decode
                return self._send(holder, msgspec.structs.replace(msg, endpoint=sender))
            early = self.early.pop(room, None)
            self._refuse(early.peer if early else sender, room, reason, FailureCause.ABORTED)
        elif r.state.live:
            self._fail(r, reason, FailureCause.ABORTED, peer=sender)
        elif r.state.finished:  # ended, not yet reported: answer again
            self._send(sender if r.state.unheard else r.peer, self._kv_fail(room, r.reason or reason, r.cause))
        # FAILING: the decode is answered when the write returns

    def _on_write_returned(self, ev: WriteReturned) -> None:
        r = self.rooms.get(ev.room)
        if r is None:
            return
        if not r.state.writing:
            raise IllegalTransition(f"room {r.room} (prefill): a page write returned in state "
                                    f"{r.state.value}, which has none out")
        r.write = ev.facts
        if ev.error is None:  # its KvDone went out: the decode has its answer even if we failed meanwhile
            self._move(r, R.SUCCESS if r.state is R.TRANSFERRING else R.FAILED)
            return
        if r.state is R.TRANSFERRING:
            self._move(r, R.FAILED, self._write_failed(r, ev.error), FailureCause.TRANSFER)
        else:
            self._move(r, R.FAILED)  # keeps the earlier reason (abort, timeout)
        self._tell_failed(r)

    def _on_tick(self, ev: Tick) -> None:
        now = self._now
        for r in list(self.rooms.values()):
            if r.state.live and now - r.created > self.bootstrap_timeout:
                self._fail(r, f"room {r.room}: prefill dp_rank {self.dp_rank} waited "
                              f"{self.bootstrap_timeout:g}s for {_WAITING_FOR[r.state]} "
                              f"(PDSERVE_BOOTSTRAP_TIMEOUT)", FailureCause.TIMEOUT)
            if r.state.finished:
                del self.rooms[r.room]
                if r.state.handoff is H.FAILED and not r.state.dropped:  # a late KvReq is answered at once
                    self.doomed[r.room] = Doomed(r.reason, now, r.cause)
                self._out.append(Report(self._report(r)))
        self._expire(now)

    def _report(self, r: PrefillRoom) -> HandoffDone:
        write = r.write.as_dict() if r.write is not None else {}
        return HandoffDone(r.room, r.rid, r.state is R.SUCCESS, r.reason, r.aux, self._meta(r),
                           {**r.stages, **transfer_stages(write)}, r.state.dropped)

    def _meta(self, r: PrefillRoom) -> dict:
        d = {f"prefill_{k}_s": v for k, v in r.handoff.durations().items()}  # as Handoff reports them
        d.update({"bootstrap_room": r.room, "prefill_dp_rank": self.dp_rank})
        if r.req is not None:
            d["decode_dp_rank"] = r.req.decode_rank
            if r.req.forwarded_by is not None:
                d["kv_req_forwarded_by"] = r.req.forwarded_by
        if r.state.dropped:
            d["disaggregation"] = "dropped"  # the decode prefilled it
        elif r.state.handoff is H.FAILED:
            d["failure_cause"] = r.cause.value
        if r.write is not None:
            secs = r.write.transfer_s
            d["kv_bytes"] = r.write.bytes
            d["kv_transfer_s"] = secs
            d["kv_gbps"] = r.write.bytes / secs / 1e9 if secs > 0 else None
        return d

    def _expire(self, now: float) -> None:
        for room, early in list(self.early.items()):
            if now - early.since > self.bootstrap_timeout:
                self._doom(room, f"room {room}: prefill dp_rank {self.dp_rank} never received its "
                                 f"request within {self.bootstrap_timeout:g}s (PDSERVE_BOOTSTRAP_TIMEOUT)",
                           FailureCause.TIMEOUT)
        for table in (self.doomed, self.dropped):
            for room, note in list(table.items()):
                if now - note.since > self.failed_ttl:
                    del table[room]
        for table in (self.routes, self.forwarded):
            for room, note in list(table.items()):
                if now - note.since > self.bootstrap_timeout:
                    del table[room]

    _HANDLERS: dict[type, Callable] = {
        Accept: _on_accept, PrefillDone: _on_prefill_done, Received: _on_received, Fail: _on_fail,
        MarkFailed: _on_mark_failed, Drop: _on_drop, RoomRouted: _on_room_routed,
        WriteReturned: _on_write_returned, Tick: _on_tick,
    }
