"""Decode side: batched /query_dp_ranks for the rooms whose prefill rank only the prefill knows.

One worker thread per prefill server with pending rooms runs that server's rounds, QUERY_ROUND_S
apart, each asking for all its pending rooms in calls of at most MAX_QUERY_ROOMS. Each room gets
one answer (its rank, the prefill's rejection, or PDSERVE_DP_RANK_QUERY_TIMEOUT) unless cancelled.
Part of the decode's PrefillLink (prefill_link.py), used by its RankResolver.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

from ..core.errors import PDServeError
from ..core.failures import FailureCause, rejection_cause
from ..core.pd_vocab import MAX_QUERY_ROOMS
from .prefill_peers import PrefillPeers

log = logging.getLogger(__name__)
QUERY_ROUND_S = 0.005  # pause between two query rounds for one prefill server
QUERY_IDLE_S = 1.0  # a server's query worker exits once it had nothing pending this long
CLOSE_JOIN_S = 2.0  # close() waits at most this long, in all, for query workers


class QueryBatcher:
    """Batched /query_dp_ranks, one worker thread per prefill server with pending rooms.

    Each worker runs that server's rounds: one at a time, QUERY_ROUND_S apart, each asking for
    all its pending rooms in calls of at most MAX_QUERY_ROOMS (what the service accepts). Servers
    do not wait on each other: a slow or unreachable one holds up only its own rooms. A worker
    lingers QUERY_IDLE_S once its server has nothing pending, then exits (no polling)."""

    def __init__(self, peers: PrefillPeers,
                 on_answer: Callable[[str, int, int | None, str | None, FailureCause], None]):
        self.peers = peers
        self.on_answer = on_answer  # (addr, room, rank, error, cause)
        self.pending: dict[str, dict[int, float]] = {}  # addr -> room -> deadline
        self._lock = threading.Lock()
        self.cv = threading.Condition(self._lock)
        self.closed = False
        self._workers: dict[str, tuple[threading.Thread, threading.Condition]] = {}

    def add(self, addr: str, room: int, deadline: float) -> None:
        with self.cv:
            self.pending.setdefault(addr, {})[room] = deadline
            if self.closed:
                return
            worker = self._workers.get(addr)
            if worker is not None:
                worker[1].notify()
                return
            wake = threading.Condition(self._lock)  # this worker's own: no waking the others
            thread = threading.Thread(target=self._work, args=(addr, wake), daemon=True,
                                      name=f"dp-rank-query {addr}")
            self._workers[addr] = (thread, wake)
            thread.start()

    def _work(self, addr: str, wake: threading.Condition) -> None:
        me = threading.current_thread()
        try:
            while True:
                with self.cv:
                    idle_until = None
                    while not self.closed and not self.pending.get(addr):
                        now = time.monotonic()
                        idle_until = idle_until or now + QUERY_IDLE_S
                        if now >= idle_until:
                            break
                        wake.wait(idle_until - now)
                    if self.closed or not self.pending.get(addr):
                        # under the same lock as the check: a later add() starts a new worker
                        self._retire(addr, me)
                        return
                    rooms = dict(self.pending[addr])
                try:
                    self._round(addr, rooms)
                except Exception:  # noqa: BLE001 - the worker serves every room of addr; keep it
                    log.exception("dp-rank query round for %s failed", addr)
                with self.cv:  # the pause between rounds, cut short by close()
                    end = time.monotonic() + QUERY_ROUND_S
                    while not self.closed and (left := end - time.monotonic()) > 0:
                        wake.wait(left)
        finally:  # on the way out by an unexpected error, too
            with self.cv:
                self._retire(addr, me)

    def _retire(self, addr: str, thread: threading.Thread) -> None:
        if self._workers.get(addr, (None,))[0] is thread:
            del self._workers[addr]

    def _round(self, addr: str, rooms: dict[int, float]) -> None:
        order = sorted(rooms)
        for i in range(0, len(order), MAX_QUERY_ROOMS):  # the service refuses longer lists
            chunk = order[i:i + MAX_QUERY_ROOMS]
            try:
                found, failed = self.peers.query_dp_ranks(addr, chunk)
                err = None
            except PDServeError as e:
                found, failed, err = {}, {}, e.message
            except Exception as e:  # noqa: BLE001 - a failed call fails only its chunk
                log.exception("dp-rank query to %s failed", addr)
                found, failed, err = {}, {}, repr(e)
            now = time.monotonic()
            for room in chunk:
                if room in found:
                    self._answer(addr, room, found[room], None)
                elif room in failed:
                    self._answer(addr, room, None,
                                 f"room {room}: prefill {addr} rejected it: {failed[room]}",
                                 rejection_cause(str(failed[room])))
                elif now > rooms[room]:
                    self._answer(addr, room, None,
                                 f"room {room}: prefill {addr} recorded no DP rank for it in time "
                                 f"(PDSERVE_DP_RANK_QUERY_TIMEOUT)" + (f"; last error: {err}" if err else ""),
                                 FailureCause.TIMEOUT, expired_at=now)

    def _answer(self, addr: str, room: int, rank: int | None, error: str | None,
                cause: FailureCause = FailureCause.RESOLVE, *, expired_at: float | None = None) -> None:
        """Answer `room` unless it is no longer pending (cancelled) or, for a timeout, was added
        again since with a later deadline: each room added gets one answer."""
        with self.cv:
            deadline = self.pending.get(addr, {}).get(room)
            if deadline is None or (expired_at is not None and expired_at <= deadline):
                return
            self._drop(addr, room)
        self.on_answer(addr, room, rank, error, cause)

    def cancel(self, addr: str, room: int) -> None:
        with self.cv:
            self._drop(addr, room)

    def _drop(self, addr: str, room: int) -> None:
        rooms = self.pending.get(addr)
        if rooms is not None:
            rooms.pop(room, None)
            if not rooms:
                del self.pending[addr]  # an empty entry would keep its worker polling

    def close(self) -> None:
        """Stop every worker; a round blocked in a call is joined for at most CLOSE_JOIN_S in all."""
        with self.cv:
            self.closed = True
            workers = list(self._workers.values())
            for _, wake in workers:
                wake.notify()
        end = time.monotonic() + CLOSE_JOIN_S
        for thread, _ in workers:
            thread.join(timeout=max(0.0, end - time.monotonic()))
