"""The requests this front is running, by rid: what SGLang's `POST /abort_request` reaches.

`abort(rid)` ends one item (or, for a request sent with rid R and n > 1, its items R_0, R_1, ...)
the way a client disconnect would, except that the reply or stream still ends normally, with
finish_reason "abort": the worker drops it and frees its KV pages.
"""

from __future__ import annotations

import re

from .generation import ActiveRequest

ABORT_REASON = "aborted by /abort_request"


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
