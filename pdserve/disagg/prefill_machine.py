"""The prefill side of the handoff as a pure machine: `PrefillHandoffs.step(event) -> effects`.

No threads, no I/O, no clock (handoff): kv_sender.PrefillSender is the driver that feeds
it from the worker loop and carries out its effects; tests step it by hand
(test_prefill_machine.py). Its parts, one job each: prefill_events (the events and effects, and
what a room tells its decode and, once over, its caller), prefill_rooms (a room's states, the
transition table and what each move means), prefill_notes (what this rank remembers about rooms
it has no request for, and what a KvReq must pass).

A KvReq for a room whose request is not here yet waits as an early note; one for a room homed
here that the front sent to another rank is forwarded there (the decode hears KvMoved), and a
KvAbort follows it. A failed room is remembered as doomed, so a late request or KvReq for it
fails at once. A KvReq that does not parse (wire.BadMessage) but names its room and endpoint is
refused like an incompatible one. Tick applies the bootstrap deadline, reports finished rooms
and expires notes.
"""

from __future__ import annotations

from typing import cast

import msgspec

from ..core.failures import FailureCause, rejection_cause
from ..core.timeline import Stage
from ..transfer.base import Endpoint, peer_name
from . import wire
from .handoff import Event, HandoffDone, HandoffMachine, HandoffState, IllegalTransition, Tick
from .local_facts import LocalFacts
from .prefill_events import (
    Drop,
    Fail,
    FromDecode,
    Malformed,
    MarkFailed,
    PrefillAccept,
    PrefillDone,
    PrefillEffect,
    PrefillFacts,
    PrefillReport,
    RoomRouted,
    Send,
    StartWrite,
    WriteReturned,
    kv_done,
    kv_fail,
    room_report,
)
from .prefill_notes import Doomed, Dropped, Early, Forwarded, RoomNotes, Route, kv_req_problem, prompt_problem
from .prefill_rooms import PrefillRoom, RoomState

H, R = HandoffState, RoomState


