"""Server selection policies: random, round_robin, power_of_two (least loaded of two random picks)."""

from __future__ import annotations

import abc
import random
from typing import Protocol, Sequence, TypeVar


class Loaded(Protocol):
    @property
    def load(self) -> int: ...


T = TypeVar("T", bound=Loaded)


class Policy(abc.ABC):
    """Picks one server among `candidates` (non-empty, the currently selectable servers of a role).

    A policy keeps only its own small state (a counter, an RNG); it must not block or fail.
    """

    name: str = ""

    @abc.abstractmethod
    def pick(self, candidates: Sequence[T]) -> T:
        ...


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, rng: random.Random):
        self._rng = rng

    def pick(self, candidates):
        return candidates[self._rng.randrange(len(candidates))]


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self, rng: random.Random | None = None):
        self._next = 0

    def pick(self, candidates):
        chosen = candidates[self._next % len(candidates)]
        self._next = (self._next + 1) % (1 << 30)
        return chosen


class PowerOfTwoPolicy(Policy):
    """The less loaded of two distinct random candidates; load = server-reported + router in-flight."""

    name = "power_of_two"

    def __init__(self, rng: random.Random):
        self._rng = rng

    def pick(self, candidates):
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(range(len(candidates)), 2)
        return candidates[a] if candidates[a].load <= candidates[b].load else candidates[b]


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RandomPolicy, RoundRobinPolicy, PowerOfTwoPolicy)}


def make_policy(name: str, rng: random.Random | None = None) -> Policy:
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
    return cls(rng or random.Random())
