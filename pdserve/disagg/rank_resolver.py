"""Decode side: which prefill DP rank holds a room, and that rank's transfer endpoint.

Runs the resolution order of DESIGN section 4 on a background thread per request; rooms that
need the query path join one batched /query_dp_ranks call per prefill server per round.
Results (or failures naming room, server and cause) go to `on_result` from those threads,
with the wall-clock times of the topology lookup and of the resolution (for timelines).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from ..core.errors import PDServeError
from ..core.failures import FailureCause, rejection_cause
from .bootstrap_client import BootstrapClient
from .bootstrap_table import RankInfo
from .dp_rules import resolve_prefill_rank

log = logging.getLogger(__name__)
QUERY_ROUND_S = 0.005


@dataclass
class Resolved:
    room: int
    addr: str
    rank: int | None = None
    path: str = ""
    info: RankInfo | None = None
    instance_id: str = ""
    error: str | None = None
    seconds: float = 0.0
    cause: FailureCause = FailureCause.RESOLVE  # why it failed, when `error` is set
    topology_at: float = 0.0  # time.time() when the topology was in hand
    resolved_at: float = 0.0  # time.time() when the rank and its endpoint were known


class QueryBatcher:
    """One thread: every round, one /query_dp_ranks per prefill server for all pending rooms."""

    def __init__(self, client: BootstrapClient,
                 on_answer: Callable[[str, int, int | None, str | None, FailureCause], None]):
        self.client = client
        self.on_answer = on_answer  # (addr, room, rank, error, cause)
        self.pending: dict[str, dict[int, float]] = {}  # addr -> room -> deadline
        self.cv = threading.Condition()
        self.closed = False
        self.thread = threading.Thread(target=self._run, name="dp-rank-query", daemon=True)
        self.thread.start()

    def add(self, addr: str, room: int, deadline: float) -> None:
        with self.cv:
            self.pending.setdefault(addr, {})[room] = deadline
            self.cv.notify()

    def _run(self) -> None:
        while True:
            with self.cv:
                while not self.pending and not self.closed:
                    self.cv.wait()
                if self.closed:
                    return
                work = {a: dict(r) for a, r in self.pending.items() if r}
            for addr, rooms in work.items():
                try:
                    self._round(addr, rooms)
                except Exception:  # noqa: BLE001 - the thread serves every room; keep it alive
                    log.exception("dp-rank query round for %s failed", addr)
            time.sleep(QUERY_ROUND_S)

    def _round(self, addr: str, rooms: dict[int, float]) -> None:
        try:
            found, failed = self.client.query_dp_ranks(addr, sorted(rooms))
            err = None
        except PDServeError as e:
            found, failed, err = {}, {}, e.message
        now = time.monotonic()
        for room, deadline in rooms.items():
            if room in found:
                self._answer(addr, room, found[room], None)
            elif room in failed:
                self._answer(addr, room, None, f"room {room}: prefill {addr} rejected it: {failed[room]}",
                             rejection_cause(str(failed[room])))
            elif now > deadline:
                self._answer(addr, room, None,
                             f"room {room}: prefill {addr} recorded no DP rank for it in time "
                             f"(PDSERVE_DP_RANK_QUERY_TIMEOUT)" + (f"; last error: {err}" if err else ""),
                             FailureCause.TIMEOUT)

    def _answer(self, addr: str, room: int, rank: int | None, error: str | None,
                cause: FailureCause = FailureCause.RESOLVE) -> None:
        with self.cv:
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
                del self.pending[addr]  # an empty entry would keep the thread polling

    def close(self) -> None:
        with self.cv:
            self.closed = True
            self.cv.notify()
        self.thread.join(timeout=2)


class RankResolver:
    def __init__(self, client: BootstrapClient, *, decode_force: bool, topology_timeout: float,
                 query_timeout: float, on_result: Callable[[Resolved], None], threads: int = 4,
                 revalidate_after: float | None = None):
        self.client = client
        self.decode_force = decode_force
        self.topology_timeout = topology_timeout
        # a topology cached longer than this without word from its server is checked (/health)
        # before use: the prefill may have restarted on the same port
        self.revalidate_after = revalidate_after
        self.query_timeout = query_timeout
        self.on_result = on_result
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="resolve")
        self.batcher = QueryBatcher(client, self._on_query_answer)
        self._started: dict[tuple[str, int], float] = {}
        self._instances: dict[tuple[str, int], tuple[str, float]] = {}  # query path: (instance, topology_at)
        self._lock = threading.Lock()

    def resolve(self, addr: str, room: int, hint: int | None) -> None:
        with self._lock:
            self._started[(addr, room)] = time.monotonic()
        self.pool.submit(self._job, addr, room, hint)

    def cancel(self, addr: str, room: int) -> None:
        self.batcher.cancel(addr, room)
        with self._lock:
            self._started.pop((addr, room), None)
            self._instances.pop((addr, room), None)

    def _job(self, addr: str, room: int, hint: int | None) -> None:
        try:
            topo = self.client.get_topology(addr, deadline_s=self.topology_timeout,
                                            max_age_s=self.revalidate_after)
            topology_at = time.time()
            res = resolve_prefill_rank(topology=topo, hint=hint, room=room,
                                       decode_force=self.decode_force)
        except Exception as e:  # noqa: BLE001 - every room gets an answer
            return self._finish(Resolved(room, addr, error=f"room {room}: prefill {addr}: "
                                         f"{getattr(e, 'message', e)}"))
        if res.rank is None:
            with self._lock:
                self._instances[(addr, room)] = (topo.instance_id, topology_at)
            self.batcher.add(addr, room, time.monotonic() + self.query_timeout)
            return
        self._lookup(addr, room, res.rank, res.path, topo.instance_id, topology_at)

    def _on_query_answer(self, addr: str, room: int, rank: int | None, error: str | None,
                         cause: FailureCause = FailureCause.RESOLVE) -> None:
        with self._lock:
            instance_id, topology_at = self._instances.pop((addr, room), ("", 0.0))
        if error is not None:
            return self._finish(Resolved(room, addr, path="query", instance_id=instance_id, error=error,
                                         cause=cause, topology_at=topology_at))
        try:
            self.pool.submit(self._lookup, addr, room, rank, "query", instance_id, topology_at)
        except RuntimeError:  # closed
            pass

    def _lookup(self, addr: str, room: int, rank: int, path: str, instance_id: str,
                topology_at: float = 0.0) -> None:
        try:
            info = self.client.get_rank_endpoint(addr, rank)
        except Exception as e:  # noqa: BLE001 - every room gets an answer
            return self._finish(Resolved(room, addr, rank, path, instance_id=instance_id,
                                         error=f"room {room}: prefill {addr} dp_rank {rank}: "
                                               f"{getattr(e, 'message', e)}", topology_at=topology_at))
        self._finish(Resolved(room, addr, rank, path, info, instance_id, topology_at=topology_at,
                              resolved_at=time.time()))

    def _finish(self, r: Resolved) -> None:
        with self._lock:
            t0 = self._started.pop((r.addr, r.room), None)
        if t0 is None:
            return  # cancelled
        r.seconds = time.monotonic() - t0
        self.on_result(r)

    def close(self, wait: bool = False) -> None:
        """Stop the query thread and the lookup threads; `wait` joins the latter."""
        self.batcher.close()
        self.pool.shutdown(wait=wait, cancel_futures=True)
