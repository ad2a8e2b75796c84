"""A request's output deadline as one timer per request, not one per token.

Waiting on each token with a timeout (asyncio.wait, wait_for) arms and cancels a timer and
builds a task and a future for every token; in a streaming front that was a tenth of its CPU
per token. Instead the reader awaits the queue plainly, and this watch puts STALLED into the
queue once nothing has arrived (or waited unread) for `timeout_s`.
"""

from __future__ import annotations

import asyncio

STALLED = object()  # what the watch puts into the queue when the outputs stopped


class StallWatch:
    """Arm at the start of reading; `saw_output()` on each item read; `cancel()` at the end."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float, queue: asyncio.Queue):
        self.loop, self.timeout_s, self.queue = loop, timeout_s, queue
        self.last = loop.time()
        self._handle: asyncio.TimerHandle | None = loop.call_at(self.last + timeout_s, self._check)

    def saw_output(self) -> None:
        self.last = self.loop.time()

    def _check(self) -> None:
        now = self.loop.time()
        if self.queue.qsize():
            self.last = now  # outputs wait for a slow reader: the workers have not stalled
        due = self.last + self.timeout_s
        if now >= due:
            self._handle = None
            self.queue.put_nowait(STALLED)
        else:
            self._handle = self.loop.call_at(due, self._check)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
