"""Request arrival schedules: when (seconds after the start) each request is sent.

Poisson arrivals draw exponential gaps from a seeded RNG, so a run is reproducible;
`fixed` spaces requests evenly; an infinite rate sends everything at once.
`gather_on_schedule` starts coroutines at those times.
"""

from __future__ import annotations

import asyncio
import enum
import math
import random
import time
from typing import Awaitable, Callable, TypeVar

T = TypeVar("T")


class ArrivalKind(str, enum.Enum):
    POISSON = "poisson"
    FIXED = "fixed"


def arrival_offsets(num_requests: int, rate: float, kind: ArrivalKind, seed: int) -> list[float]:
    """Send times in seconds from the start: the first is 0, then gaps of mean 1/rate."""
    if num_requests < 0:
        raise ValueError(f"num_requests must be >= 0, got {num_requests}")
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * num_requests
    if kind is ArrivalKind.FIXED:
        return [i / rate for i in range(num_requests)]
    rng = random.Random(seed)
    offsets, t = [], 0.0
    for _ in range(num_requests):
        offsets.append(t)
        t += rng.expovariate(rate)
    return offsets


async def gather_on_schedule(offsets: list[float], t0: float,
                             start: Callable[[int], Awaitable[T]]) -> list[T]:
    """Start `start(i)` at perf_counter time `t0 + offsets[i]`, await them all in order;
    cancels whatever is still running when interrupted."""
    tasks: list[asyncio.Task] = []
    try:
        for i, offset in enumerate(offsets):
            delay = t0 + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(start(i)))
        return list(await asyncio.gather(*tasks))
    finally:
        for t in tasks:
            t.cancel()
