"""Server selection policies: random, round_robin, power_of_two (least loaded of two random picks)
and cache_aware (prefix affinity over an approximate tree of what each server was sent).

A policy picks one of `candidates` (non-empty; the selectable servers of one role, or with
--dp-aware and a `per_rank` policy, one entry per (server, DP rank)). Each candidate has `.load`
(server-reported running + waiting, plus the legs this router has open to it) and `.tenant` (a
hashable identity: the URL, or (URL, rank)). `key` is the request's routing key (pd_body.routing_key:
a str of text or a tuple of token ids, None when the request has none); only policies with
`needs_key` get one. Each role has its own policy instance, so prefill and decode keep their own
state. A policy must not block or fail.
"""

from __future__ import annotations

import abc
import random
from dataclasses import dataclass
from typing import Callable, Hashable, Protocol, Sequence, TypeVar, Union

from .prefix_tree import PrefixTree

RoutingKey = Union[str, tuple, None]


class Loaded(Protocol):
    @property
    def load(self) -> int: ...


T = TypeVar("T", bound=Loaded)


class Policy(abc.ABC):
    """Picks one server among `candidates`. Hooks with no-op defaults let stateful policies drop a
    server's state (`forget`) and do periodic upkeep (`maintain` every `maintenance_interval_s`)."""

    name: str = ""
    needs_key: bool = False  # True: pick() wants the routing key (computed only when some policy does)
    per_rank: bool = False  # True: with --dp-aware, candidates are (server, DP rank) slots
    maintenance_interval_s: float = 0.0  # > 0: call maintain() this often

    @abc.abstractmethod
    def pick(self, candidates: Sequence[T], key: RoutingKey = None) -> T:
        ...

    def forget(self, url: str, rank: int | None = None) -> None:
        """The server at `url` (or only its DP rank `rank`) lost its cache: drop what we know of it."""

    def maintain(self) -> None:
        """Periodic upkeep (cache_aware: eviction)."""


class RandomPolicy(Policy):
    name = "random"

    def __init__(self, rng: random.Random):
        self._rng = rng

    def pick(self, candidates, key=None):
        return candidates[self._rng.randrange(len(candidates))]


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self, rng: random.Random | None = None):
        self._next = 0

    def pick(self, candidates, key=None):
        chosen = candidates[self._next % len(candidates)]
        self._next = (self._next + 1) % (1 << 30)
        return chosen


class PowerOfTwoPolicy(Policy):
    """The less loaded of two distinct random candidates; load = server-reported + router in-flight."""

    name = "power_of_two"

    def __init__(self, rng: random.Random):
        self._rng = rng

    def pick(self, candidates, key=None):
        if len(candidates) == 1:
            return candidates[0]
        a, b = self._rng.sample(range(len(candidates)), 2)
        return candidates[a] if candidates[a].load <= candidates[b].load else candidates[b]


@dataclass(frozen=True)
class CacheAwareConfig:
    """sglang-router's cache-aware knobs, with the defaults of its 0.3.2 CLI (router_args.py)."""

    cache_threshold: float = 0.3  # a match above this ratio of the key's length follows the match
    balance_abs_threshold: int = 64  # imbalanced when max - min load > this ...
    balance_rel_threshold: float = 1.5  # ... and max load > min load * this
    eviction_interval_secs: float = 60.0  # 0: never evict
    max_tree_size: int = 2 ** 26  # per tenant and key space, in characters or token ids


# cache_aware decision outcomes (the `outcome` label of pdserve_router_cache_aware_decisions_total)
MATCHED = "matched"  # prefix match ratio over --cache-threshold: the server holding it
BALANCED = "balanced"  # load imbalanced: the least loaded server
SMALLEST_TREE = "smallest_tree"  # no good match: the server whose tree is smallest (most free cache)
OUTCOMES = (MATCHED, BALANCED, SMALLEST_TREE)


def _server_of(tenant: Hashable) -> str:
    return tenant[0] if isinstance(tenant, tuple) else tenant


class CacheAwarePolicy(Policy):
    """sglang-router's cache_aware: load balance when imbalanced, else follow the longest prefix match
    when it covers more than `cache_threshold` of the key, else the smallest tree; then record the key
    in the chosen server's tree. Text keys and token-id keys live in separate trees."""

    name = "cache_aware"
    needs_key = True
    per_rank = True

    def __init__(self, rng: random.Random | None = None, config: CacheAwareConfig | None = None,
                 on_decision: Callable[[str], None] | None = None):
        self.config = config or CacheAwareConfig()
        self.maintenance_interval_s = float(self.config.eviction_interval_secs)
        self._on_decision = on_decision
        self.text_tree = PrefixTree()
        self.token_tree = PrefixTree()

    def tree_for(self, key: RoutingKey) -> PrefixTree:
        return self.token_tree if isinstance(key, tuple) else self.text_tree

    def pick(self, candidates, key=None):
        chosen, outcome = self.decide(candidates, key)
        if key:
            self.tree_for(key).insert(key, chosen.tenant)
        if self._on_decision is not None:
            self._on_decision(outcome)
        return chosen

    def decide(self, candidates, key: RoutingKey = None):
        """(chosen candidate, outcome) without recording anything."""
        cfg = self.config
        loads = [c.load for c in candidates]
        max_load, min_load = max(loads), min(loads)
        if max_load - min_load > cfg.balance_abs_threshold and max_load > min_load * cfg.balance_rel_threshold:
            return candidates[loads.index(min_load)], BALANCED
        tree = self.tree_for(key)
        if key:
            by_tenant = {c.tenant: c for c in candidates}
            tenant, matched = tree.longest_match(key, by_tenant.keys())
            if tenant is not None and matched / len(key) > cfg.cache_threshold:
                return by_tenant[tenant], MATCHED
        size = tree.size
        best = min(range(len(candidates)), key=lambda i: (size(candidates[i].tenant), loads[i]))
        return candidates[best], SMALLEST_TREE

    def forget(self, url: str, rank: int | None = None) -> None:
        for tree in (self.text_tree, self.token_tree):
            for tenant in tree.tenants():
                if (_server_of(tenant) == url) if rank is None else (tenant == (url, rank)):
                    tree.remove_tenant(tenant)

    def maintain(self) -> None:
        for tree in (self.text_tree, self.token_tree):
            tree.evict(self.config.max_tree_size)


POLICIES: dict[str, type[Policy]] = {p.name: p for p in (RandomPolicy, RoundRobinPolicy, PowerOfTwoPolicy,
                                                          CacheAwarePolicy)}


def make_policy(name: str, rng: random.Random | None = None, *, cache: CacheAwareConfig | None = None,
                on_decision: Callable[[str], None] | None = None) -> Policy:
    """A policy by name; `cache` and `on_decision(outcome)` apply to cache_aware only."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICIES)}") from None
    if cls is CacheAwarePolicy:
        return CacheAwarePolicy(rng, cache, on_decision)
    return cls(rng or random.Random())
