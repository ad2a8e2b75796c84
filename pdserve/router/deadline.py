"""A request deadline like asyncio.timeout(), bound to a loop known beforehand.

Why: on CPython 3.11 every get_running_loop() is a getpid() syscall, and asyncio.timeout()
makes three per use; the router sets one deadline per request. Semantics follow
asyncio.Timeout: at the deadline the task is cancelled, and leaving the block turns that
cancellation (and only that one) into TimeoutError.
"""

from __future__ import annotations

import asyncio


class Deadline:
    __slots__ = ("loop", "when", "_task", "_handle", "_expired")

    def __init__(self, loop: asyncio.AbstractEventLoop, seconds: float):
        self.loop, self.when = loop, loop.time() + seconds
        self._task: asyncio.Task | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._expired = False

    def expired(self) -> bool:
        return self._expired

    async def __aenter__(self) -> "Deadline":
        self._task = asyncio.current_task(self.loop)
        self._handle = self.loop.call_at(self.when, self._fire)
        return self

    def _fire(self) -> None:
        self._expired = True
        self._task.cancel()

    async def __aexit__(self, exc_type, exc, tb) -> None:
        self._handle.cancel()
        # uncancel() == 0: no one else asked to cancel this task, so the cancellation is ours
        if self._expired and self._task.uncancel() == 0 and exc_type is asyncio.CancelledError:
            raise TimeoutError
