"""Stand-ins for driving a server front's shared request path (server/front.py's Generator) in
this process, no workers: a pool that records what would be sent, a tokenizer that decodes ids
as their numbers, and running a request to its end."""

from __future__ import annotations

import asyncio

from pdserve.core.messages import ErrorInfo, TokenOutput
from pdserve.server.front import Generator, Limits
from pdserve.server.metrics import FrontMetrics
from pdserve.server.roles import DPDispatcher


class RecordingPool:
    """Stands in for WorkerPool: records what would be sent, as (rank, rid, bootstrap room), and
    keeps each request's sink for its outputs."""

    def __init__(self):
        self.sent: list[tuple[int, str, int]] = []
        self.sinks: dict[str, asyncio.Queue] = {}

    def check_free(self, rids):
        pass

    def submit(self, rank, req, sink):
        self.sent.append((rank, req.rid, req.pd.bootstrap_room))
        self.sinks[req.rid] = sink

    def abort(self, rid, reason):
        pass


class NumberTok:
    """Decodes ids as their numbers: enough for the request path's detokenizer."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def generator(role, dp: int, limits: Limits, metrics: FrontMetrics) -> Generator:
    """The request path of a started front `role` with `dp` ranks, over a RecordingPool (gen.pool)."""
    return Generator(RecordingPool(), DPDispatcher(dp, role.lb_method()), role, tokenizer=NumberTok(),  # type: ignore[arg-type]
                     limits=limits, metrics=metrics)


def finish(active, pool: RecordingPool, rid: str, error: ErrorInfo | None = None) -> None:
    """Feed one finished output for `rid` and run its request's event loop to its end."""
    pool.sinks[rid].put_nowait(TokenOutput(rid, [9], finished=True, error=error, finish_reason={"type": "length"}))

    async def drain():
        async for _ in active.events():
            pass
    asyncio.run(drain())
    active.close()
