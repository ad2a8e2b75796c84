"""The decode side of the handoff as a pure machine: `DecodeHandoffs.step(event) -> effects`.

No threads, no I/O, no clock: every event carries its times (`now`, monotonic, for deadlines
and the room's state times; `wall`, time.time(), for the stage it stamps), so one sequence of
events always gives the same effects. kv_receiver.DecodeReceiver is the driver that feeds it
from the worker loop and carries out its effects; tests step it by hand (test_decode_machine.py).

Events:  Accept (a PD request: room, prefill address, hint), RankResolved (the resolver's
         Resolved: rank + endpoint, or an error), PagesReserved (the answer to a Reserve: pages,
         none free yet, or an error), KvReqSent (the kv_req send job came back, ok or not),
         Received (a typed wire message: KvDone / KvFail / KvMoved), Malformed (one that did not
         parse), PeerGone (a prefill address, or some of its ranks, is gone), PeerAlive (a
         heartbeat answer with the prefill's instance id), Abort, Tick.
Effects: Resolve / CancelResolve (the rank resolver), Reserve (call the reserve callback now and
         step its PagesReserved with the tick's `now`), SendKvReq (background; comes back as one
         KvReqSent), SendAbort (a KvAbort, best effort), GiveUp (/fail_room at the prefill's
         bootstrap service, best effort), Invalidate (forget what is cached about an address),
         Log, Report (a finished room: HandoffDone; the caller frees or uses its pages now, unless
         `held`), Release (a room reported `held` left the machine: the caller frees its pages now).
The pages are the caller's: freed at a room's Report, or for a quarantined room at its Release.

A room's DecodeState is the whole truth about it; DECODE_TRANSITIONS lists the moves (anything
else raises IllegalTransition) and `room.handoff` is its reporting view (HandoffState, the time
each was first entered). The rest of a room is data the events brought: the Resolved, the
Reservation, the KvDone's facts, the failure reason and cause, state times and stages.

  state \\ event resolved     pages      sent ok sent err  KvDone       KvFail bad done unheard     ended  Abort/deadline
  RESOLVING      RESERVING[1] -          -       -         (ignored)    FAILED FAILED   FAILED      FAILED FAILED+GiveUp
  RESERVING      .            SENDING[4] -       -         (ignored)    FAILED FAILED   FAILED      FAILED FAILED+KvAbort[3]
  SENDING        .            -          WAITING FAILED[2] WAITING,DONE FAILED FAILED   QUARANTINED FAILED ABORTING+KvAbort
  WAITING        .            -          .       FAILED[2] DONE         FAILED FAILED   QUARANTINED FAILED ABORTING+KvAbort
  ABORTING       .            -          .       FAILED    FAILED       FAILED .        QUARANTINED FAILED .[6]
  QUARANTINED    .            -          .       FAILED    FAILED       FAILED .        .[5]        FAILED .[6]
  DONE, FAILED: the next Tick reports and forgets them (Report); a FAILED room that was
  reported while QUARANTINED is forgotten with a Release instead.
"." is no move, "-" cannot happen (ignored). "unheard": a PeerGone of the room's address (its
heartbeat missed: the prefill may be dead or only cut off, and a cut-off one that has our
kv_req writes it once the link heals). "ended": proof that no process which had our kv_req is
left: a PeerGone of the room's rank (the prefill's live front says that worker died) or a
PeerAlive of another instance than the one the room was resolved against (the old server is
gone, and its workers die with it). "sent err" after the room failed: the kv_req never left.
[1] FAILED on a resolution error, or (and GiveUp) when the prefill uses another transfer backend.
[2] and Invalidate the address. A PagesReserved error fails like a deadline.
[3] GiveUp instead when the resolution had no endpoint.
[4] "pages" with none free: it stays RESERVING in the admission queue, or is refused (FAILED,
    the prefill told later); an Accept while the queue is full is refused the same way.
[5] and forget any KvAbort sent so far; a PeerAlive of the same instance (the link healed) then
    sends one more KvAbort, whose answer (KvDone or KvFail) ends the quarantine.
[6] no move on Abort; the deadline of ABORTING is `abort_grace` (-> QUARANTINED), that of
    QUARANTINED is `quarantine` (-> FAILED, and a WARNING Log).
ABORTING (kv_abort sent while a kv_req may have reached the prefill: a write could still land in
the pages) ends in FAILED on the prefill's answer (KvDone or KvFail) or proof that it ended; its
client waits for that answer up to `abort_grace`, after which it is told and the room goes on
to QUARANTINED. Rooms still resolving are not failed by a new instance: their resolution sees
it. KvMoved re-points a live resolved room at the holder's rank and endpoint (later aborts go
there); a KvDone or KvFail from another rank names the holder too.

QUARANTINED: the room failed (its client is told at the next Tick: Report with `held`) but its
pages stay held, because the prefill may still write them: only a KvDone or KvFail for the room
(a KvDone follows its pages, a KvFail is only sent once no write is out), proof that the
prefill ended, a send error of its kv_req, or the `quarantine` deadline (counted from entering
QUARANTINED) releases them (Release at the next Tick; a WARNING Log naming room, ranks and
cause on the deadline). The deadline must outlast the prefill's own bound on a write: a prefill
room starts its write within PDSERVE_BOOTSTRAP_TIMEOUT of its creation, or fails, and a write
that stalls for the transfer backend's io timeout fails; so the worker sets it to
PDSERVE_KV_QUARANTINE_TIMEOUT, else bootstrap timeout + io timeout (worker/decode.py). Not
covered: a kv_req that reaches the prefill only after the quarantine began (held in a socket's
retransmit queue through a partition longer than the deadline) -- only the prefill could refuse it.

A Tick checks every room that is not RESERVING: the deadline of a live room (`waiting_timeout`
per handoff state: Bootstrapping = RESOLVING..SENDING, from the accept; WaitingForInput =
WAITING, from the send), the grace of an aborting one, the report or the deadline of a
quarantined one, then the report (or Release) of a finished one.

Admission (`HandoffQueue`): the RESERVING rooms are a queue in arrival order. A Tick asks the
first for pages (Reserve); each PagesReserved that got them asks the next, so a later room
never takes pages an earlier one is waiting for. The first that gets none (the reserve callback
decides what fits: prompt pages plus a reserve for generation) stops the round: it and every
room behind it is queued (`queued_at`). A room that would make the queue longer than
`max_queued`, or has been queued longer than `timeout`, is refused: FAILED with cause no_pages
and `refused` set (the worker answers 429 and the router tries another decode), and the
prefill is told `tell_prefill_after` later (see `_refuse`); an Accept while the queue is full
is refused at once, before any resolution. A room's deadline check runs after its attempt, so
a reservation is always tried before the deadline is.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from dataclasses import dataclass, field
from typing import Union

import msgspec

from ..core.failures import FailureCause
from ..core.timeline import Stage, transfer_stages
from . import wire
from .handoff import Handoff, HandoffDone, HandoffState, IllegalTransition, Side
from .resolution import Resolved

H = HandoffState


@dataclass(frozen=True)
class HandoffQueue:
    """Admission of handoffs waiting for KV pages: at most `max_queued` rooms wait (None: no
    bound; 0: a room that does not fit at once is refused), each at most `timeout` seconds
    (None: only the waiting deadline); `retry_after` is what a refusal tells the client."""

    max_queued: int | None = None
    timeout: float | None = None
    retry_after: int = 1
    tell_prefill_after: float = 0.5  # see DecodeHandoffs._refuse


@dataclass(frozen=True)
class Reservation:
    """Pages for a prompt's KV: `pages[:reused_pages]` already hold it (this decode's prefix
    cache, pinned until the room ends), the rest are for the prefill to write."""

    pages: list[int]
    reused_pages: int = 0
    reused_key: str = ""  # core.page_keys key of the last reused page


class DecodeState(str, enum.Enum):
    RESOLVING = "resolving"  # accepted: the prefill rank and endpoint are being looked up
    RESERVING = "reserving"  # resolved: asking for pages every tick until the pool has them
    SENDING = "sending"  # pages reserved: the kv_req send job runs
    WAITING = "waiting"  # kv_req sent: waiting for the prefill's kv_done / kv_fail
    ABORTING = "aborting"  # failed, kv_abort sent; pages held: a write may still land
    QUARANTINED = "quarantined"  # failed and its client told; pages held: a write may still land
    DONE = "done"  # kv_done arrived: the pages landed
    FAILED = "failed"  # failed, and no write of ours can land any more

    @property
    def phase(self) -> HandoffState:
        """The state of the room's handoff (disagg/handoff.py) this state is part of."""
        return _PHASE[self]

    @property
    def live(self) -> bool:
        """Still heading for success: not failed (nor aborting, nor quarantined) and not done."""
        return self in _LIVE

    @property
    def holding(self) -> bool:
        """Failed, with pages a write of its prefill may still reach."""
        return self in (DecodeState.ABORTING, DecodeState.QUARANTINED)

    @property
    def terminal(self) -> bool:
        """Ready to be reported."""
        return self in (DecodeState.DONE, DecodeState.FAILED)


