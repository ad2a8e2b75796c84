"""Decode side of the handoff: the driver of `decode_machine.DecodeHandoffs` for one decode worker.

Life of a room: accept() -> its prefill link resolves the prefill rank and endpoint (background)
-> reserve pages (the `reserve` function, called on the loop thread, each tick while the pool is
full) -> send kv_req to that prefill worker -> its kv_done arrives after the pages landed ->
poll() reports it finished. Any failure (resolution, send, kv_fail, heartbeat loss, deadline,
abort) finishes the room with a reason naming room, ranks and cause (and a FailureCause); the
caller then frees the room's pages, except for a room that `holds()` them: its prefill may still
write them (it was unheard, or never answered our kv_abort), so the caller answers the client at
once and frees the pages only when `released()` names the room (the machine's QUARANTINED
state). Each room also keeps the wall-clock times of its stages (core.timeline) for the front. A
room whose kv_req may have reached the prefill is only reported after the prefill answered our
kv_abort (or `abort_grace` passed, and its pages stay quarantined). A KvMoved (the rank we
addressed forwarded our KvReq) points the room at the holder's rank and endpoint. A PeerAlive
naming another instance of a prefill fails the rooms resolved against the old one (it restarted
and lost them); rooms still resolving are left to their resolution, which sees the new instance.

Every decision is the machine's (decode_machine.py and its parts); this driver only turns calls,
messages and events into the machine's steps, stamped with the monotonic time, and carries out
its effects. Everything about the prefill servers is the link's (link_api.PeerLink, in a worker
prefill_link.PrefillLink): the receiver hands it the Resolve, CancelResolve, Invalidate and GiveUp
effects, tells it which addresses have rooms in flight (watch/unwatch), and reads what it learns
(RankResolved, PeerGone, PeerAlive) from its own `inbox`, where its send jobs post KvReqSent too;
poll() steps them on the loop thread, so every state change happens there. Pages are reserved on
the loop thread too: a Reserve effect is answered by calling `reserve` and stepping its
PagesReserved right after the step that asked (a round trip through the machine, never a nested
step).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable

from ..core.errors import PDServeError
from ..transfer.base import Endpoint, TransferBackend, TransferError
from . import wire
from .decode_events import (
    Abort,
    DecodeAccept,
    DecodeEffect,
    DecodeReport,
    FromPrefill,
    KvReqSent,
    Log,
    Malformed,
    PagesReserved,
    Release,
    Reservation,
    Reserve,
    Resolved,
    SendAbort,
    SendKvReq,
)
from .decode_machine import DecodeHandoffs
from .decode_rooms import DecodeRoom, DecodeState, HandoffQueue
from .handoff import Event, HandoffDone, Tick
from .link_api import LINK_EFFECTS, Inbox, PeerLink
from .local_facts import LocalFacts

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReceiverLimits:
    """A receiver's deadlines and bounds: `waiting_timeout` per handoff state
    (PDSERVE_WAITING_TIMEOUT), `abort_grace` for the answer to a kv_abort, `quarantine` for the
    pages of a room whose prefill went unheard, the admission `queue`, and its send threads."""

    waiting_timeout: float = 300.0
    abort_grace: float = 5.0
    quarantine: float = 360.0
    queue: HandoffQueue = field(default_factory=HandoffQueue)
    send_threads: int = 2


class DecodeReceiver:
    """The handoffs of one decode worker (see the module docstring). `reserve(rid, prompt_len)`
    answers pages (a Reservation, or a list of pages), None while they do not fit, or raises
    PDServeError for a prompt that never will; `wake` makes the worker loop turn (any thread)."""

    def __init__(self, backend: TransferBackend, dp_rank: int, local: LocalFacts, *, link: PeerLink,
                 reserve: Callable[[str, int], Reservation | list[int] | None],
                 wake: Callable[[], None] = lambda: None, limits: ReceiverLimits = ReceiverLimits()):
        self.backend = backend
        self.dp_rank = dp_rank
        self.local = local  # page_size, kv_dtype, fingerprint, backend, layout, endpoint
        self.link = link
        self.reserve = reserve
        self.machine = DecodeHandoffs(dp_rank, local, waiting_timeout=limits.waiting_timeout,
                                      abort_grace=limits.abort_grace, quarantine=limits.quarantine,
                                      queue=limits.queue)
        self.inbox = Inbox(wake)  # events from other threads: the link's, and the send jobs'
        link.bind(self.inbox)
        self.pool = ThreadPoolExecutor(limits.send_threads, thread_name_prefix=f"kv-recv-{dp_rank}")
        self._finished: list[HandoffDone[wire.KvDone]] = []  # reported by the machine, returned by poll()
        self._held: set[int] = set()  # rooms reported whose pages stay held (quarantined)
        self._released: list[int] = []  # held rooms whose pages may go now, returned by released()

    @property
    def rooms(self) -> dict[int, DecodeRoom]:
        return self.machine.rooms

    @property
    def waiting_timeout(self) -> float:
        return self.machine.waiting_timeout

    @waiting_timeout.setter
    def waiting_timeout(self, value: float) -> None:
        self.machine.waiting_timeout = value

    @property
    def abort_grace(self) -> float:
        return self.machine.abort_grace

    @abort_grace.setter
    def abort_grace(self, value: float) -> None:
        self.machine.abort_grace = value

    # ---- events in (loop thread) -----------------------------------------------------------
    def accept(self, room: int, rid: str, addr: str, prompt_len: int, hint: int | None) -> None:
        self.link.watch(addr)  # until the room's pages are free: unwatched at its report or release
        self._step(DecodeAccept(room, rid, addr, prompt_len, hint, now=time.monotonic()))

    def on_message(self, sender: Endpoint, raw: dict[str, Any]) -> None:
        if not isinstance(raw, dict) or raw.get("room") not in self.rooms:
            return
        now = time.monotonic()
        try:
            msg = wire.from_wire(raw)
        except wire.BadMessage as e:
            return self._step(Malformed(raw["room"], raw.get("t"), str(e), now=now))
        self._step(FromPrefill(msg, now=now))

    def abort(self, room: int, reason: str) -> None:
        self._step(Abort(room, reason, now=time.monotonic()))

    # ---- progress (loop thread) ------------------------------------------------------------
    def poll(self, now: float | None = None) -> list[HandoffDone[wire.KvDone]]:
        for ev in self.inbox.drain():
            self._step(dataclasses.replace(ev, now=time.monotonic()))
        now = time.monotonic() if now is None else now
        self._step(Tick(now=now))
        out, self._finished = self._finished, []
        return out

    def _step(self, ev: Event) -> None:
        """Step `ev` and carry out its effects. A Reserve is a synchronous round trip: its answer
        (PagesReserved) is stepped next, once the effects of the step that asked are all done."""
        todo = [ev]
        while todo:
            ev = todo.pop(0)
            for e in self.machine.step(ev):
                if isinstance(e, Reserve):
                    todo.append(self._reserve(e, ev.now))
                else:
                    self._apply(e)

    def _apply(self, e: DecodeEffect) -> None:
        if isinstance(e, LINK_EFFECTS):
            self.link.execute(e)
        elif isinstance(e, SendKvReq):
            self.pool.submit(self._send_req, e.room, e.resolved, e.req)
        elif isinstance(e, SendAbort):
            self._submit(self._quiet_send, e.peer, e.msg)
        elif isinstance(e, Log):
            log.log(e.level, "%s", e.message, extra={"room": e.room})
        elif isinstance(e, DecodeReport):
            self._finished.append(e.done)
            if e.held:  # still watched: the heartbeat's word on its prefill can release it
                self._held.add(e.done.room)
            else:
                self.link.unwatch(e.addr)
        elif isinstance(e, Release):
            log.info("decode dp_rank %d: room %d: pages out of quarantine", self.dp_rank, e.room,
                     extra={"room": e.room})
            self._held.discard(e.room)
            self._released.append(e.room)
            self.link.unwatch(e.addr)
        else:  # pragma: no cover - a new effect without a handler here
            raise TypeError(f"unknown effect {e!r}")

    def _reserve(self, e: Reserve, now: float) -> PagesReserved:
        """The machine asked for pages: the reserve function's answer, with the time of the step
        that asked (the function raises PDServeError for a prompt the pool can never hold)."""
        try:
            got = self.reserve(e.rid, e.prompt_len)
        except PDServeError as err:
            return PagesReserved(e.room, error=err.message, now=now, wall=time.time())
        if got is not None and not isinstance(got, Reservation):
            got = Reservation(got)
        return PagesReserved(e.room, got=got, now=now, wall=time.time())

    def _submit(self, fn: Callable[..., Any], *args: Any) -> None:
        try:
            self.pool.submit(fn, *args)
        except RuntimeError:  # closed
            pass

    @staticmethod
    def _peer(res: Resolved) -> Endpoint:
        """The prefill rank's transfer endpoint descriptor."""
        assert res.info is not None
        return res.info.peer()

    def _send_req(self, room: int, res: Resolved, req: wire.KvReq) -> None:
        """Runs on a pool thread; reports a "sent" event exactly once."""
        sent_at = time.time()  # before the send: the prefill cannot see the kv_req earlier
        try:
            self.backend.send(self._peer(res), wire.to_wire(req))
            err = None
        except Exception as e:  # noqa: BLE001 - any failure must still finish the room
            if not isinstance(e, (TransferError, OSError)):
                log.exception("decode dp_rank %d: sending kv_req of room %d crashed", self.dp_rank, room,
                              extra={"room": room})
            err = f"room {room}: sending metadata to prefill {res.addr} dp_rank {res.rank} failed: {e}"
        self.inbox.post(KvReqSent(room, sent_at, err))

    def _quiet_send(self, peer: Endpoint, msg: wire.KvAbort) -> None:
        try:
            self.backend.send(peer, wire.to_wire(msg))
        except (TransferError, OSError) as e:
            log.info("decode dp_rank %d: could not tell prefill about room %s: %s",
                     self.dp_rank, msg.room, e, extra={"room": msg.room})

    def holds(self, room: int) -> bool:
        """Room `room` was reported but its pages stay held until released() names it."""
        return room in self._held

    def released(self) -> list[int]:
        """The rooms reported `holds()` whose pages may be freed now (since the last call)."""
        out, self._released = self._released, []
        return out

    # ---- counters ----------------------------------------------------------------------------
    def inflight(self) -> int:
        return len(self.rooms)

    def with_pages(self) -> set[int]:
        """Rooms holding reserved pages while they wait for (or just got) their KV, quarantined
        ones included."""
        return {room for room, r in self.rooms.items() if r.reservation is not None}

    def preallocated(self) -> int:
        return len(self.with_pages())

    def states(self) -> dict[str, int]:
        """Rooms by handoff state; quarantined ones (failed, pages held) count apart."""
        return dict(Counter(r.state.value if r.state is DecodeState.QUARANTINED else r.state.phase.value
                            for r in self.rooms.values()))

    def stats(self) -> dict[str, Any]:
        """What server_info shows of the handoffs (a decode worker's stats)."""
        m = self.machine
        return {"preallocated_requests": self.preallocated(), "handoff_states": self.states(),
                "queued_handoffs": m.queued(), "quarantined_handoffs": m.quarantined(),
                "admission": {"queued_handoffs": m.queued(), "refused_handoffs": dict(m.refused),
                              "max_queued_handoffs": m.queue.max_queued,
                              "handoff_queue_timeout": m.queue.timeout}}

    def close(self, wait: bool = False) -> None:
        """Stop the send threads; `wait` joins them (the link is its owner's to close)."""
        self.pool.shutdown(wait=wait, cancel_futures=True)
