"""A decode room: its states, the moves between them, and the data its events brought; and the
admission queue of the rooms waiting for pages. The events are decode_events', the machine that
moves rooms is decode_machine.

A room's DecodeState is the whole truth about it; DECODE_TRANSITIONS lists the moves (anything
else raises IllegalTransition) and `room.handoff` is its reporting view (HandoffState, the time
each was first entered). The rest of a room is data the events brought: the Resolved, the
Reservation, the KvDone's facts, the failure reason and cause, state times and stages.

state\\event resolved     pages      sent ok sent err  KvDone       KvFail bad done unheard     ended  Abort/deadline
RESOLVING    RESERVING[1] -          -       -         (ignored)    FAILED FAILED   FAILED      FAILED FAILED+GiveUp
RESERVING    .            SENDING[4] -       -         (ignored)    FAILED FAILED   FAILED      FAILED FAILED+KvAbort[3]
SENDING      .            -          WAITING FAILED[2] WAITING,DONE FAILED FAILED   QUARANTINED FAILED ABORTING+KvAbort
WAITING      .            -          .       FAILED[2] DONE         FAILED FAILED   QUARANTINED FAILED ABORTING+KvAbort
ABORTING     .            -          .       FAILED    FAILED       FAILED .        QUARANTINED FAILED .[6]
QUARANTINED  .            -          .       FAILED    FAILED       FAILED .        .[5]        FAILED .[6]
  DONE, FAILED: the next Tick reports and forgets them (DecodeReport); a FAILED room that was
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
    the prefill told later); a DecodeAccept while the queue is full is refused the same way.
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

QUARANTINED: the room failed (its client is told at the next Tick: DecodeReport with `held`)
but its pages stay held, because the prefill may still write them: only a KvDone or KvFail for
the room (a KvDone follows its pages, a KvFail is only sent once no write is out), proof that the
prefill ended, a send error of its kv_req, or the `quarantine` deadline (counted from entering
QUARANTINED) releases them (Release at the next Tick; a WARNING Log naming room, ranks and
cause on the deadline). The deadline must outlast the prefill's own bound on a write: a prefill
room starts its write within PDSERVE_BOOTSTRAP_TIMEOUT of its creation, or fails, and a write
that stalls for the transfer backend's io timeout fails; so the worker sets it to
PDSERVE_KV_QUARANTINE_TIMEOUT, else bootstrap timeout + io timeout (worker/decode.py). Not
covered: a kv_req that reaches the prefill only after the quarantine began (held in a socket's
retransmit queue through a partition longer than the deadline) -- only the prefill could refuse it.

Admission of rooms waiting for KV pages: the queue's bounds (HandoffQueue) and its bookkeeping
(Admission), which picks the room asked for pages next and says who is refused; the machine
makes the moves. The RESERVING rooms are a queue in arrival order. A Tick asks the first for
pages (Reserve); each PagesReserved that got them asks the next, so a later room never takes
pages an earlier one is waiting for. The first that gets none (the reserve function decides what
fits: prompt pages plus a reserve for generation) stops the round: it and every room behind it
is queued (`queued_at`). A room that would make the queue longer than `max_queued`, or has been
queued longer than `timeout`, is refused: FAILED with cause no_pages and `refused` set (the
worker answers 429 and the router tries another decode), and the prefill is told
`tell_prefill_after` later (see `Admission.tell_later`); a DecodeAccept while the queue is full
is refused at once, before any resolution. A room's deadline check runs after its attempt, so a
reservation is always tried before the deadline is.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..core.failures import FailureCause
from ..transfer.base import Endpoint
from .handoff import Handoff, HandoffState, IllegalTransition, Side
from .wire import KvDone

if TYPE_CHECKING:  # only named in annotations: decode_events builds its messages from rooms
    from .decode_events import DecodeEffect, Reservation, Resolved

H = HandoffState


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
    aux: KvDone | None = None  # the prefill's KvDone (DONE)
    reason: str = ""  # why it failed (ABORTING, FAILED)
    cause: FailureCause = FailureCause.INTERNAL
    stages: dict[str, float] = field(default_factory=dict)  # Stage value -> time.time()
    queued_at: float | None = None  # RESERVING: when it first found no pages (the admission queue)
    refused: str = ""  # why admission refused it ("queue_full" or "timeout"): a 429, not an error
    reported: bool = False  # QUARANTINED: its client has been told (a DecodeReport with `held`)
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

    def move(self, to: DecodeState, now: float) -> None:
        """Enter `to` at `now`: a move of DECODE_TRANSITIONS, else IllegalTransition."""
        if to not in DECODE_TRANSITIONS[self.state]:
            raise IllegalTransition(f"room {self.room} (decode): illegal move {self.state.value} -> {to.value}")
        self.state = to
        self.entered[to] = now

    def point_at(self, rank: int, endpoint: Endpoint) -> None:
        """The rank this room resolved to forwarded our KvReq to `rank` (KvMoved), which holds
        the room: later aborts go to that rank's `endpoint`. No-op before a resolution."""
        res = self.resolved
        if res is None or res.info is None:
            return
        info = dataclasses.replace(res.info, dp_rank=rank, endpoint=endpoint,
                                   rank_ip=str(endpoint.get("ip", res.info.rank_ip)),
                                   rank_port=int(endpoint.get("port", res.info.rank_port)))
        self.resolved = dataclasses.replace(res, rank=rank, info=info)


