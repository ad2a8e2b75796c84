"""Prefill side of the handoff: one PrefillRoom per room, driven by the worker loop.

Events in: accept() when the prefill request arrives, on_message() for the decode's KvReq /
KvAbort (wire.py), prefill_done() when the engine finished the prompt (its pages now hold the
KV), fail() on abort, mark_failed() for rooms the front rejected, room_routed() when the front
sent a room whose home is this rank (room % dp_size) to another rank. poll() returns finished
rooms.
Page writes and sends run on a background thread; every state change happens on the loop's
thread. A room's pages are returned (via poll) only once no write can still read them, and
the decode hears kv_fail only once no write can still land in its pages. Rooms doomed before
their request arrives (front rejected, decode aborted, incompatible kv_req) are remembered for
`failed_ttl`, so a late request or kv_req for them fails at once instead of timing out.
Every failure carries a FailureCause (also sent in KvFail); each room keeps the wall-clock
times of its stages (core.timeline) for the front.

Forwarding: a decode that cannot know which rank holds its room (a load-aware prefill method, or
FORCE routing) sends its KvReq to the room's home rank; the home forwards it, and any KvAbort
after it, to the holder, and tells the decode the holder's rank and endpoint (KvMoved). A KvReq
that names another bootstrap instance than this server's (the prefill restarted since the decode
resolved) is refused at once.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from ..core.failures import FailureCause, rejection_cause
from ..core.log_format import fields
from ..core.page_keys import prefix_key
from ..core.timeline import Stage, transfer_stages
from ..transfer.base import TransferBackend, TransferError, peer_name
from . import wire
from .handoff import Handoff, HandoffDone, HandoffState, Side

log = logging.getLogger(__name__)
S = HandoffState


@dataclass
class PrefillRoom:
    room: int
    rid: str
    prompt_len: int
    handoff: Handoff
    prompt_ids: list[int] | None = None  # to check a decode's reused prefix
    req: wire.KvReq | None = None  # the decode's
    peer: dict | None = None
    pages: list[int] | None = None  # set when the prefill finished
    aux: dict | None = None
    job_running: bool = False
    result: dict = field(default_factory=dict)  # bytes, timings of the write
    cause: FailureCause = FailureCause.INTERNAL  # set with the first failure
    stages: dict[str, float] = field(default_factory=dict)  # Stage value -> time.time()
    dropped: bool = False  # its decode prefilled it itself: ended without a transfer


_DONE_FIELDS = ("first_token", "first_logprob", "input_logprobs", "prompt_len", "cached_tokens")


def _done_fields(aux: dict) -> dict:
    """The KvDone fields of the engine's facts about a finished prefill."""
    return {k: aux[k] for k in _DONE_FIELDS if aux.get(k) is not None}


class Doomed(NamedTuple):
    """A room that cannot succeed here, remembered for `failed_ttl`."""

    reason: str
    since: float
    cause: FailureCause


class Route(NamedTuple):
    """Where the front sent a room whose home is this rank."""

    rank: int
    endpoint: dict
    since: float


class Forwarded(NamedTuple):
    """A KvReq this rank passed on to the holder; later aborts for the room follow it."""

    holder: dict
    since: float


