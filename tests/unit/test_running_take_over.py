"""RunningRequests.take_over: a migrated answer's continuation arriving while this server still
runs the broken stream's item of the same rid drops that item and waits (bounded) for the rid."""

from __future__ import annotations

import asyncio
import types

import pytest

from pdserve.core.errors import BadRequest
from pdserve.server.running import TAKEN_OVER_REASON, RunningRequests


class FakeActive:
    def __init__(self, rid: str, frees: bool):
        self.items = [types.SimpleNamespace(rid=rid)]
        self.aborted: list[tuple[str, str]] = []
        self.busy = {rid}
        self.frees = frees

    def abort_item(self, rid: str, reason: str) -> bool:
        self.aborted.append((rid, reason))
        if self.frees:  # its worker answers the abort a moment later
            asyncio.get_running_loop().call_later(0.02, self.busy.discard, rid)
        return True


def test_take_over_aborts_the_old_item_and_waits_for_its_rid():
    async def scenario():
        running, old = RunningRequests(), FakeActive("r1", frees=True)
        running.add(old)
        await running.take_over("r1", lambda rid: rid not in old.busy, timeout_s=2)
        assert old.aborted == [("r1", TAKEN_OVER_REASON)] and "r1" not in old.busy
        await running.take_over("r2", lambda rid: True)  # a free rid: nothing to do
        assert len(old.aborted) == 1
    asyncio.run(scenario())


def test_take_over_gives_up_with_a_400_when_the_rid_stays_busy():
    async def scenario():
        running, old = RunningRequests(), FakeActive("r1", frees=False)
        running.add(old)
        with pytest.raises(BadRequest, match="rid 'r1' is already in flight.*waited 0.05s"):
            await running.take_over("r1", lambda rid: rid not in old.busy, timeout_s=0.05)
    asyncio.run(scenario())
