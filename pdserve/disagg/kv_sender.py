"""Prefill side of the handoff: the driver of prefill_machine.PrefillHandoffs on a worker loop.

Events in: accept() when the prefill request arrives, on_message() for the decode's KvReq /
KvAbort (wire.py), prefill_done() when the engine finished the prompt (its pages now hold the
KV), fail() on abort, mark_failed() for rooms the front rejected, drop() for rooms the decode
prefilled itself, room_routed() when the front sent a room whose home is this rank
(room % dp_size) to another rank. poll() returns finished rooms.

Every call turns into one event for the machine, stamped with the clocks, on the loop's thread;
the machine holds all the state and decides everything (see prefill_machine and its parts for
the rules: rooms doomed before their request, forwarding, the instance and reuse checks, when
the decode hears kv_fail). This class only carries out its effects: sends and page writes run on a background
thread pool, and a write's outcome comes back through a queue that poll() feeds to the machine,
so no state is ever touched by two threads.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import msgspec

from ..core.failures import FailureCause
from ..core.log_format import fields
from ..transfer.base import Endpoint, TransferBackend, TransferError, WriteResult, peer_name
from . import wire
from .handoff import Event, HandoffDone, Tick
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
)
from .prefill_machine import PrefillHandoffs
from .prefill_notes import Doomed, Dropped, Early, Forwarded, Route
from .prefill_rooms import PrefillRoom

log = logging.getLogger(__name__)


class PrefillSender:
    def __init__(self, backend: TransferBackend, dp_rank: int, local: LocalFacts, *,
                 bootstrap_timeout: float, failed_ttl: float = 600.0, threads: int = 2,
                 wake: Callable[[], None] = lambda: None, instance_id: str = "") -> None:
        self.backend = backend
        self.dp_rank = dp_rank
        self.local = local  # page_size, kv_dtype, fingerprint, backend
        self.machine = PrefillHandoffs(dp_rank, local, bootstrap_timeout=bootstrap_timeout,
                                       failed_ttl=failed_ttl, instance_id=instance_id)
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix=f"kv-send-{dp_rank}")
        self.jobs: queue.Queue[tuple[int, str | None, WriteResult | None]] = queue.Queue()  # (room, error, write)
        self.done: list[HandoffDone[PrefillFacts]] = []
        self.wake = wake  # called from job threads so the loop polls at once

    # ---- the machine's state, read-only (instance_id is set once the rank registered) --------
    @property
    def instance_id(self) -> str:
        return self.machine.instance_id

    @instance_id.setter
    def instance_id(self, value: str) -> None:
        self.machine.instance_id = value

    @property
    def bootstrap_timeout(self) -> float:
        return self.machine.bootstrap_timeout

    @property
    def failed_ttl(self) -> float:
        return self.machine.failed_ttl

    @property
    def rooms(self) -> dict[int, PrefillRoom]:
        return self.machine.rooms

    @property
    def early(self) -> dict[int, Early]:
        """KvReqs that came before their request."""
        return self.machine.notes.early

    @property
    def failed(self) -> dict[int, Doomed]:
        """Rooms that cannot succeed here (a late request or KvReq for one fails at once)."""
        return self.machine.notes.doomed

    @property
    def dropped(self) -> dict[int, Dropped]:
        return self.machine.notes.dropped

    @property
    def routes(self) -> dict[int, Route]:
        return self.machine.notes.routes

    @property
    def forwarded(self) -> dict[int, Forwarded]:
        return self.machine.notes.forwarded

    # ---- events ------------------------------------------------------------------------------
    def holds(self, room: int) -> bool:
        """`room` is in progress here (a second request for it must be refused)."""
        return room in self.machine.rooms

    def accept(self, room: int, rid: str, prompt_len: int, prompt_ids: list[int] | None = None) -> None:
        """A prefill request for `room` arrived; ValueError if the room is already in progress.
        `prompt_ids` lets a decode reuse a prefix it holds (its key is checked against them)."""
        self._step(PrefillAccept(room, rid, prompt_len, prompt_ids, **_stamp()))

    def prefill_done(self, room: int, pages: list[int], aux: PrefillFacts) -> None:
        self._step(PrefillDone(room, pages, aux, **_stamp()))

    def fail(self, room: int, reason: str, cause: FailureCause = FailureCause.ABORTED) -> None:
        self._step(Fail(room, reason, cause, **_stamp()))

    def drop(self, room: int, reason: str) -> None:
        """The room's decode prefilled it itself: end the room with no transfer (reported as
        dropped, not failed), now or when its request arrives. A room whose KvReq already came
        is being served and is left alone."""
        self._step(Drop(room, reason, **_stamp()))

    def mark_failed(self, room: int, reason: str) -> None:
        """The front failed `room` (rejected it, or its decode gave it up): the room ends here if
        it is in progress, and a kv_req for it (queued or later) is answered with `reason`."""
        self._step(MarkFailed(room, reason, **_stamp()))

    def room_routed(self, room: int, rank: int, endpoint: Endpoint) -> None:
        """The front sent `room` (homed here) to `rank`: a KvReq for it here goes on there."""
        self._step(RoomRouted(room, rank, endpoint, **_stamp()))

    def on_message(self, sender: Endpoint, raw: dict[str, Any]) -> None:
        try:
            msg = wire.from_wire(raw)
        except wire.BadMessage as e:
            log.warning("prefill dp_rank %d: %s from %s", self.dp_rank, e, peer_name(sender))
            endpoint = raw.get("endpoint") if isinstance(raw, dict) else None
            return self._step(Malformed(e.room, e.kind, e.detail, endpoint if isinstance(endpoint, dict) else None,
                                        **_stamp()))
        self._step(FromDecode(sender, msg, **_stamp()))

    def poll(self, now: float | None = None) -> list[HandoffDone[PrefillFacts]]:
        while True:
            try:
                room, err, write = self.jobs.get_nowait()
            except queue.Empty:
                break
            self._step(WriteReturned(room, err, write, **_stamp()))
        stamp = _stamp()
        if now is not None:
            stamp["now"] = now
        self._step(Tick(**stamp))
        out, self.done = self.done, []
        return out

    # ---- effects -----------------------------------------------------------------------------
    def _step(self, ev: Event) -> None:
        for effect in self.machine.step(ev):
            self._do(effect)

    def _do(self, effect: PrefillEffect) -> None:
        if isinstance(effect, Send):
            try:
                self.pool.submit(self._send_job, effect)
            except RuntimeError:  # closed
                log.info("prefill dp_rank %d closed: room %s not told", self.dp_rank, effect.msg.room,
                         extra={"room": effect.msg.room})
        elif isinstance(effect, StartWrite):
            self.pool.submit(self._write_job, effect)
        elif isinstance(effect, PrefillReport):
            self.done.append(effect.done)
        else:
            raise TypeError(f"not a prefill handoff effect: {effect!r}")

    def _send_job(self, s: Send) -> None:
        """Runs on a pool thread: the send, then its follow-up (or its fallback)."""
        try:
            self.backend.send(s.peer, wire.to_wire(s.msg))
        except (TransferError, OSError) as e:
            instead = s.failed(str(e))
            if instead is not None:
                return self._send_job(instead)
            log.info("prefill dp_rank %d: could not tell %s about room %s: %s", self.dp_rank,
                     peer_name(s.peer), s.msg.room, e, extra={"room": s.msg.room})
            return
        if s.on_sent is not None:
            self._send_job(s.on_sent)

    def _write_job(self, w: StartWrite) -> None:
        """Runs on a pool thread; whatever happens, it reports to `jobs` exactly once."""
        try:
            res = self.backend.write_pages(w.peer, w.layout, w.src_pages, w.dst_pages)
            log.debug("kv write", extra=fields(room=w.room, **dataclasses.asdict(res)))
            self.backend.send(w.peer, wire.to_wire(msgspec.structs.replace(w.done, write=res)))
            self.jobs.put((w.room, None, res))
        except Exception as e:  # noqa: BLE001 - any failure must still finish the room
            if not isinstance(e, (TransferError, OSError)):
                log.exception("prefill dp_rank %d: KV transfer job of room %d crashed", self.dp_rank, w.room,
                              extra={"room": w.room})
            self.jobs.put((w.room, str(e), None))
        self.wake()

    # ---- stats -------------------------------------------------------------------------------
    def inflight(self) -> int:
        return len(self.machine.rooms)

    def holding(self) -> int:
        """Rooms whose prefilled KV pages are held for their decode."""
        return sum(1 for r in self.machine.rooms.values() if r.pages is not None)

    def states(self) -> dict[str, int]:
        return dict(Counter(r.state.handoff.value for r in self.machine.rooms.values()))

    def close(self, wait: bool = False) -> None:
        """Stop the job threads; `wait` joins them (a write in progress finishes first)."""
        self.pool.shutdown(wait=wait, cancel_futures=True)


def _stamp() -> dict[str, float]:
    return {"now": time.monotonic(), "wall": time.time()}