# ---- admission: the rooms waiting for pages ---------------------------------------------------
@dataclass(frozen=True)
class HandoffQueue:
    """Admission of handoffs waiting for KV pages: at most `max_queued` rooms wait (None: no
    bound; 0: a room that does not fit at once is refused), each at most `timeout` seconds
    (None: only the waiting deadline); `retry_after` is what a refusal tells the client."""

    max_queued: int | None = None
    timeout: float | None = None
    retry_after: int = 1
    tell_prefill_after: float = 0.5  # see Admission.tell_later


class Admission:
    """The admission queue of one decode machine: this tick's round (the RESERVING rooms not yet
    asked, in arrival order), the refusals so far, and the word refused rooms owe their prefill.
    It reads the machine's rooms and keeps their queue fields; only the machine moves them."""

    def __init__(self, queue: HandoffQueue, rooms: dict[int, DecodeRoom]):
        self.queue = queue
        self.rooms = rooms  # the machine's own dict
        self.refused: dict[str, int] = {"queue_full": 0, "timeout": 0}  # refusals since start, by why
        self._round: list[int] = []  # RESERVING rooms this tick's round has not asked yet, in order
        self._deferred: list[tuple[float, DecodeEffect]] = []  # (due, effect): refused rooms' word

    def queued(self) -> int:
        """Rooms in the admission queue (RESERVING, found no pages at least once)."""
        return sum(1 for r in self.rooms.values() if r.state is D.RESERVING and r.queued_at is not None)

    def full(self) -> bool:
        """A new room is refused before its resolution: rooms are queued, as many as the bound."""
        limit, waiting = self.queue.max_queued, self.queued()
        return limit is not None and waiting > 0 and waiting >= limit

    def due(self, now: float) -> list[DecodeEffect]:
        """The deferred effects whose time has come, each given once."""
        due = [e for t, e in self._deferred if t <= now]
        if due:
            self._deferred = [(t, e) for t, e in self._deferred if t > now]
        return due

    def start_round(self, rooms: list[int]) -> None:
        """A Tick: these RESERVING rooms, in arrival order, are asked for pages one at a time."""
        self._round = list(rooms)

    def ask_next(self) -> DecodeRoom | None:
        """The first room of this round that is still RESERVING, to ask pages for (None: round
        over)."""
        while self._round:
            r = self.rooms.get(self._round.pop(0))
            if r is not None and r.state is D.RESERVING:
                return r
        return None

    def stop_round(self) -> list[DecodeRoom]:
        """A room found no pages: the round ends here; the rooms it had not asked, in order."""
        behind = [self.rooms[n] for n in self._round if n in self.rooms]
        self._round = []
        return behind

    def verdict(self, r: DecodeRoom, now: float) -> str | None:
        """`r` found no pages this round: None when it joins (or stays in) the queue, else why it
        is refused: "queue_full" (the queue is at its bound) or "timeout" (it waited too long)."""
        q = self.queue
        if r.queued_at is None:
            if q.max_queued is not None and self.queued() >= q.max_queued:
                return "queue_full"
            r.queued_at = now
        elif q.timeout is not None and now - r.queued_at > q.timeout:
            return "timeout"
        return None

    def refuse(self, r: DecodeRoom, why: str) -> str:
        """Count the refusal of `r` and mark it refused (a 429, not an error); returns the why in
        words for its client."""
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
        return detail

    def tell_later(self, now: float, tell: DecodeEffect) -> None:
        """Carry out `tell` (a refused room's word to its prefill) `tell_prefill_after` from now,
        so that a router hears this decode's 429 and retries on another pair before the
        prefill's echo of it (a 5xx) arrives; a router cancels the prefill leg itself anyway."""
        self._deferred.append((now + self.queue.tell_prefill_after, tell))
