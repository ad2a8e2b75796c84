"""Decode side of the handoff: one DecodeRoom per room, driven by the worker loop.

Life of a room: accept() -> resolve the prefill rank and endpoint (background) -> reserve
pages (`reserve` callback, retried while the pool is full) -> send kv_req to that prefill
worker -> its kv_done arrives after the pages landed -> poll() reports it finished. Any
failure (resolution, send, kv_fail, heartbeat loss, deadline, abort) finishes the room with a
reason naming room, ranks and cause (and a FailureCause); the caller then frees the room's pages.
Each room also keeps the wall-clock times of its stages (core.timeline) for the front. A room whose
kv_req may have reached the prefill is only reported after the prefill answered our kv_abort
(or `abort_grace` passed): until then a write of its KV could still land in those pages.
A KvMoved (the rank we addressed forwarded our KvReq) points the room at the holder's rank and
endpoint. `on_alive(addr, instance)` from the heartbeat fails the rooms resolved against another
instance of that prefill (it restarted and lost them); rooms still resolving are left to their
resolution, which sees the new instance.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import msgspec

from ..core.errors import PDServeError
from ..core.failures import FailureCause
from ..core.timeline import Stage, transfer_stages
from ..transfer.base import TransferBackend, TransferError
from . import wire
from .handoff import Handoff, HandoffDone, HandoffState, Side
from .rank_resolver import Resolved

log = logging.getLogger(__name__)
S = HandoffState


@dataclass(frozen=True)
class Reservation:
    """Pages for a prompt's KV: `pages[:reused_pages]` already hold it (this decode's prefix
    cache, pinned until the room ends), the rest are for the prefill to write."""

    pages: list[int]
    reused_pages: int = 0
    reused_key: str = ""  # core.page_keys key of the last reused page


@dataclass
class DecodeRoom:
    room: int
    rid: str
    addr: str
    prompt_len: int
    handoff: Handoff
    resolved: Resolved | None = None
    pages: list[int] | None = None
    reused_pages: int = 0
    reused_key: str = ""
    sent: bool = False
    resolved_at: float = 0.0
    reserved_at: float = 0.0
    aux: dict | None = None
    abort_sent_at: float | None = None  # kv_abort sent, no answer yet: pages may still be written
    cause: FailureCause = FailureCause.INTERNAL  # set with the first failure
    stages: dict[str, float] = field(default_factory=dict)  # Stage value -> time.time()


class DecodeReceiver:
    def __init__(self, backend: TransferBackend, dp_rank: int, local: dict, *,
                 resolve: Callable[[str, int, int | None], None],
                 cancel_resolve: Callable[[str, int], None],
                 reserve: Callable[[str, int], Reservation | list[int] | None], waiting_timeout: float,
                 wake: Callable[[], None] = lambda: None, threads: int = 2,
                 abort_grace: float = 5.0, invalidate: Callable[[str], None] = lambda addr: None,
                 give_up: Callable[[str, int, str], None] = lambda addr, room, reason: None):
        self.backend = backend
        self.dp_rank = dp_rank
        self.local = local  # page_size, kv_dtype, fingerprint, backend, layout, endpoint
        self.resolve = resolve
        self.cancel_resolve = cancel_resolve
        self.invalidate = invalidate  # forget what is cached about a prefill address
        self.give_up = give_up  # (addr, room, reason): tell a prefill we cannot reach that the room is off
        self.reserve = reserve
        self.waiting_timeout = waiting_timeout
        self.abort_grace = abort_grace  # how long an unanswered kv_abort keeps the pages
        self.wake = wake
        self.rooms: dict[int, DecodeRoom] = {}
        self.events: queue.Queue = queue.Queue()  # from resolver, send jobs, heartbeat
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix=f"kv-recv-{dp_rank}")
        self._addrs_lock = threading.Lock()
        self._addrs: dict[str, int] = {}

    # ---- events in (any thread) ------------------------------------------------------------
    def on_resolved(self, r: Resolved) -> None:
        self.events.put(("resolved", r))
        self.wake()

    def on_gone(self, addr: str, reason: str, *, ranks: frozenset[int] | None = None) -> None:
        """Fail the rooms waiting on prefill `addr`: only those resolved to `ranks` when given (their
        workers died)."""
        self.events.put(("gone", (addr, reason, ranks)))
        self.wake()

    def on_alive(self, addr: str, instance_id: str) -> None:
        """Prefill `addr` answered a heartbeat as `instance_id`."""
        self.events.put(("alive", (addr, instance_id)))
        self.wake()

    def watched(self) -> set[str]:
        with self._addrs_lock:
            return set(self._addrs)

    # ---- events in (loop thread) -----------------------------------------------------------
    def accept(self, room: int, rid: str, addr: str, prompt_len: int, hint: int | None) -> None:
        self.rooms[room] = DecodeRoom(room, rid, addr, prompt_len, Handoff(room, Side.DECODE))
        with self._addrs_lock:
            self._addrs[addr] = self._addrs.get(addr, 0) + 1
        self.resolve(addr, room, hint)

    def on_message(self, sender: dict, raw: dict) -> None:
        r = self.rooms.get(raw.get("room")) if isinstance(raw, dict) else None  # type: ignore[arg-type]
        if r is None:
            return
        try:
            msg = wire.from_wire(raw)
        except wire.BadMessage as e:
            if not r.handoff.done and raw.get("t") == wire.KV_DONE:
                self._fail(r, f"room {r.room}: prefill {r.addr} sent a bad kv_done: {e}",
                           FailureCause.TRANSFER, tell_prefill=False)
            else:
                log.warning("decode dp_rank %d: %s; ignored", self.dp_rank, e, extra={"room": r.room})
            return
        if isinstance(msg, wire.KvMoved):
            return self._moved(r, msg)
        if not isinstance(msg, (wire.KvDone, wire.KvFail)):
            return
        if r.handoff.done:
            r.abort_sent_at = None  # the prefill answered our kv_abort: no write can follow
            return
        self._holder_rank(r, msg.prefill_rank)
        if isinstance(msg, wire.KvFail):
            self._fail(r, f"room {r.room}: prefill {r.addr} dp_rank {msg.prefill_rank} "
                          f"failed it: {msg.reason}", FailureCause.parse(msg.cause),
                       tell_prefill=False)
        elif r.pages is None:
            log.warning("decode dp_rank %d: kv_done for room %d before its kv_req; ignored",
                        self.dp_rank, r.room, extra={"room": r.room})
        else:
            r.aux = msgspec.structs.asdict(msg)
            r.stages.update(transfer_stages(r.aux))
            if r.handoff.state is S.BOOTSTRAPPING:  # kv_done overtook our own "sent" event
                r.handoff.advance(S.WAITING_FOR_INPUT)
            r.handoff.advance(S.SUCCESS)

    def abort(self, room: int, reason: str) -> None:
        r = self.rooms.get(room)
        if r is not None and not r.handoff.done:
            self._fail(r, reason, FailureCause.ABORTED)

    # ---- progress (loop thread) ------------------------------------------------------------
    def poll(self, now: float | None = None) -> list[HandoffDone]:
        while True:
            try:
                kind, data = self.events.get_nowait()
            except queue.Empty:
                break
            getattr(self, f"_ev_{kind}")(data)
        now = time.monotonic() if now is None else now
        out = []
        for r in list(self.rooms.values()):
            if not r.handoff.done:
                self._progress(r, now)
            if r.abort_sent_at is not None and now - r.abort_sent_at > self.abort_grace:
                log.info("decode dp_rank %d: prefill %s never answered kv_abort of room %d in %gs",
                         self.dp_rank, r.addr, r.room, self.abort_grace, extra={"room": r.room})
                r.abort_sent_at = None
            if r.handoff.done and r.abort_sent_at is None:
                out.append(self._finish(r))
        return out

    def _ev_resolved(self, res: Resolved) -> None:
        r = self.rooms.get(res.room)
        if r is None or r.handoff.done:
            return
        if res.error is not None:
            self._fail(r, res.error, res.cause, tell_prefill=False)
            return
        theirs = res.info.transfer_backend if res.info is not None else self.local["backend"]
        if theirs != self.local["backend"]:
            reason = (f"room {r.room}: prefill {r.addr} dp_rank {res.rank} uses transfer backend "
                      f"{theirs!r}, this decode (dp_rank {self.dp_rank}) uses {self.local['backend']!r}: "
                      "start both with the same --transfer-backend")
            self._fail(r, reason, FailureCause.INCOMPATIBLE, tell_prefill=False)
            # no kv_abort can cross backends: the bootstrap service frees the prefill's pages
            self.pool.submit(self.give_up, r.addr, r.room, reason)
            return
        r.resolved, r.resolved_at = res, time.monotonic()
        r.stages[Stage.TOPOLOGY_LOOKUP.value] = res.topology_at
        r.stages[Stage.RANK_RESOLUTION.value] = res.resolved_at

    def _ev_sent(self, data: tuple[int, str | None, float]) -> None:
        room, err, sent_at = data
        r = self.rooms.get(room)
        if r is None:
            return
        r.stages[Stage.METADATA_SENT.value] = sent_at
        if r.handoff.done:
            return
        if err is not None:
            self.invalidate(r.addr)  # the cached endpoint may be stale: the next room looks it up afresh
            self._fail(r, err, FailureCause.TRANSFER, tell_prefill=False)
        elif r.handoff.state is S.BOOTSTRAPPING:
            r.handoff.advance(S.WAITING_FOR_INPUT)

    def _moved(self, r: DecodeRoom, msg: wire.KvMoved) -> None:
        """Our KvReq was forwarded to the rank that holds the room: aborts go there now."""
        res = r.resolved
        if res is None or res.info is None or r.handoff.done:
            return
        ep = msg.endpoint
        info = dataclasses.replace(res.info, dp_rank=msg.prefill_rank, endpoint=ep,
                                   rank_ip=str(ep.get("ip", res.info.rank_ip)),
                                   rank_port=int(ep.get("port", res.info.rank_port)))
        r.resolved = dataclasses.replace(res, rank=msg.prefill_rank, info=info)

    def _holder_rank(self, r: DecodeRoom, rank: int | None) -> None:
        if r.resolved is not None and rank is not None and rank != r.resolved.rank:
            r.resolved = dataclasses.replace(r.resolved, rank=rank)

    def _ev_alive(self, data: tuple[str, str]) -> None:
        addr, instance = data
        for r in self.rooms.values():
            res = r.resolved
            if r.addr != addr or res is None or not res.instance_id or res.instance_id == instance:
                continue
            r.abort_sent_at = None  # that instance is gone: it writes nothing more
            if not r.handoff.done:
                self._fail(r, f"room {r.room} (prefill dp_rank {res.rank}): prefill server at {addr} "
                              f"restarted (instance {res.instance_id} -> {instance}); its rooms are lost",
                           FailureCause.PEER_GONE, tell_prefill=False)

    def _ev_gone(self, data: tuple[str, str, frozenset[int] | None]) -> None:
        addr, reason, ranks = data
        for r in self.rooms.values():
            res = r.resolved
            if r.addr != addr or (ranks is not None and (res is None or res.rank not in ranks)):
                continue
            r.abort_sent_at = None  # a gone prefill writes nothing more
            if not r.handoff.done:
                where = f" (prefill dp_rank {res.rank})" if res is not None else ""
                self._fail(r, f"room {r.room}{where}: {reason}", FailureCause.PEER_GONE, tell_prefill=False)

    def _progress(self, r: DecodeRoom, now: float) -> None:
        st = r.handoff.state
        if st is S.BOOTSTRAPPING and r.resolved is not None and r.pages is None:
            try:
                pages = self.reserve(r.rid, r.prompt_len)
            except PDServeError as e:
                return self._fail(r, f"room {r.room}: decode dp_rank {self.dp_rank} cannot reserve "
                                     f"pages: {e.message}", FailureCause.NO_PAGES)
            if pages is not None:
                res = pages if isinstance(pages, Reservation) else Reservation(pages)
                r.pages, r.reserved_at = res.pages, now
                r.reused_pages, r.reused_key = res.reused_pages, res.reused_key
                r.stages[Stage.PREALLOCATION.value] = time.time()
                self.pool.submit(self._send_req, r.room, r.resolved, res, r.prompt_len)
        waited = now - r.handoff.entered[st]
        if waited > self.waiting_timeout:
            rank = r.resolved.rank if r.resolved else None
            self._fail(r, f"room {r.room}: decode dp_rank {self.dp_rank} waited "
                          f"{self.waiting_timeout:g}s in {st.value} for prefill {r.addr} "
                          f"dp_rank {rank} (PDSERVE_WAITING_TIMEOUT)", FailureCause.TIMEOUT, now=now)

    @staticmethod
    def _peer(res: Resolved) -> dict:
        """The prefill rank's transfer endpoint descriptor."""
        assert res.info is not None
        return res.info.peer()

    def _send_req(self, room: int, res: Resolved, got: Reservation, prompt_len: int) -> None:
        """Runs on a pool thread; reports a "sent" event exactly once."""
        sent_at = time.time()  # before the send: the prefill cannot see the kv_req earlier
        try:
            msg = wire.KvReq(room=room, dst_pages=got.pages[got.reused_pages:], prompt_len=prompt_len,
                             decode_rank=self.dp_rank, prefill_rank=res.rank, prefill_instance=res.instance_id,
                             reused_pages=got.reused_pages, reused_key=got.reused_key,
                             **{k: self.local[k] for k in
                                ("layout", "endpoint", "page_size", "kv_dtype", "fingerprint", "backend")})
            self.backend.send(self._peer(res), wire.to_wire(msg))
            err = None
        except Exception as e:  # noqa: BLE001 - any failure must still finish the room
            if not isinstance(e, (TransferError, OSError)):
                log.exception("decode dp_rank %d: sending kv_req of room %d crashed", self.dp_rank, room,
                              extra={"room": room})
            err = f"room {room}: sending metadata to prefill {res.addr} dp_rank {res.rank} failed: {e}"
        self.events.put(("sent", (room, err, sent_at)))
        self.wake()

    def _fail(self, r: DecodeRoom, reason: str, cause: FailureCause, tell_prefill: bool = True,
              now: float | None = None) -> None:
        if not r.handoff.fail(reason):
            return
        r.cause = cause
        self.cancel_resolve(r.addr, r.room)
        if not tell_prefill:
            return
        try:
            if r.resolved is not None and r.resolved.info:
                msg = wire.to_wire(wire.KvAbort(room=r.room, reason=reason, decode_rank=self.dp_rank,
                                                endpoint=self.local["endpoint"]))
                self.pool.submit(self._quiet_send, self._peer(r.resolved), msg)
                if r.pages is not None:  # a write may still land until the prefill answers
                    r.abort_sent_at = time.monotonic() if now is None else now
            else:  # no rank yet: the bootstrap service frees the prefill's pages at once
                self.pool.submit(self.give_up, r.addr, r.room, reason)
        except RuntimeError:  # closed
            pass

    def _quiet_send(self, peer: dict, msg: dict) -> None:
        try:
            self.backend.send(peer, msg)
        except (TransferError, OSError) as e:
            log.info("decode dp_rank %d: could not tell prefill about room %s: %s",
                     self.dp_rank, msg.get("room"), e, extra={"room": msg.get("room")})

    def _finish(self, r: DecodeRoom) -> HandoffDone:
        del self.rooms[r.room]
        with self._addrs_lock:
            n = self._addrs.get(r.addr, 1) - 1
            if n <= 0:
                self._addrs.pop(r.addr, None)
            else:
                self._addrs[r.addr] = n
        ok = r.handoff.state is S.SUCCESS
        return HandoffDone(r.room, r.rid, ok, r.handoff.reason, r.aux, self._meta(r), dict(r.stages))

    def _meta(self, r: DecodeRoom) -> dict:
        h = r.handoff
        d: dict = {"bootstrap_room": r.room, "decode_dp_rank": self.dp_rank}
        if h.state is S.FAILED:
            d["failure_cause"] = r.cause.value
        if r.resolved is not None:
            d.update(prefill_dp_rank=r.resolved.rank, dp_rank_path=r.resolved.path,
                     resolve_s=r.resolved.seconds)
            if r.pages is not None:
                d["prealloc_wait_s"] = r.reserved_at - r.resolved_at
                d["kv_reused_pages"] = r.reused_pages  # already on this decode: not moved
                d["kv_transferred_pages"] = len(r.pages) - r.reused_pages
        if S.WAITING_FOR_INPUT in h.entered:
            d["bootstrap_s"] = h.entered[S.WAITING_FOR_INPUT] - h.created
            d["waiting_s"] = h.entered[h.state] - h.entered[S.WAITING_FOR_INPUT]
        if r.aux:
            secs = r.aux.get("transfer_s") or 0.0
            d.update(kv_bytes=r.aux.get("bytes"), kv_transfer_s=secs,
                     kv_gbps=(r.aux.get("bytes", 0) / secs / 1e9) if secs > 0 else None)
        return d

    def inflight(self) -> int:
        return len(self.rooms)

    def preallocated(self) -> int:
        """Rooms holding reserved pages while they wait for (or just got) their KV."""
        return sum(1 for r in self.rooms.values() if r.pages is not None)

    def states(self) -> dict[str, int]:
        return dict(Counter(r.handoff.state.value for r in self.rooms.values()))

    def close(self, wait: bool = False) -> None:
        """Stop the send threads; `wait` joins them."""
        self.pool.shutdown(wait=wait, cancel_futures=True)
