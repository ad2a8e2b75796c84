"""The decode side of the handoff as a pure machine: `DecodeHandoffs.step(event) -> effects`.

No threads, no I/O, no clock (handoff): kv_receiver.DecodeReceiver is the driver that
feeds it from the worker loop and carries out its effects; tests step it by hand
(test_decode_machine.py). Its parts, one job each: decode_events (the events and effects, the
answers to Resolve and Reserve, and what a room tells its prefill and, once over, its caller),
decode_rooms (a room's states, the transition table and what each move means, and the
admission queue of rooms waiting for pages). The pages are the caller's: freed at a room's
DecodeReport, or for a quarantined room at its Release.

A Tick checks every room that is not RESERVING: the deadline of a live room (`waiting_timeout`
per handoff state: Bootstrapping = RESOLVING..SENDING, from the accept; WaitingForInput =
WAITING, from the send), the grace of an aborting one, the report or the deadline of a
quarantined one, then the report (or Release) of a finished one. The RESERVING rooms are asked
for pages in admission order (decode_rooms.Admission), each finishing its tick after its answer.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import cast

from ..core.failures import FailureCause
from ..core.timeline import Stage
from . import wire
from .decode_events import (
    Abort,
    CancelResolve,
    DecodeAccept,
    DecodeEffect,
    DecodeReport,
    FromPrefill,
    GiveUp,
    Invalidate,
    KvReqSent,
    Log,
    Malformed,
    PagesReserved,
    PeerAlive,
    PeerGone,
    RankResolved,
    Release,
    Reserve,
    Resolve,
    Resolved,
    SendAbort,
    SendKvReq,
    kv_abort,
    kv_req,
    room_report,
)
from .decode_rooms import Admission, DecodeRoom, DecodeState, HandoffQueue
from .handoff import HandoffDone, HandoffMachine, Tick, write_stages
from .local_facts import LocalFacts

D = DecodeState


class DecodeHandoffs(HandoffMachine[DecodeEffect]):
    """Every handoff of one decode DP worker. `local`: what this worker is (its
    backend, endpoint, layout, page size, KV dtype, model fingerprint)."""

    SIDE = "decode"

    def __init__(self, dp_rank: int, local: LocalFacts, *, waiting_timeout: float, abort_grace: float = 5.0,
                 quarantine: float = 360.0, queue: HandoffQueue | None = None):
        self.dp_rank = dp_rank
        self.local = local
        self.waiting_timeout = waiting_timeout  # per handoff state
        self.abort_grace = abort_grace  # how long a client waits for the answer to our kv_abort
        self.quarantine = quarantine  # how long pages an unheard prefill may still write stay held
        # (360: what worker/decode.py derives from the default envs, 300 s bootstrap + 60 s io)
        self.rooms: dict[int, DecodeRoom] = {}
        self.admission = Admission(queue or HandoffQueue(), self.rooms)

    @property
    def queue(self) -> HandoffQueue:
        return self.admission.queue

    @property
    def refused(self) -> dict[str, int]:
        """Refusals since start, by why ("queue_full", "timeout")."""
        return self.admission.refused

    def queued(self) -> int:
        """Rooms in the admission queue (RESERVING, found no pages at least once)."""
        return self.admission.queued()

    def quarantined(self) -> int:
        """Rooms whose pages are held after their client was told (QUARANTINED)."""
        return sum(1 for r in self.rooms.values() if r.state is D.QUARANTINED)

    # ---- events ---------------------------------------------------------------------------
    def _accept(self, ev: DecodeAccept, out: list[DecodeEffect]) -> None:
        r = self.rooms[ev.room] = DecodeRoom(ev.room, ev.rid, ev.addr, ev.prompt_len,
                                             entered={D.RESOLVING: ev.now})
        if self.admission.full():
            return self._refuse(r, "queue_full", ev.now, out)
        out.append(Resolve(ev.addr, ev.room, ev.hint))

    def _resolved(self, ev: RankResolved, out: list[DecodeEffect]) -> None:
        res = ev.result
        r = self.rooms.get(res.room)
        if r is None or r.state is not D.RESOLVING:
            return
        if res.error is not None:
            return self._fail(r, res.error, res.cause, ev.now, out, tell_prefill=False)
        ours = self.local.backend
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
        r.move(D.RESERVING, ev.now)

    def _reserved(self, ev: PagesReserved, out: list[DecodeEffect]) -> None:
        r = self.rooms.get(ev.room)
        if r is None or r.state is not D.RESERVING:
            return
        if ev.error is not None:
            self._fail(r, f"room {r.room}: decode dp_rank {self.dp_rank} cannot reserve pages: {ev.error}",
                       FailureCause.NO_PAGES, ev.now, out)
        elif ev.got is not None:
            r.reservation = ev.got
            r.stages[Stage.PREALLOCATION.value] = ev.wall
            # when it was issued; the send job's KvReqSent refines it, unless kv_done and the report beat it
            r.stages[Stage.METADATA_SENT.value] = ev.wall
            r.move(D.SENDING, ev.now)
            out.append(SendKvReq(r.room, cast(Resolved, r.resolved), kv_req(r, self.dp_rank, self.local)))
        else:  # no pages: it waits, and so does every room behind it, this round
            for q in [r, *self.admission.stop_round()]:
                why = self.admission.verdict(q, ev.now) if q.state is D.RESERVING else None
                if why is not None:
                    self._refuse(q, why, ev.now, out)
                self._tick_room(q, ev.now, out)  # the rest of its tick
            return
        self._tick_room(r, ev.now, out)  # the rest of this room's tick
        self._ask_next(out)  # it no longer holds the queue up

    def _sent(self, ev: KvReqSent, out: list[DecodeEffect]) -> None:
        r = self.rooms.get(ev.room)
        if r is None:
            return
        r.stages[Stage.METADATA_SENT.value] = ev.sent_at
        if r.state.holding and ev.error is not None:  # the kv_req never left: nothing can land
            return r.move(D.FAILED, ev.now)
        if not r.state.live:
            return
        if ev.error is not None:
            out.append(Invalidate(r.addr))  # the cached endpoint may be stale: the next room looks it up afresh
            self._fail(r, ev.error, FailureCause.TRANSFER, ev.now, out, tell_prefill=False)
        elif r.state is D.SENDING:
            r.move(D.WAITING, ev.now)

    def _received(self, ev: FromPrefill, out: list[DecodeEffect]) -> None:
        msg = ev.msg
        r = self.rooms.get(msg.room)
        if r is None:
            return
        if isinstance(msg, wire.KvMoved):
            if r.state.live:  # our KvReq was forwarded to the holder: aborts go there now
                r.point_at(msg.prefill_rank, msg.endpoint)
            return
        if not isinstance(msg, (wire.KvDone, wire.KvFail)):
            return
        if not r.state.live:
            if r.state.holding:  # the prefill answered (our kv_abort): no write can follow
                r.move(D.FAILED, ev.now)
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
            r.aux = msg
            r.stages.update(write_stages(msg.write))
            if r.state is D.SENDING:  # kv_done overtook our own "sent" event
                r.move(D.WAITING, ev.now)
            r.move(D.DONE, ev.now)

    def _malformed(self, ev: Malformed, out: list[DecodeEffect]) -> None:
        r = self.rooms.get(ev.room)
        if r is None:
            return
        if r.state.live and ev.kind == wire.KV_DONE:
            self._fail(r, f"room {r.room}: prefill {r.addr} sent a bad kv_done: {ev.error}",
                       FailureCause.TRANSFER, ev.now, out, tell_prefill=False)
        else:
            out.append(Log(logging.WARNING, f"decode dp_rank {self.dp_rank}: {ev.error}; ignored", r.room))

    def _gone(self, ev: PeerGone, out: list[DecodeEffect]) -> None:
        """Missed heartbeats (no `ranks`) do not prove the prefill stopped: a room it may write
        is failed but quarantined. Gone ranks do: their workers died, as their front tells."""
        ended = ev.ranks is not None
        for r in list(self.rooms.values()):
            res = r.resolved
            if r.addr != ev.addr or (ev.ranks is not None and (res is None or res.rank not in ev.ranks)):
                continue
            if r.state.holding:
                if ended:  # no process that had our kv_req is left
                    r.move(D.FAILED, ev.now)
                elif r.state is D.ABORTING:
                    r.move(D.QUARANTINED, ev.now)
                else:
                    r.abort_sent = False  # it may have been lost: the next PeerAlive sends another
            elif r.state.live:
                where = f" (prefill dp_rank {res.rank})" if res is not None else ""
                self._fail(r, f"room {r.room}{where}: {ev.reason}", FailureCause.PEER_GONE, ev.now, out,
                           tell_prefill=False, hold=not ended)

    def _alive(self, ev: PeerAlive, out: list[DecodeEffect]) -> None:
        """Rooms resolved against another instance of that prefill are lost (it restarted);
        rooms still resolving are left to their resolution, which sees the new instance. The
        same instance answering again asks it about each quarantined room (KvAbort)."""
        for r in list(self.rooms.values()):
            res = r.resolved
            if r.addr != ev.addr or res is None:
                continue
            if res.instance_id and res.instance_id != ev.instance:  # that instance writes nothing more
                if r.state.holding:
                    r.move(D.FAILED, ev.now)
                elif r.state.live:
                    self._fail(r, f"room {r.room} (prefill dp_rank {res.rank}): prefill server at {ev.addr} "
                                  f"restarted (instance {res.instance_id} -> {ev.instance}); its rooms are lost",
                               FailureCause.PEER_GONE, ev.now, out, tell_prefill=False)
            elif r.state is D.QUARANTINED and not r.abort_sent:
                r.abort_sent = True
                if res.info is not None:  # its answer ends the quarantine
                    out.append(self._send_abort(r))

    def _abort(self, ev: Abort, out: list[DecodeEffect]) -> None:
        r = self.rooms.get(ev.room)
        if r is not None and r.state.live:
            self._fail(r, ev.reason, FailureCause.ABORTED, ev.now, out)

    def _tick(self, ev: Tick, out: list[DecodeEffect]) -> None:
        out.extend(self.admission.due(ev.now))
        reserving = []
        for r in list(self.rooms.values()):
            if r.state is D.RESERVING:
                reserving.append(r.room)  # its PagesReserved runs the rest of its tick
            else:
                self._tick_room(r, ev.now, out)
        self.admission.start_round(reserving)
        self._ask_next(out)

    def _ask_next(self, out: list[DecodeEffect]) -> None:
        """Ask for pages for the next room of this tick's admission round, if any is left."""
        r = self.admission.ask_next()
        if r is not None:
            out.append(Reserve(r.room, r.rid, r.prompt_len))

    def _refuse(self, r: DecodeRoom, why: str, now: float, out: list[DecodeEffect]) -> None:
        """Admission turns `r` away (back-pressure, not an error of the room). It holds no pages,
        so it is reported at once; its prefill is told later (Admission.tell_later): kv_abort,
        or /fail_room before a resolution."""
        detail = self.admission.refuse(r, why)
        self._fail(r, f"room {r.room}: decode dp_rank {self.dp_rank} cannot take it now: {detail}; "
                      f"retry after {self.queue.retry_after}s or on another decode", FailureCause.NO_PAGES,
                   now, out, tell_prefill=False)
        res = r.resolved
        tell = self._send_abort(r) if res is not None and res.info else GiveUp(r.addr, r.room, r.reason)
        self.admission.tell_later(now, tell)

    # ---- helpers --------------------------------------------------------------------------
    def _tick_room(self, r: DecodeRoom, now: float, out: list[DecodeEffect]) -> None:
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
            r.move(D.QUARANTINED, now)
        if r.state is D.QUARANTINED:
            if not r.reported:
                r.reported = True
                out.append(DecodeReport(self._report(r), r.addr, held=True))
            elif now - r.entered[D.QUARANTINED] > self.quarantine:
                rank = r.resolved.rank if r.resolved else None
                out.append(Log(logging.WARNING, f"decode dp_rank {self.dp_rank}: room {r.room} (prefill {r.addr} "
                                                f"dp_rank {rank}, {r.cause.value}: {r.reason}): no word from the "
                                                f"prefill in {self.quarantine:g}s of quarantine; its pages are "
                                                "released (PDSERVE_KV_QUARANTINE_TIMEOUT)", r.room))
                r.move(D.FAILED, now)
        if r.state.terminal:
            del self.rooms[r.room]
            out.append(Release(r.room, r.rid, r.addr) if r.reported else DecodeReport(self._report(r), r.addr))

    def _fail(self, r: DecodeRoom, reason: str, cause: FailureCause, now: float, out: list[DecodeEffect],
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
        r.move(to, now)

    def _send_abort(self, r: DecodeRoom) -> SendAbort:
        return kv_abort(r, self.dp_rank, self.local)

    def _report(self, r: DecodeRoom) -> HandoffDone[wire.KvDone]:
        return room_report(r, self.dp_rank, self.queue.retry_after)

    HANDLERS = {DecodeAccept: _accept, RankResolved: _resolved, PagesReserved: _reserved, KvReqSent: _sent,
                FromPrefill: _received, Malformed: _malformed, PeerGone: _gone, PeerAlive: _alive, Abort: _abort,
                Tick: _tick}