class PrefillSender:
    def __init__(self, backend: TransferBackend, dp_rank: int, local: dict, *,
                 bootstrap_timeout: float, failed_ttl: float = 600.0, threads: int = 2,
                 wake=lambda: None, instance_id: str = ""):
        self.backend = backend
        self.dp_rank = dp_rank
        self.local = local  # page_size, kv_dtype, fingerprint, backend
        self.bootstrap_timeout = bootstrap_timeout
        self.failed_ttl = failed_ttl
        self.rooms: dict[int, PrefillRoom] = {}
        self.early: dict[int, tuple[dict, wire.KvReq, float]] = {}  # KvReq before the request
        self.failed: dict[int, Doomed] = {}
        self.routes: dict[int, Route] = {}  # rooms homed here that the front sent elsewhere
        self.forwarded: dict[int, Forwarded] = {}
        self.instance_id = instance_id  # this server's bootstrap instance ("" = do not check)
        self.dropped: dict[int, tuple[str, float]] = {}  # rooms dropped before their request came
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix=f"kv-send-{dp_rank}")
        self.jobs: queue.Queue = queue.Queue()
        self.done: list[HandoffDone] = []
        self.wake = wake  # called from job threads so the loop polls at once

    # ---- events ------------------------------------------------------------------------------
    def holds(self, room: int) -> bool:
        """`room` is in progress here (a second request for it must be refused)."""
        return room in self.rooms

    def accept(self, room: int, rid: str, prompt_len: int, prompt_ids: list[int] | None = None) -> None:
        """A prefill request for `room` arrived; ValueError if the room is already in progress.
        `prompt_ids` lets a decode reuse a prefix it holds (its key is checked against them)."""
        if room in self.rooms:
            raise ValueError(f"room {room} is already in progress on prefill dp_rank {self.dp_rank}")
        r = PrefillRoom(room, rid, prompt_len, Handoff(room, Side.PREFILL), prompt_ids)
        self.rooms[room] = r
        if room in self.dropped:
            self.drop(room, self.dropped.pop(room)[0])
        elif room in self.failed:
            self._fail(r, self.failed[room].reason, self.failed[room].cause)
        elif room in self.early:
            peer, req, _ = self.early.pop(room)
            self._attach(r, peer, req)

    def prefill_done(self, room: int, pages: list[int], aux: dict) -> None:
        r = self.rooms.get(room)
        if r is None:
            return
        r.pages, r.aux = pages, aux
        r.stages[Stage.PREFILL_DONE.value] = time.time()
        self._maybe_transfer(r)

    def fail(self, room: int, reason: str, cause: FailureCause = FailureCause.ABORTED) -> None:
        r = self.rooms.get(room)
        if r is not None and not r.handoff.done:
            self._fail(r, reason, cause)

    def drop(self, room: int, reason: str) -> None:
        """The room's decode prefilled it itself: end the room with no transfer (reported as
        dropped, not failed), now or when its request arrives. A room whose KvReq already came
        is being served and is left alone."""
        r = self.rooms.get(room)
        if r is None:
            self.dropped[room] = (reason, time.monotonic())
        elif r.handoff.state is S.BOOTSTRAPPING and not r.job_running:
            r.dropped = True
            self._fail(r, f"room {room}: dropped: {reason}", FailureCause.ABORTED)

    def mark_failed(self, room: int, reason: str) -> None:
        """The front failed `room` (rejected it, or its decode gave it up): the room ends here if
        it is in progress, and a kv_req for it (queued or later) is answered with `reason`."""
        cause = rejection_cause(reason)
        r = self.rooms.get(room)
        if r is not None and not r.handoff.done:
            self._fail(r, reason, cause)
        self._doom(room, reason, cause)

    def _doom(self, room: int, reason: str, cause: FailureCause) -> None:
        """Remember that `room` cannot succeed here; tell a decode whose kv_req is queued."""
        self.failed[room] = Doomed(reason, time.monotonic(), cause)
        if room in self.early:
            self._refuse(self.early.pop(room)[0], room, reason, cause)

    def _refuse(self, peer: dict, room: int, reason: str, cause: FailureCause) -> None:
        """Doom a room that has no request here and answer its decode with kv_fail."""
        self.failed[room] = Doomed(reason, time.monotonic(), cause)
        self._send_later(peer, self._kv_fail(room, reason, cause))

    def _kv_fail(self, room: int, reason: str, cause: FailureCause) -> dict:
        return wire.to_wire(wire.KvFail(room=room, prefill_rank=self.dp_rank, reason=reason,
                                        cause=cause.value))

    def on_message(self, sender: dict, raw: dict) -> None:
        try:
            msg = wire.from_wire(raw)
        except wire.BadMessage as e:
            log.warning("prefill dp_rank %d: %s from %s; ignored", self.dp_rank, e, peer_name(sender))
            return
        if isinstance(msg, wire.KvReq):
            self._on_kv_req(msg)
        elif isinstance(msg, wire.KvAbort):
            self._on_kv_abort(sender, msg)

    def room_routed(self, room: int, rank: int, endpoint: dict) -> None:
        """The front sent `room` (homed here) to `rank`: a KvReq for it here goes on there."""
        self.routes[room] = Route(rank, endpoint, time.monotonic())
        if room in self.early and room not in self.rooms:
            peer, req, _ = self.early.pop(room)
            self._forward(req, self.routes[room])
        elif room in self.failed:  # its decode gave up here already: the holder must free it too
            abort = wire.to_wire(wire.KvAbort(room=room, reason=self.failed[room].reason))
            self._submit(lambda: self._quiet_send(endpoint, abort), room)

    def _forward(self, req: wire.KvReq, route: Route) -> None:
        """Pass the decode's KvReq to the holder and tell the decode where it went (both on a
        pool thread); if the holder cannot be reached the decode hears KvFail from here."""
        room = req.room
        self.forwarded[room] = Forwarded(route.endpoint, time.monotonic())
        fwd = wire.to_wire(msgspec.structs.replace(req, forwarded_by=self.dp_rank))
        moved = wire.to_wire(wire.KvMoved(room=room, prefill_rank=route.rank, endpoint=route.endpoint))

        def job():
            try:
                self.backend.send(route.endpoint, fwd)
            except (TransferError, OSError) as e:
                why = (f"room {room}: prefill dp_rank {self.dp_rank} could not forward the KV "
                       f"request to dp_rank {route.rank} that holds the room: {e}")
                self._quiet_send(req.endpoint, self._kv_fail(room, why, FailureCause.TRANSFER))
                return
            self._quiet_send(req.endpoint, moved)
        self._submit(job, room)

    def _on_kv_req(self, msg: wire.KvReq) -> None:
        room, peer = msg.room, msg.endpoint
        r = self.rooms.get(room)
        if r is not None and r.handoff.state is not S.BOOTSTRAPPING:
            if r.handoff.state is S.FAILED and r.peer is None:  # failed before its decode spoke
                r.peer = peer
                if not r.job_running:
                    self._tell_failed(r)
            return  # else a duplicate: this room already has its decode
        if r is None and room in self.routes and msg.forwarded_by is None:
            return self._forward(msg, self.routes[room])
        problem, cause = wire.compat_problem(self.local, msg), FailureCause.INCOMPATIBLE
        if problem is not None:
            problem = (f"room {room}: decode dp_rank {msg.decode_rank} cannot use prefill "
                       f"dp_rank {self.dp_rank}: {problem}")
        elif self.instance_id and msg.prefill_instance and msg.prefill_instance != self.instance_id:
            problem, cause = (f"room {room}: the decode resolved prefill dp_rank {self.dp_rank} on "
                              f"bootstrap instance {msg.prefill_instance}, but this server is instance "
                              f"{self.instance_id}: the prefill restarted and lost the room"), \
                FailureCause.PEER_GONE
        elif room in self.failed:
            problem, _, cause = self.failed[room]
        if problem is not None:
            if r is None:
                self.early.pop(room, None)
                self._refuse(peer, room, problem, cause)
            else:
                r.peer = peer
                self._fail(r, problem, cause)
            return
        if r is None:
            self.early[room] = (peer, msg, time.monotonic())
        else:
            self._attach(r, peer, msg)

    def _on_kv_abort(self, sender: dict, msg: wire.KvAbort) -> None:
        """Fail the room and always answer (KvDone or KvFail): the decode keeps its pages until
        it knows no write of ours can still land in them."""
        room = msg.room
        sender = msg.endpoint or sender  # a forwarded abort comes from the home rank
        reason = f"room {room}: decode dp_rank {msg.decode_rank} aborted it: {msg.reason}"
        r = self.rooms.get(room)
        holder = self.forwarded[room].holder if room in self.forwarded else (
            self.routes[room].endpoint if room in self.routes else None)
        if r is None and holder is not None:  # the holder answers the decode
            fwd = wire.to_wire(msgspec.structs.replace(msg, endpoint=sender))
            self._submit(lambda: self._quiet_send(holder, fwd), room)
            return
        if r is None:
            peer = self.early[room][0] if room in self.early else sender
            self.early.pop(room, None)
            self._refuse(peer, room, reason, FailureCause.ABORTED)
        elif not r.handoff.done:
            if r.peer is None:
                r.peer = sender
            self._fail(r, reason, FailureCause.ABORTED)
        elif not r.job_running:  # finished, not yet reported: answer again
            self._send_later(r.peer or sender, self._kv_fail(room, r.handoff.reason or reason, r.cause))

    # ---- progress ----------------------------------------------------------------------------
    def _attach(self, r: PrefillRoom, peer: dict, req: wire.KvReq) -> None:
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
            r.peer = peer
            self._fail(r, reason, FailureCause.INCOMPATIBLE)
            return
        r.peer, r.req = peer, req
        r.stages[Stage.METADATA_RECEIVED.value] = time.time()
        r.handoff.advance(S.WAITING_FOR_INPUT)
        self._maybe_transfer(r)

    def _maybe_transfer(self, r: PrefillRoom) -> None:
        if r.req is None or r.pages is None or r.handoff.state is not S.WAITING_FOR_INPUT:
            return
        r.handoff.advance(S.TRANSFERRING)
        r.job_running = True
        self.pool.submit(self._transfer_job, r.room, r.peer, r.req, list(r.pages), dict(r.aux or {}))

    def _transfer_job(self, room: int, peer: dict, req: wire.KvReq, pages: list[int], aux: dict) -> None:
        """Runs on a pool thread; whatever happens, it reports to `jobs` exactly once."""
        try:
            dst = req.dst_pages  # the decode already holds the first reused_pages pages
            res = self.backend.write_pages(peer, req.layout, pages[req.reused_pages:][:len(dst)], dst)
            info = {"bytes": res.bytes, "transfer_s": res.seconds, "started_at": res.started_at,
                    "finished_at": res.finished_at, "writes": res.num_writes}
            log.debug("kv write", extra=fields(room=room, **info))
            done = wire.KvDone(room=room, prefill_rank=self.dp_rank, **_done_fields(aux), **info)
            self.backend.send(peer, wire.to_wire(done))
            self.jobs.put((room, None, info))
        except Exception as e:  # noqa: BLE001 - any failure must still finish the room
            if not isinstance(e, (TransferError, OSError)):
                log.exception("prefill dp_rank %d: KV transfer job of room %d crashed", self.dp_rank, room,
                              extra={"room": room})
            self.jobs.put((room, f"room {room}: KV transfer from prefill dp_rank {self.dp_rank} to "
                                 f"decode {peer_name(peer)} failed: {e}", {}))
        self.wake()

    def _send_later(self, peer: dict, msg: dict) -> None:
        self._submit(lambda: self._quiet_send(peer, msg), msg.get("room"))

    def _quiet_send(self, peer: dict, msg: dict) -> None:
        try:
            self.backend.send(peer, msg)
        except (TransferError, OSError) as e:
            log.info("prefill dp_rank %d: could not tell %s about room %s: %s", self.dp_rank,
                     peer_name(peer), msg.get("room"), e, extra={"room": msg.get("room")})

    def _submit(self, job, room) -> None:
        try:
            self.pool.submit(job)
        except RuntimeError:  # closed
            log.info("prefill dp_rank %d closed: room %s not told", self.dp_rank, room,
                     extra={"room": room})

    def _fail(self, r: PrefillRoom, reason: str, cause: FailureCause) -> None:
        if r.handoff.fail(reason):
            r.cause = cause
            if not r.job_running:
                self._tell_failed(r)
        # a running write job keeps the pages, and the decode is told when it returns

    def _tell_failed(self, r: PrefillRoom) -> None:
        if r.peer is not None:
            self._send_later(r.peer, self._kv_fail(r.room, r.handoff.reason, r.cause))

    def _job_returned(self, r: PrefillRoom, err: str | None, info: dict) -> None:
        r.job_running = False
        r.result = info
        if err is None:
            if not r.handoff.done:
                r.handoff.advance(S.SUCCESS)
            return  # its kv_done went out: the decode has its answer even if we failed meanwhile
        if r.handoff.fail(err):  # else keeps an earlier reason (abort, timeout)
            r.cause = FailureCause.TRANSFER
        self._tell_failed(r)

    def poll(self, now: float | None = None) -> list[HandoffDone]:
        now = time.monotonic() if now is None else now
        while True:
            try:
                room, err, info = self.jobs.get_nowait()
            except queue.Empty:
                break
            r = self.rooms.get(room)
            if r is not None:
                self._job_returned(r, err, info)
        for r in list(self.rooms.values()):
            if not r.handoff.done and now - r.handoff.created > self.bootstrap_timeout:
                self._fail(r, f"room {r.room}: prefill dp_rank {self.dp_rank} waited "
                              f"{self.bootstrap_timeout:g}s for {self._waiting_for(r)} "
                              f"(PDSERVE_BOOTSTRAP_TIMEOUT)", FailureCause.TIMEOUT)
            if r.handoff.done and not r.job_running:
                del self.rooms[r.room]
                if r.handoff.state is S.FAILED and not r.dropped:  # a late kv_req is answered at once
                    self.failed[r.room] = Doomed(r.handoff.reason, time.monotonic(), r.cause)
                self.done.append(HandoffDone(r.room, r.rid, r.handoff.state is S.SUCCESS,
                                          r.handoff.reason, r.aux, self._meta(r),
                                          {**r.stages, **transfer_stages(r.result)}, r.dropped))
        self._expire(now)
        out, self.done = self.done, []
        return out

    @staticmethod
    def _waiting_for(r: PrefillRoom) -> str:
        if r.req is None:
            return "the decode's metadata (kv_req)"
        return "the prefill to finish" if r.handoff.state is S.WAITING_FOR_INPUT else "the KV write"

    def _meta(self, r: PrefillRoom) -> dict:
        d = {f"prefill_{k}_s": v for k, v in r.handoff.durations().items()}
        d.update({"bootstrap_room": r.room, "prefill_dp_rank": self.dp_rank})
        if r.req is not None:
            d["decode_dp_rank"] = r.req.decode_rank
            if r.req.forwarded_by is not None:
                d["kv_req_forwarded_by"] = r.req.forwarded_by
        if r.dropped:
            d["disaggregation"] = "dropped"  # the decode prefilled it
        elif r.handoff.state is S.FAILED:
            d["failure_cause"] = r.cause.value
        if r.result:
            d["kv_bytes"] = r.result["bytes"]
            d["kv_transfer_s"] = r.result["transfer_s"]
            secs = r.result["transfer_s"]
            d["kv_gbps"] = r.result["bytes"] / secs / 1e9 if secs > 0 else None
        return d

    def _expire(self, now: float) -> None:
        for room, (_, _, t) in list(self.early.items()):
            if now - t > self.bootstrap_timeout:
                self._doom(room, f"room {room}: prefill dp_rank {self.dp_rank} never received its "
                                 f"request within {self.bootstrap_timeout:g}s (PDSERVE_BOOTSTRAP_TIMEOUT)",
                           FailureCause.TIMEOUT)
        for room, doomed in list(self.failed.items()):
            if now - doomed.since > self.failed_ttl:
                del self.failed[room]
        for room, (_, since) in list(self.dropped.items()):
            if now - since > self.failed_ttl:
                del self.dropped[room]
        for table in (self.routes, self.forwarded):
            for room, entry in list(table.items()):
                if now - entry.since > self.bootstrap_timeout:
                    del table[room]

    def inflight(self) -> int:
        return len(self.rooms)

    def holding(self) -> int:
        """Rooms whose prefilled KV pages are held for their decode."""
        return sum(1 for r in self.rooms.values() if r.pages is not None)

    def states(self) -> dict[str, int]:
        return dict(Counter(r.handoff.state.value for r in self.rooms.values()))

    def close(self, wait: bool = False) -> None:
        """Stop the job threads; `wait` joins them (a write in progress finishes first)."""
        self.pool.shutdown(wait=wait, cancel_futures=True)
