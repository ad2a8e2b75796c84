"""The router's request deadline (pdserve/router/deadline.py) behaves like asyncio.timeout()."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.router.deadline import Deadline

pytestmark = pytest.mark.timeout(30)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_deadline_turns_its_own_cancellation_into_timeout_error():
    async def main():
        loop = asyncio.get_running_loop()
        with pytest.raises(TimeoutError):
            async with Deadline(loop, 0.05) as deadline:
                await asyncio.sleep(5)
        assert deadline.expired()
        assert asyncio.current_task().cancelling() == 0  # nothing left pending for the task
    run(main())


def test_no_timeout_when_the_block_finishes_in_time():
    async def main():
        async with Deadline(asyncio.get_running_loop(), 5) as deadline:
            await asyncio.sleep(0.01)
        assert not deadline.expired()
        await asyncio.sleep(0.01)  # the timer was cancelled: no stray cancellation arrives
        return "done"
    assert run(main()) == "done"


def test_outside_cancellation_stays_a_cancellation():
    async def inner(started: asyncio.Event):
        async with Deadline(asyncio.get_running_loop(), 5):
            started.set()
            await asyncio.sleep(5)

    async def main():
        started = asyncio.Event()
        task = asyncio.create_task(inner(started))
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    run(main())


def test_outside_cancellation_racing_the_deadline_is_not_swallowed():
    async def inner(started: asyncio.Future):
        async with Deadline(asyncio.get_running_loop(), 0.05) as deadline:
            started.set_result(deadline)
            await asyncio.sleep(5)

    async def main():
        loop = asyncio.get_running_loop()
        started = loop.create_future()
        task = asyncio.create_task(inner(started))
        deadline = await started
        loop.call_at(deadline.when, task.cancel)  # fires in the same loop pass, right after the deadline
        with pytest.raises(asyncio.CancelledError):
            await task
    run(main())
