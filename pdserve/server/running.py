"""The requests this front is running, by rid: what SGLang's `POST /abort_request` reaches.

`abort(rid)` ends one item (or, for a request sent with rid R and n > 1, its items R_0, R_1, ...)
the way a client disconnect would, except that the reply or stream still ends normally, with
finish_reason "abort": the worker drops it and frees its KV pages. `take_over(rid)` does the same
for a migrated answer continuing here under the rid of a stream this server still runs.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import Callable

from ..core.errors import BadRequest
from .request_state import ActiveRequest

ABORT_REASON = "aborted by /abort_request"
TAKEN_OVER_REASON = "its answer continues in a migrated request of the same rid"
TAKE_OVER_TIMEOUT_S = 5.0


class RunningRequests:
    def __init__(self) -> None:
        self._by_rid: dict[str, ActiveRequest] = {}

    def add(self, active: ActiveRequest) -> None:
        for it in active.items:
            self._by_rid[it.rid] = active

    def remove(self, active: ActiveRequest) -> None:
        for it in active.items:
            if self._by_rid.get(it.rid) is active:
                del self._by_rid[it.rid]

    def _matching(self, rid: str) -> list[str]:
        if rid in self._by_rid:
            return [rid]
        sample = re.compile(re.escape(rid) + r"_\d+")
        return [r for r in self._by_rid if sample.fullmatch(r)]

    def abort(self, rid: str | None, abort_all: bool = False) -> list[str]:
        """Abort `rid` (or every running item); returns the item rids that were still running."""
        rids = list(self._by_rid) if abort_all else self._matching(rid or "")
        return [r for r in rids if self._by_rid[r].abort_item(r, ABORT_REASON)]

    async def take_over(self, rid: str, is_free: Callable[[str], bool], timeout_s: float = TAKE_OVER_TIMEOUT_S) -> None:
        """A continuation (server/resume.py) of rid arrives while this server still runs the item
        of the stream that broke (a cut connection it has not noticed yet): abort that item and
        wait, bounded, until its worker lets the rid go."""
        if is_free(rid):
            return
        active = self._by_rid.get(rid)
        if active is not None:
            active.abort_item(rid, TAKEN_OVER_REASON)
        deadline = time.monotonic() + timeout_s
        while not is_free(rid):
            if time.monotonic() >= deadline:
                raise BadRequest(f"rid {rid!r} is already in flight on this server (a continuation "
                                 f"waited {timeout_s:g}s for its old stream to end)")
            await asyncio.sleep(0.005)