D = DecodeState
_LIVE = frozenset({D.RESOLVING, D.RESERVING, D.SENDING, D.WAITING})
_PHASE = {D.RESOLVING: H.BOOTSTRAPPING, D.RESERVING: H.BOOTSTRAPPING, D.SENDING: H.BOOTSTRAPPING,
          D.WAITING: H.WAITING_FOR_INPUT, D.ABORTING: H.FAILED, D.QUARANTINED: H.FAILED, D.DONE: H.SUCCESS,
          D.FAILED: H.FAILED}
DECODE_TRANSITIONS: dict[DecodeState, frozenset[DecodeState]] = {
    D.RESOLVING: frozenset({D.RESERVING, D.FAILED}),
    D.RESERVING: frozenset({D.SENDING, D.FAILED}),
    D.SENDING: frozenset({D.WAITING, D.ABORTING, D.QUARANTINED, D.FAILED}),
    D.WAITING: frozenset({D.DONE, D.ABORTING, D.QUARANTINED, D.FAILED}),
    D.ABORTING: frozenset({D.QUARANTINED, D.FAILED}),
    D.QUARANTINED: frozenset({D.FAILED}),
    D.DONE: frozenset(),
    D.FAILED: frozenset(),
}


@dataclass
class DecodeRoom:
    """One accepted room. `state` decides everything; the rest is what the events brought."""

    room: int
    rid: str
    addr: str
    prompt_len: int
    state: DecodeState = D.RESOLVING
    entered: dict[DecodeState, float] = field(default_factory=dict)  # state -> monotonic time
    resolved: Resolved | None = None  # from RESERVING on (a KvMoved re-points it at the holder)
    reservation: Reservation | None = None  # from SENDING on
    aux: dict | None = None  # the kv_done's facts (DONE)
    reason: str = ""  # why it failed (ABORTING, FAILED)
    cause: FailureCause = FailureCause.INTERNAL
    stages: dict[str, float] = field(default_factory=dict)  # Stage value -> time.time()
    queued_at: float | None = None  # RESERVING: when it first found no pages (the admission queue)
    refused: str = ""  # why admission refused it ("queue_full" or "timeout"): a 429, not an error
    reported: bool = False  # QUARANTINED: its client has been told (a Report with `held`)
    abort_sent: bool = False  # QUARANTINED: a KvAbort went out since its prefill was last unheard

    @property
    def created(self) -> float:
        return self.entered[D.RESOLVING]

    @property
    def handoff(self) -> Handoff:
        """The room as a Handoff (state, reason, when each handoff state was first entered)."""
        entered: dict[HandoffState, float] = {}
        for s, t in self.entered.items():  # visit order; ABORTING's time is when it failed
            entered.setdefault(s.phase, t)
        return Handoff(self.room, Side.DECODE, state=self.state.phase, reason=self.reason,
                       created=self.created, entered=entered)


