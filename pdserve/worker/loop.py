"""The worker loop, the same for every role: read messages, step the engine, send outputs
(stamped with when each request was queued and first scheduled, see queue_clock.py)."""

from __future__ import annotations

import logging
import os
import time
from dataclasses import asdict
from typing import TYPE_CHECKING

from ..core.messages import (
    AbortReq,
    GenerateReq,
    OutputBatch,
    RoomDroppedNotice,
    RoomFailedNotice,
    RoomRoutedNotice,
    ShutdownReq,
    StatsReq,
    TokenOutput,
    WorkerStats,
)
from ..engine.spin_governor import SpinGovernor
from .pump import WorkerChannel
from .queue_clock import QueueClock
from .role import WorkerRole

if TYPE_CHECKING:  # the engine loads torch; the loop only calls it (tests run it over a fake)
    from ..engine.engine import Engine

log = logging.getLogger(__name__)
IDLE_POLL_S = 0.05


class WorkerLoop:
    def __init__(self, engine: Engine, role: WorkerRole, channel: WorkerChannel, dp_rank: int,
                 governor: SpinGovernor | None = None):
        self.engine = engine
        self.governor = governor  # spinning waits only while they pay (engine/spin_governor.py)
        self.role = role
        self.channel = channel
        self.dp_rank = dp_rank
        self.running = True
        self.parent = os.getppid()
        self.next_parent_check = 0.0
        self.clock = QueueClock()

    def parent_alive(self) -> bool:
        """Workers stop when their front died without telling them (e.g. SIGKILL)."""
        now = time.monotonic()
        if now >= self.next_parent_check:
            self.next_parent_check = now + 1.0
            if os.getppid() != self.parent:
                log.error("worker %d: front process is gone, exiting", self.dp_rank)
                return False
        return True

    def run(self) -> None:
        while self.running and self.parent_alive():
            idle = not (self.engine.has_work() or self.role.busy())
            outs: list[TokenOutput] = []
            for msg in self.channel.recv_all(IDLE_POLL_S if idle else 0.0):
                outs.extend(self.handle(msg))
            outs.extend(self.role.poll())
            if self.engine.has_work():
                # what is ready now (a decode's first tokens from handoffs that just landed,
                # errors) goes out before the step, not one step later
                self._send(outs)
                outs = []
                started = time.time()
                self.clock.before_step(self.engine.seqs, started)
                if self.governor is not None:
                    self.governor.before_step()
                stepped = self.engine.step()
                self.clock.after_step(self.engine.seqs, started)
                outs.extend(self.role.on_step(stepped))
            elif self.governor is not None:
                self.governor.idle()
            self._send(outs)

    def _send(self, outs: list[TokenOutput]) -> None:
        if outs:
            self.clock.stamp(outs)
            self.channel.send(OutputBatch(self.dp_rank, outs))

    def handle(self, msg) -> list[TokenOutput]:
        if isinstance(msg, GenerateReq):
            self.clock.watch(msg.rid)
            return self.role.on_generate(msg)
        if isinstance(msg, AbortReq):
            return self.role.on_abort(msg.rid, msg.reason)
        if isinstance(msg, RoomFailedNotice):
            self.role.on_room_failed(msg.room, msg.reason)
            return []
        if isinstance(msg, RoomDroppedNotice):
            self.role.on_room_dropped(msg.room, msg.reason)
            return []
        if isinstance(msg, RoomRoutedNotice):
            self.role.on_room_routed(msg.room, msg.rank, msg.endpoint)
            return []
        if isinstance(msg, StatsReq):
            flushed = self.engine.flush_cache() if msg.flush_cache else None
            self.channel.send(self.stats(msg.req_id, flushed))
            return []
        if isinstance(msg, ShutdownReq):
            self.running = False
            return []
        log.warning("worker %d: unknown message %r", self.dp_rank, type(msg).__name__)
        return []

    def stats(self, req_id: int, flushed_pages: int | None = None) -> WorkerStats:
        s = self.engine.stats()
        extra = {"held_pages": s.held_pages, "time": time.time(),
                 "prefix_cache": {"enabled": self.engine.cache.enabled, **asdict(s.cache)},
                 **self.role.stats_extra()}
        if self.governor is not None:
            extra["cpu_waits"] = self.governor.summary()
        if flushed_pages is not None:
            extra["flushed_pages"] = flushed_pages
        return WorkerStats(
            req_id=req_id,
            dp_rank=self.dp_rank,
            total_pages=s.total_pages,
            free_pages=s.free_pages,
            cached_pages=s.cached_pages,
            running_requests=s.running,
            waiting_requests=s.waiting,
            inflight_transfers=self.role.inflight_transfers(),
            extra=extra,
        )