class PrefillHandoffs(HandoffMachine[PrefillEffect]):
    """Every room of one prefill DP rank. `local` is what this rank is (a KvReq must agree
    with its backend, page size, KV dtype and fingerprint); `instance_id` is this server's bootstrap instance
    ("" = not checked)."""

    SIDE = "prefill"

    def __init__(self, dp_rank: int, local: LocalFacts, *, bootstrap_timeout: float, failed_ttl: float = 600.0,
                 instance_id: str = ""):
        self.dp_rank = dp_rank
        self.local = local
        self.bootstrap_timeout = bootstrap_timeout
        self.failed_ttl = failed_ttl
        self.instance_id = instance_id
        self.rooms: dict[int, PrefillRoom] = {}
        self.notes = RoomNotes()

    # ---- a room's failure and its write ---------------------------------------------------------
    def _fail(self, r: PrefillRoom, reason: str, cause: FailureCause, now: float, out: list[PrefillEffect],
              peer: Endpoint | None = None) -> None:
        """Fail a live room (a failed one keeps its first reason, a succeeded one raises); `peer`
        is the decode's endpoint if it just spoke. A write that is out keeps the pages, and the
        decode waits for it."""
        if r.state.handoff is H.FAILED:
            return
        if r.peer is None:
            r.peer = peer
        if r.state is R.TRANSFERRING:
            r.move(R.FAILING, now, reason, cause)
        elif r.peer is None:
            r.move(R.FAILED_UNHEARD, now, reason, cause)
        else:
            r.move(R.FAILED, now, reason, cause)
            self._tell_failed(r, out)

    def _drop(self, r: PrefillRoom, reason: str, now: float) -> None:
        r.move(R.DROPPED_UNHEARD, now, f"room {r.room}: dropped: {reason}", FailureCause.ABORTED)

    def _tell_failed(self, r: PrefillRoom, out: list[PrefillEffect]) -> None:
        out.append(Send(cast(Endpoint, r.peer), kv_fail(r.room, self.dp_rank, r.reason, r.cause)))

    def _attach(self, r: PrefillRoom, req: wire.KvReq, ev: Event, out: list[PrefillEffect]) -> None:
        """The decode's KvReq meets its room: checked against the prompt, then the write starts
        if the prefill is done, else the room waits for it."""
        reason = prompt_problem(r, req, self.local.page_size)
        if reason is not None:
            return self._fail(r, reason, FailureCause.INCOMPATIBLE, ev.now, out, peer=req.endpoint)
        r.peer, r.req = req.endpoint, req
        r.stages[Stage.METADATA_RECEIVED.value] = ev.wall
        if r.state is R.PREFILLED:
            self._start_write(r, ev.now, out)
        else:
            r.move(R.WAITING_FOR_INPUT, ev.now)

    def _start_write(self, r: PrefillRoom, now: float, out: list[PrefillEffect]) -> None:
        req = cast(wire.KvReq, r.req)
        try:
            done = kv_done(r, self.dp_rank)
        except TypeError as e:  # the engine's facts lack the first token: nothing to hand over
            return self._fail(r, self._write_failed(r, str(e)), FailureCause.TRANSFER, now, out)
        r.move(R.TRANSFERRING, now)
        src = cast(list[int], r.pages)[req.reused_pages:][:len(req.dst_pages)]  # the decode holds the reused ones
        out.append(StartWrite(r.room, cast(Endpoint, r.peer), req.layout, src, list(req.dst_pages), done))

    def _write_failed(self, r: PrefillRoom, error: str) -> str:
        return (f"room {r.room}: KV transfer from prefill dp_rank {self.dp_rank} to decode "
                f"{peer_name(cast(Endpoint, r.peer))} failed: {error}")

    # ---- rooms with no request here ---------------------------------------------------------------
    def _doom(self, room: int, reason: str, cause: FailureCause, now: float, out: list[PrefillEffect]) -> None:
        """Remember that `room` cannot succeed here; tell a decode whose KvReq is queued."""
        self.notes.doomed[room] = Doomed(reason, now, cause)
        if room in self.notes.early:
            self._refuse(self.notes.early.pop(room).peer, room, reason, cause, now, out)

    def _refuse(self, peer: Endpoint, room: int, reason: str, cause: FailureCause, now: float,
                out: list[PrefillEffect]) -> None:
        """Doom a room that has no request here and answer its decode with KvFail."""
        self.notes.doomed[room] = Doomed(reason, now, cause)
        out.append(Send(peer, kv_fail(room, self.dp_rank, reason, cause)))

    def _forward(self, req: wire.KvReq, route: Route, now: float, out: list[PrefillEffect]) -> None:
        """Pass the decode's KvReq to the holder, then tell the decode where it went (KvMoved); if
        the holder cannot be reached the decode hears KvFail from here."""
        room = req.room
        self.notes.forwarded[room] = Forwarded(route.endpoint, now)
        why = (f"room {room}: prefill dp_rank {self.dp_rank} could not forward the KV request to "
               f"dp_rank {route.rank} that holds the room")
        out.append(Send(
            route.endpoint, msgspec.structs.replace(req, forwarded_by=self.dp_rank),
            on_sent=Send(req.endpoint, wire.KvMoved(room=room, prefill_rank=route.rank, endpoint=route.endpoint)),
            on_error=Send(req.endpoint, kv_fail(room, self.dp_rank, why, FailureCause.TRANSFER))))

    # ---- events -----------------------------------------------------------------------------------
    def _on_accept(self, ev: PrefillAccept, out: list[PrefillEffect]) -> None:
        room, notes = ev.room, self.notes
        if room in self.rooms:
            raise ValueError(f"room {room} is already in progress on prefill dp_rank {self.dp_rank}")
        r = PrefillRoom(room, ev.rid, ev.prompt_len, ev.prompt_ids, entered={R.BOOTSTRAPPING: ev.now})
        self.rooms[room] = r
        if room in notes.dropped:
            self._drop(r, notes.dropped.pop(room).reason, ev.now)
        elif room in notes.doomed:
            self._fail(r, notes.doomed[room].reason, notes.doomed[room].cause, ev.now, out)
        elif room in notes.early:
            self._attach(r, notes.early.pop(room).req, ev, out)

    def _on_prefill_done(self, ev: PrefillDone, out: list[PrefillEffect]) -> None:
        r = self.rooms.get(ev.room)
        if r is None:
            return
        r.pages, r.aux = ev.pages, ev.aux  # recorded in any state: the pages are held until reported
        r.stages[Stage.PREFILL_DONE.value] = ev.wall
        if r.state is R.BOOTSTRAPPING:
            r.move(R.PREFILLED, ev.now)
        elif r.state is R.WAITING_FOR_INPUT:
            self._start_write(r, ev.now, out)

    def _on_fail(self, ev: Fail, out: list[PrefillEffect]) -> None:
        r = self.rooms.get(ev.room)
        if r is not None and r.state.live:
            self._fail(r, ev.reason, ev.cause, ev.now, out)

    def _on_mark_failed(self, ev: MarkFailed, out: list[PrefillEffect]) -> None:
        """The front failed the room (rejected it, or its decode gave it up): it ends here if in
        progress, and a KvReq for it (queued or later) is answered with the reason."""
        cause = rejection_cause(ev.reason)
        r = self.rooms.get(ev.room)
        if r is not None and r.state.live:
            self._fail(r, ev.reason, cause, ev.now, out)
        self._doom(ev.room, ev.reason, cause, ev.now, out)

    def _on_drop(self, ev: Drop, out: list[PrefillEffect]) -> None:
        """The room's decode prefilled it itself: end it with no transfer, now or when its request
        arrives. A room whose KvReq already came is being served and is left alone."""
        r = self.rooms.get(ev.room)
        if r is None:
            self.notes.dropped[ev.room] = Dropped(ev.reason, ev.now)
        elif r.state in (R.BOOTSTRAPPING, R.PREFILLED):
            self._drop(r, ev.reason, ev.now)

    def _on_room_routed(self, ev: RoomRouted, out: list[PrefillEffect]) -> None:
        """The front sent `room` (homed here) to `rank`: a KvReq for it here goes on there."""
        room, notes = ev.room, self.notes
        route = notes.routes[room] = Route(ev.rank, ev.endpoint, ev.now)
        if room in notes.early and room not in self.rooms:
            self._forward(notes.early.pop(room).req, route, ev.now, out)
        elif room in notes.doomed:  # its decode gave up here already: the holder must free it too
            out.append(Send(ev.endpoint, wire.KvAbort(room=room, reason=notes.doomed[room].reason)))

    def _on_message(self, ev: FromDecode, out: list[PrefillEffect]) -> None:
        if isinstance(ev.msg, wire.KvReq):
            self._on_kv_req(ev.msg, ev, out)
        elif isinstance(ev.msg, wire.KvAbort):
            self._on_kv_abort(ev.msg, ev, out)

    def _on_kv_req(self, msg: wire.KvReq, ev: FromDecode, out: list[PrefillEffect]) -> None:
        room, peer, notes = msg.room, msg.endpoint, self.notes
        r = self.rooms.get(room)
        if r is not None and r.state not in (R.BOOTSTRAPPING, R.PREFILLED):
            return self._answer_late(r, peer, ev.now, out)
        if r is None and room in notes.routes and msg.forwarded_by is None:
            return self._forward(msg, notes.routes[room], ev.now, out)
        problem, cause = kv_req_problem(msg, self.local, self.dp_rank, self.instance_id, notes.doomed)
        if problem is not None:
            if r is None:
                notes.early.pop(room, None)
                self._refuse(peer, room, problem, cause, ev.now, out)
            else:
                self._fail(r, problem, cause, ev.now, out, peer=peer)
        elif r is None:
            notes.early[room] = Early(peer, msg, ev.now)
        else:
            self._attach(r, msg, ev, out)

    def _on_malformed(self, ev: Malformed, out: list[PrefillEffect]) -> None:
        """A KvReq that did not parse but names its room and endpoint is refused like an
        incompatible one (the holder of a room routed elsewhere is told too); the rest was logged."""
        room, peer = ev.room, ev.endpoint
        if ev.kind != wire.KV_REQ or room is None or peer is None:
            return
        r, doomed = self.rooms.get(room), self.notes.doomed.get(room)
        if r is not None and r.state not in (R.BOOTSTRAPPING, R.PREFILLED):
            return self._answer_late(r, peer, ev.now, out)
        reason, cause = (doomed.reason, doomed.cause) if doomed else (
            f"room {room}: prefill dp_rank {self.dp_rank} cannot read the decode's kv_req: {ev.error}",
            FailureCause.INCOMPATIBLE)
        if r is not None:
            return self._fail(r, reason, cause, ev.now, out, peer=peer)
        self.notes.early.pop(room, None)
        route = self.notes.routes.get(room)
        if route is not None and doomed is None:
            out.append(Send(route.endpoint, wire.KvAbort(room=room, reason=reason)))
        self._refuse(peer, room, reason, cause, ev.now, out)

    def _answer_late(self, r: PrefillRoom, peer: Endpoint, now: float, out: list[PrefillEffect]) -> None:
        """A KvReq for a room past waiting for one: a room that ended before its decode spoke
        answers it now; else it is a duplicate (the room has its decode) and is dropped."""
        if r.state.unheard:
            r.peer = peer
            r.move(r.state.heard, now)
            self._tell_failed(r, out)

    def _on_kv_abort(self, msg: wire.KvAbort, ev: FromDecode, out: list[PrefillEffect]) -> None:
        """Fail the room and always answer (KvDone or KvFail): the decode keeps its pages until
        it knows no write of ours can still land in them."""
        room = msg.room
        sender = msg.endpoint or ev.sender  # a forwarded abort comes from the home rank
        reason = f"room {room}: decode dp_rank {msg.decode_rank} aborted it: {msg.reason}"
        r = self.rooms.get(room)
        if r is None:
            holder = self.notes.holder(room)
            if holder is not None:  # the holder answers the decode
                out.append(Send(holder, msgspec.structs.replace(msg, endpoint=sender)))
                return
            early = self.notes.early.pop(room, None)
            self._refuse(early.peer if early else sender, room, reason, FailureCause.ABORTED, ev.now, out)
        elif r.state.live:
            self._fail(r, reason, FailureCause.ABORTED, ev.now, out, peer=sender)
        elif r.state.finished:  # ended, not yet reported: answer again
            out.append(Send(sender if r.state.unheard else cast(Endpoint, r.peer),
                            kv_fail(room, self.dp_rank, r.reason or reason, r.cause)))
        # FAILING: the decode is answered when the write returns

    def _on_write_returned(self, ev: WriteReturned, out: list[PrefillEffect]) -> None:
        r = self.rooms.get(ev.room)
        if r is None:
            return
        if not r.state.writing:
            raise IllegalTransition(f"room {r.room} (prefill): a page write returned in state "
                                    f"{r.state.value}, which has none out")
        r.write = ev.write
        if ev.error is None:  # its KvDone went out: the decode has its answer even if we failed meanwhile
            r.move(R.SUCCESS if r.state is R.TRANSFERRING else R.FAILED, ev.now)
            return
        if r.state is R.TRANSFERRING:
            r.move(R.FAILED, ev.now, self._write_failed(r, ev.error), FailureCause.TRANSFER)
        else:
            r.move(R.FAILED, ev.now)  # keeps the earlier reason (abort, timeout)
        self._tell_failed(r, out)

    def _on_tick(self, ev: Tick, out: list[PrefillEffect]) -> None:
        now = ev.now
        for r in list(self.rooms.values()):
            if r.state.live and now - r.created > self.bootstrap_timeout:
                self._fail(r, f"room {r.room}: prefill dp_rank {self.dp_rank} waited "
                              f"{self.bootstrap_timeout:g}s for {r.state.waiting_for} "
                              f"(PDSERVE_BOOTSTRAP_TIMEOUT)", FailureCause.TIMEOUT, now, out)
            if r.state.finished:
                del self.rooms[r.room]
                if r.state.handoff is H.FAILED and not r.state.dropped:  # a late KvReq is answered at once
                    self.notes.doomed[r.room] = Doomed(r.reason, now, r.cause)
                out.append(PrefillReport(self._report(r)))
        for room in self.notes.overdue(now, self.bootstrap_timeout):
            self._doom(room, f"room {room}: prefill dp_rank {self.dp_rank} never received its "
                             f"request within {self.bootstrap_timeout:g}s (PDSERVE_BOOTSTRAP_TIMEOUT)",
                       FailureCause.TIMEOUT, now, out)
        self.notes.expire(now, self.bootstrap_timeout, self.failed_ttl)

    def _report(self, r: PrefillRoom) -> HandoffDone[PrefillFacts]:
        return room_report(r, self.dp_rank)

    HANDLERS = {PrefillAccept: _on_accept, PrefillDone: _on_prefill_done, FromDecode: _on_message,
                Malformed: _on_malformed, Fail: _on_fail,
                MarkFailed: _on_mark_failed, Drop: _on_drop, RoomRouted: _on_room_routed,
                WriteReturned: _on_write_returned, Tick: _on_tick}