# ---- events ---------------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class Event:
    now: float = 0.0  # time.monotonic() when it happened: deadlines, the room's state times
    wall: float = 0.0  # time.time() when it happened: the stage stamps it sets (PagesReserved)


@dataclass(frozen=True)
class Accept(Event):
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
    is the time of the tick that asked; `wall` is the reservation's stage stamp."""

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
class Received(Event):
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


@dataclass(frozen=True)
class Tick(Event):
    """Time passed: deadlines, abort grace, reservation attempts, reports."""


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
    """Call the reserve callback now; answer with PagesReserved (same `now` as the tick)."""

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
    peer: dict
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
class Report:
    """A room is over: its caller answers the client now, and frees (or uses) its pages, unless
    `held`: then the room stays (QUARANTINED) and a Release names it when its pages may go."""

    done: HandoffDone
    addr: str
    held: bool = False


@dataclass(frozen=True)
class Release:
    """A room reported `held` left the machine: no write can reach its pages now; free them."""

    room: int
    rid: str
    addr: str


Effect = Union[Resolve, CancelResolve, Reserve, SendKvReq, SendAbort, GiveUp, Invalidate, Log, Report, Release]


class DecodeHandoffs:
    """Every handoff of one decode DP worker. `local`: backend, endpoint, layout, page_size,
    kv_dtype, fingerprint of this worker."""

    def __init__(self, dp_rank: int, local: dict, *, waiting_timeout: float, abort_grace: float = 5.0,
                 quarantine: float = 360.0, queue: HandoffQueue | None = None):
        self.dp_rank = dp_rank
        self.local = local
        self.waiting_timeout = waiting_timeout  # per handoff state
        self.abort_grace = abort_grace  # how long a client waits for the answer to our kv_abort
        self.quarantine = quarantine  # how long pages an unheard prefill may still write stay held
        # (360: what worker/decode.py derives from the default envs, 300 s bootstrap + 60 s io)
        self.queue = queue or HandoffQueue()
        self.rooms: dict[int, DecodeRoom] = {}
        self.refused: dict[str, int] = {"queue_full": 0, "timeout": 0}  # refusals since start, by why
        self._round: list[int] = []  # RESERVING rooms this tick's round has not asked yet, in order
        self._deferred: list[tuple[float, Effect]] = []  # (due, effect): refused rooms' word to the prefill

    def queued(self) -> int:
        """Rooms in the admission queue (RESERVING, found no pages at least once)."""
        return sum(1 for r in self.rooms.values() if r.state is D.RESERVING and r.queued_at is not None)

    def quarantined(self) -> int:
        """Rooms whose pages are held after their client was told (QUARANTINED)."""
        return sum(1 for r in self.rooms.values() if r.state is D.QUARANTINED)

    def step(self, ev: Event) -> list[Effect]:
        out: list[Effect] = []
        getattr(self, _HANDLERS[type(ev)])(ev, out)
        return out

    # ---- events ---------------------------------------------------------------------------
    def _accept(self, ev: Accept, out: list) -> None:
        r = self.rooms[ev.room] = DecodeRoom(ev.room, ev.rid, ev.addr, ev.prompt_len,
                                             entered={D.RESOLVING: ev.now})
        limit, waiting = self.queue.max_queued, self.queued()
        if limit is not None and waiting and waiting >= limit:
            return self._refuse(r, "queue_full", ev.now, out)
        out.append(Resolve(ev.addr, ev.room, ev.hint))

    def _resolved(self, ev: RankResolved, out: list) -> None:
        res = ev.result
        r = self.rooms.get(res.room)
        if r is None or r.state is not D.RESOLVING:
            return
        if res.error is not None:
            return self._fail(r, res.error, res.cause, ev.now, out, tell_prefill=False)
        ours = self.local["backend"]
        theirs = res.info.transfer_backend if res.info is not None else ours
        if theirs != ours:
            reason = (f"room {r.room}: prefill {r.addr} dp_rank {res.rank} uses transfer backend "
                      f"{theirs!r}, this decode (dp_rank {self.dp_rank}) uses {ours!r}: "
                      "start both with the same --transfer-backend")
            self._fail(r, reason, FailureCause.INCOMPATIBLE, ev.now, out, tell_prefill=False)
            # no kv_abort can cross backends: the bootstrap service frees the prefill's pages
            out.append(GiveUp(r.addr, r.room, reason))
            return
        r.resolved = res
        r.stages[Stage.TOPOLOGY_LOOKUP.value] = res.topology_at
        r.stages[Stage.RANK_RESOLUTION.value] = res.resolved_at
        self._move(r, D.RESERVING, ev.now)

    def _reserved(self, ev: PagesReserved, out: list) -> None:
        r = self.rooms.get(ev.room)
        if r is None or r.state is not D.RESERVING:
            return
        if ev.error is not None:
            self._fail(r, f"room {r.room}: decode dp_rank {self.dp_rank} cannot reserve pages: {ev.error}",
                       FailureCause.NO_PAGES, ev.now, out)
        elif ev.got is not None:
            r.reservation = ev.got
            r.stages[Stage.PREALLOCATION.value] = ev.wall
            self._move(r, D.SENDING, ev.now)
            out.append(SendKvReq(r.room, r.resolved, self._kv_req(r)))
        else:  # no pages: it waits, and so does every room behind it, this round
            behind = [self.rooms[n] for n in self._round if n in self.rooms]
            self._round = []
            for q in [r, *behind]:
                if q.state is D.RESERVING:
                    self._wait_for_pages(q, ev.now, out)
                self._tick_room(q, ev.now, out)  # the rest of its tick
            return
        self._tick_room(r, ev.now, out)  # the rest of this room's tick
        self._ask_next(out)  # it no longer holds the queue up

    def _sent(self, ev: KvReqSent, out: list) -> None:
        r = self.rooms.get(ev.room)
        if r is None:
            return
        r.stages[Stage.METADATA_SENT.value] = ev.sent_at
        if r.state.holding and ev.error is not None:  # the kv_req never left: nothing can land
            return self._move(r, D.FAILED, ev.now)
        if not r.state.live:
            return
        if ev.error is not None:
            out.append(Invalidate(r.addr))  # the cached endpoint may be stale: the next room looks it up afresh
            self._fail(r, ev.error, FailureCause.TRANSFER, ev.now, out, tell_prefill=False)
        elif r.state is D.SENDING:
            self._move(r, D.WAITING, ev.now)

    def _received(self, ev: Received, out: list) -> None:
        msg = ev.msg
        r = self.rooms.get(msg.room)
        if r is None:
            return
        if isinstance(msg, wire.KvMoved):
            return self._moved(r, msg)
        if not isinstance(msg, (wire.KvDone, wire.KvFail)):
            return
        if not r.state.live:
            if r.state.holding:  # the prefill answered (our kv_abort): no write can follow
                self._move(r, D.FAILED, ev.now)
            return
        if r.resolved is not None and msg.prefill_rank is not None and msg.prefill_rank != r.resolved.rank:
            r.resolved = dataclasses.replace(r.resolved, rank=msg.prefill_rank)  # the holder answered
        if isinstance(msg, wire.KvFail):
            self._fail(r, f"room {r.room}: prefill {r.addr} dp_rank {msg.prefill_rank} failed it: {msg.reason}",
                       FailureCause.parse(msg.cause), ev.now, out, tell_prefill=False)
        elif r.state in (D.RESOLVING, D.RESERVING):
            out.append(Log(logging.WARNING, f"decode dp_rank {self.dp_rank}: kv_done for room {r.room} "
                                            "before its kv_req; ignored", r.room))
        else:
            r.aux = msgspec.structs.asdict(msg)
            r.stages.update(transfer_stages(r.aux))
            if r.state is D.SENDING:  # kv_done overtook our own "sent" event
                self._move(r, D.WAITING, ev.now)
            self._move(r, D.DONE, ev.now)

    def _moved(self, r: DecodeRoom, msg: wire.KvMoved) -> None:
        """Our KvReq was forwarded to the rank that holds the room: aborts go there now."""
        res = r.resolved
        if res is None or res.info is None or not r.state.live:
            return
        ep = msg.endpoint
        info = dataclasses.replace(res.info, dp_rank=msg.prefill_rank, endpoint=ep,
                                   rank_ip=str(ep.get("ip", res.info.rank_ip)),
                                   rank_port=int(ep.get("port", res.info.rank_port)))
        r.resolved = dataclasses.replace(res, rank=msg.prefill_rank, info=info)

    def _malformed(self, ev: Malformed, out: list) -> None:
        r = self.rooms.get(ev.room)  # type: ignore[arg-type]
        if r is None:
            return
        if r.state.live and ev.kind == wire.KV_DONE:
            self._fail(r, f"room {r.room}: prefill {r.addr} sent a bad kv_done: {ev.error}",
                       FailureCause.TRANSFER, ev.now, out, tell_prefill=False)
        else:
            out.append(Log(logging.WARNING, f"decode dp_rank {self.dp_rank}: {ev.error}; ignored", r.room))

    def _gone(self, ev: PeerGone, out: list) -> None:
        """Missed heartbeats (no `ranks`) do not prove the prefill stopped: a room it may write
        is failed but quarantined. Gone ranks do: their workers died, as their front tells."""
        ended = ev.ranks is not None
        for r in list(self.rooms.values()):
            res = r.resolved
            if r.addr != ev.addr or (ended and (res is None or res.rank not in ev.ranks)):
                continue
            if r.state.holding:
                if ended:  # no process that had our kv_req is left
                    self._move(r, D.FAILED, ev.now)
                elif r.state is D.ABORTING:
                    self._move(r, D.QUARANTINED, ev.now)
                else:
                    r.abort_sent = False  # it may have been lost: the next PeerAlive sends another
            elif r.state.live:
                where = f" (prefill dp_rank {res.rank})" if res is not None else ""
                self._fail(r, f"room {r.room}{where}: {ev.reason}", FailureCause.PEER_GONE, ev.now, out,
                           tell_prefill=False, hold=not ended)

    def _alive(self, ev: PeerAlive, out: list) -> None:
        """Rooms resolved against another instance of that prefill are lost (it restarted);
        rooms still resolving are left to their resolution, which sees the new instance. The
        same instance answering again asks it about each quarantined room (KvAbort)."""
        for r in list(self.rooms.values()):
            res = r.resolved
            if r.addr != ev.addr or res is None:
                continue
            if res.instance_id and res.instance_id != ev.instance:  # that instance writes nothing more
                if r.state.holding:
                    self._move(r, D.FAILED, ev.now)
                elif r.state.live:
                    self._fail(r, f"room {r.room} (prefill dp_rank {res.rank}): prefill server at {ev.addr} "
                                  f"restarted (instance {res.instance_id} -> {ev.instance}); its rooms are lost",
                               FailureCause.PEER_GONE, ev.now, out, tell_prefill=False)
            elif r.state is D.QUARANTINED and not r.abort_sent:
                r.abort_sent = True
                if res.info is not None:  # its answer ends the quarantine
                    out.append(self._send_abort(r))

    def _abort(self, ev: Abort, out: list) -> None:
        r = self.rooms.get(ev.room)
        if r is not None and r.state.live:
            self._fail(r, ev.reason, FailureCause.ABORTED, ev.now, out)

    def _tick(self, ev: Tick, out: list) -> None:
        due = [e for t, e in self._deferred if t <= ev.now]
        if due:
            self._deferred = [(t, e) for t, e in self._deferred if t > ev.now]
            out.extend(due)
        self._round = []
        for r in list(self.rooms.values()):
            if r.state is D.RESERVING:
                self._round.append(r.room)  # its PagesReserved runs the rest of its tick
            else:
                self._tick_room(r, ev.now, out)
        self._ask_next(out)

    def _ask_next(self, out: list) -> None:
        """Reserve for the first room of this round that is still RESERVING."""
        while self._round:
            r = self.rooms.get(self._round.pop(0))
            if r is not None and r.state is D.RESERVING:
                out.append(Reserve(r.room, r.rid, r.prompt_len))
                return

    def _wait_for_pages(self, r: DecodeRoom, now: float, out: list) -> None:
        """`r` has no pages this round: it joins the admission queue, or is refused when the
        queue is full or it has waited longer than the queue's timeout."""
        q = self.queue
        if r.queued_at is None:
            if q.max_queued is not None and self.queued() >= q.max_queued:
                return self._refuse(r, "queue_full", now, out)
            r.queued_at = now
        elif q.timeout is not None and now - r.queued_at > q.timeout:
            self._refuse(r, "timeout", now, out)

    def _refuse(self, r: DecodeRoom, why: str, now: float, out: list) -> None:
        """Admission control turns `r` away (back-pressure, not an error of the room). It holds
        no pages, so it is reported at once; the prefill is told (kv_abort, or /fail_room before a
        resolution) `tell_prefill_after` later, so that a router hears this decode's 429 and
        retries on another pair before the prefill's echo of it (a 5xx) arrives; a router
        cancels the prefill leg itself anyway."""
        q = self.queue
        waiting = self.queued() - (r.queued_at is not None and r.state is D.RESERVING)
        if why == "queue_full":
            detail = (f"its admission queue is full ({waiting} handoffs waiting for KV pages, "
                      f"--max-queued-handoffs {q.max_queued})")
        else:
            detail = (f"no KV pages within {q.timeout:g}s (--handoff-queue-timeout; {waiting} more "
                      "handoffs waiting)")
        r.refused = why
        self.refused[why] += 1
        self._fail(r, f"room {r.room}: decode dp_rank {self.dp_rank} cannot take it now: {detail}; "
                      f"retry after {q.retry_after}s or on another decode", FailureCause.NO_PAGES, now, out,
                   tell_prefill=False)
        res = r.resolved
        tell = SendAbort(r.room, res.info.peer(), wire.KvAbort(
            room=r.room, reason=r.reason, decode_rank=self.dp_rank, endpoint=self.local["endpoint"])) \
            if res is not None and res.info else GiveUp(r.addr, r.room, r.reason)
        self._deferred.append((now + q.tell_prefill_after, tell))

    # ---- helpers --------------------------------------------------------------------------
    def _tick_room(self, r: DecodeRoom, now: float, out: list) -> None:
        """Deadline of a live room, abort grace of an aborting one, report of a finished one."""
        if r.state.live:
            phase = r.state.phase
            since = next(t for s, t in r.entered.items() if s.phase is phase)
            if now - since > self.waiting_timeout:
                rank = r.resolved.rank if r.resolved else None
                self._fail(r, f"room {r.room}: decode dp_rank {self.dp_rank} waited "
                              f"{self.waiting_timeout:g}s in {phase.value} for prefill {r.addr} "
                              f"dp_rank {rank} (PDSERVE_WAITING_TIMEOUT)", FailureCause.TIMEOUT, now, out)
        if r.state is D.ABORTING and now - r.entered[D.ABORTING] > self.abort_grace:
            out.append(Log(logging.INFO, f"decode dp_rank {self.dp_rank}: prefill {r.addr} never answered "
                                         f"kv_abort of room {r.room} in {self.abort_grace:g}s; its pages "
                                         "stay quarantined", r.room))
            self._move(r, D.QUARANTINED, now)
        if r.state is D.QUARANTINED:
            if not r.reported:
                r.reported = True
                out.append(Report(self._report(r), r.addr, held=True))
            elif now - r.entered[D.QUARANTINED] > self.quarantine:
                rank = r.resolved.rank if r.resolved else None
                out.append(Log(logging.WARNING, f"decode dp_rank {self.dp_rank}: room {r.room} (prefill {r.addr} "
                                                f"dp_rank {rank}, {r.cause.value}: {r.reason}): no word from the "
                                                f"prefill in {self.quarantine:g}s of quarantine; its pages are "
                                                "released (PDSERVE_KV_QUARANTINE_TIMEOUT)", r.room))
                self._move(r, D.FAILED, now)
        if r.state.terminal:
            del self.rooms[r.room]
            out.append(Release(r.room, r.rid, r.addr) if r.reported else Report(self._report(r), r.addr))

    def _move(self, r: DecodeRoom, to: DecodeState, now: float) -> None:
        if to not in DECODE_TRANSITIONS[r.state]:
            raise IllegalTransition(f"room {r.room} (decode): illegal move {r.state.value} -> {to.value}")
        r.state = to
        r.entered[to] = now

    def _fail(self, r: DecodeRoom, reason: str, cause: FailureCause, now: float, out: list,
              tell_prefill: bool = True, hold: bool = False) -> None:
        """Fail a live room. `tell_prefill`: kv_abort to its rank when we have one (ABORTING while
        we hold pages a write may reach), else /fail_room at the bootstrap service. `hold`: the
        prefill cannot be told now, but a write may still land: QUARANTINED if it has pages."""
        if not r.state.live:
            return
        r.reason, r.cause = reason, cause
        out.append(CancelResolve(r.addr, r.room))
        to = D.QUARANTINED if hold and r.reservation is not None else D.FAILED
        if tell_prefill:
            if r.resolved is not None and r.resolved.info:
                out.append(self._send_abort(r))
                if r.reservation is not None:  # a write may still land until the prefill answers
                    to = D.ABORTING
            else:  # no rank yet: the bootstrap service frees the prefill's pages at once
                out.append(GiveUp(r.addr, r.room, reason))
        self._move(r, to, now)

    def _send_abort(self, r: DecodeRoom) -> SendAbort:
        assert r.resolved is not None and r.resolved.info is not None
        return SendAbort(r.room, r.resolved.info.peer(), wire.KvAbort(
            room=r.room, reason=r.reason, decode_rank=self.dp_rank, endpoint=self.local["endpoint"]))

    def _kv_req(self, r: DecodeRoom) -> wire.KvReq:
        res, got = r.resolved, r.reservation
        assert res is not None and got is not None
        return wire.KvReq(room=r.room, dst_pages=got.pages[got.reused_pages:], prompt_len=r.prompt_len,
                          decode_rank=self.dp_rank, prefill_rank=res.rank, prefill_instance=res.instance_id,
                          reused_pages=got.reused_pages, reused_key=got.reused_key,
                          **{k: self.local[k] for k in
                             ("layout", "endpoint", "page_size", "kv_dtype", "fingerprint", "backend")})

    def _report(self, r: DecodeRoom) -> HandoffDone:
        return HandoffDone(r.room, r.rid, r.state is D.DONE, r.reason, r.aux, self._meta(r), dict(r.stages))

    def _meta(self, r: DecodeRoom) -> dict:
        h = r.handoff
        d: dict = {"bootstrap_room": r.room, "decode_dp_rank": self.dp_rank}
        if r.state in (D.FAILED, D.QUARANTINED):
            d["failure_cause"] = r.cause.value
        if r.refused:
            d.update(admission="refused", admission_refused=r.refused, retry_after_s=self.queue.retry_after)
        if r.resolved is not None:
            d.update(prefill_dp_rank=r.resolved.rank, dp_rank_path=r.resolved.path,
                     resolve_s=r.resolved.seconds)
            got = r.reservation
            if got is not None:
                d["prealloc_wait_s"] = r.entered[D.SENDING] - r.entered[D.RESERVING]
                d["kv_reused_pages"] = got.reused_pages  # already on this decode: not moved
                d["kv_transferred_pages"] = len(got.pages) - got.reused_pages
        if H.WAITING_FOR_INPUT in h.entered:
            d["bootstrap_s"] = h.entered[H.WAITING_FOR_INPUT] - h.created
            d["waiting_s"] = h.entered[h.state] - h.entered[H.WAITING_FOR_INPUT]
        if r.aux:
            secs = r.aux.get("transfer_s") or 0.0
            d.update(kv_bytes=r.aux.get("bytes"), kv_transfer_s=secs,
                     kv_gbps=(r.aux.get("bytes", 0) / secs / 1e9) if secs > 0 else None)
        return d


_HANDLERS = {Accept: "_accept", RankResolved: "_resolved", PagesReserved: "_reserved",
             KvReqSent: "_sent", Received: "_received", Malformed: "_malformed", PeerGone: "_gone",
             PeerAlive: "_alive", Abort: "_abort", Tick: "_tick"}
