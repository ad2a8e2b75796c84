"""What the router knows about each upstream server, and picking a prefill/decode pair from them.

With --dp-aware the pool also picks each server's DP rank: round robin per server, or, for a
`per_rank` policy (cache_aware), the policy itself picks among (server, rank) slots.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from functools import cached_property
from urllib.parse import urlparse

from pdserve.core.config import Role
from pdserve.core.errors import Unavailable

from .config import RouterConfig, ServerSpec
from .health import HealthTracker
from .policies import Policy, RoutingKey

log = logging.getLogger("pdserve.router.upstream")


@dataclass
class Upstream:
    """One prefill or decode server: address, health, DP size and load (reported + our own legs)."""

    url: str
    role: Role
    health: HealthTracker
    bootstrap_port: int | None = None
    dp_size: int = 1
    reported_load: int = 0  # running + waiting requests over its DP workers, from /server_info
    inflight: int = 0  # legs this router has open to it now
    server_info: dict | None = None
    instance_id: str = ""  # from /server_info; a new one means the server restarted (cache gone)
    reported_rank_load: dict[int, int] = field(default_factory=dict)  # DP rank -> running + waiting
    rank_inflight: dict[int, int] = field(default_factory=dict)  # DP rank -> legs open to it (--dp-aware)
    dead_ranks: frozenset[int] = frozenset()
    _next_dp_rank: int = 0
    _slots: list["RankSlot"] = field(default_factory=list)

    @cached_property
    def bootstrap_host(self) -> str:  # asked on every request: parse the URL once
        return urlparse(self.url).hostname or ""

    @property
    def load(self) -> int:
        return self.reported_load + self.inflight

    @property
    def tenant(self) -> str:
        """Its identity in a policy's state (cache_aware's trees)."""
        return self.url

    def rank_load(self, rank: int) -> int:
        return self.reported_rank_load.get(rank, 0) + self.rank_inflight.get(rank, 0)

    def rank_slots(self) -> list["RankSlot"]:
        """One slot per DP rank (kept while dp_size stays the same)."""
        if len(self._slots) != max(1, self.dp_size):
            self._slots = [RankSlot(self, r) for r in range(max(1, self.dp_size))]
        return self._slots

    def next_dp_rank(self) -> int:
        """Round robin over this server's DP ranks."""
        rank = self._next_dp_rank % max(1, self.dp_size)
        self._next_dp_rank = rank + 1
        return rank

    def update_from_server_info(self, info: dict) -> bool:
        """Take DP size, loads and instance id from a /server_info reply; True if the server
        restarted since the last one (another instance_id), so its cache is gone."""
        self.server_info = info
        dp = info.get("dp_size")
        if isinstance(dp, int) and not isinstance(dp, bool) and dp >= 1:
            self.dp_size = dp
        workers = info.get("workers")
        if isinstance(workers, list):
            total, per_rank = 0, {}
            for w in workers:
                if not isinstance(w, dict):
                    continue
                load = int(w.get("running_requests", 0) or 0) + int(w.get("waiting_requests", 0) or 0)
                total += load
                rank = w.get("dp_rank")
                if isinstance(rank, int) and not isinstance(rank, bool):
                    per_rank[rank] = load
            self.reported_load, self.reported_rank_load = total, per_rank
        dead = info.get("dead_workers")
        self.dead_ranks = frozenset(d["dp_rank"] for d in dead if isinstance(d, dict) and isinstance(
            d.get("dp_rank"), int)) if isinstance(dead, list) else frozenset()
        instance = info.get("instance_id")
        restarted = False
        if isinstance(instance, str) and instance:
            restarted = bool(self.instance_id) and instance != self.instance_id
            self.instance_id = instance
        return restarted

    def describe(self) -> dict:
        return {"url": self.url, "role": self.role.value, "bootstrap_port": self.bootstrap_port,
                "health": self.health.state.value, "last_error": self.health.last_error,
                "dp_size": self.dp_size, "load": self.load, "inflight": self.inflight}


class RankSlot:
    """One DP rank of one server, as a candidate of a `per_rank` policy with --dp-aware."""

    __slots__ = ("upstream", "rank", "tenant")

    def __init__(self, upstream: Upstream, rank: int):
        self.upstream, self.rank, self.tenant = upstream, rank, (upstream.url, rank)

    @property
    def load(self) -> int:
        return self.upstream.rank_load(self.rank)


@dataclass(frozen=True)
class Pair:
    prefill: Upstream
    decode: Upstream
    prefill_rank: int | None = None  # DP ranks, set with --dp-aware only
    decode_rank: int | None = None


@dataclass
class UpstreamPool:
    """All upstreams by role; picks a pair with each role's policy among selectable servers."""

    prefill: list[Upstream]
    decode: list[Upstream]
    prefill_policy: Policy
    decode_policy: Policy
    dp_aware: bool = False
    _by_role: dict[Role, list[Upstream]] = field(init=False)

    def __post_init__(self) -> None:
        self._by_role = {Role.PREFILL: self.prefill, Role.DECODE: self.decode}
        self.needs_key = self.prefill_policy.needs_key or self.decode_policy.needs_key

    def policy(self, role: Role) -> Policy:
        return self.prefill_policy if role is Role.PREFILL else self.decode_policy

    @classmethod
    def from_config(cls, cfg: RouterConfig, prefill_policy: Policy, decode_policy: Policy,
                    assume_healthy: bool = False) -> "UpstreamPool":
        def make(spec: ServerSpec, role: Role) -> Upstream:
            tracker = HealthTracker(cfg.health_failure_threshold, cfg.health_success_threshold)
            if assume_healthy:
                tracker.record(True)
            return Upstream(spec.url, role, tracker, spec.bootstrap_port)

        return cls([make(s, Role.PREFILL) for s in cfg.prefill], [make(s, Role.DECODE) for s in cfg.decode],
                   prefill_policy, decode_policy, cfg.dp_aware)

    def all(self) -> list[Upstream]:
        return self.prefill + self.decode

    def selectable(self, role: Role) -> list[Upstream]:
        return [up for up in self._by_role[role] if up.health.selectable]

    def pick(self, role: Role, avoid: frozenset[str] = frozenset(), key: RoutingKey = None) -> Upstream:
        """Pick one selectable server of `role`, avoiding URLs in `avoid` while others remain."""
        return self.pick_target(role, avoid, key)[0]

    def pick_target(self, role: Role, avoid: frozenset[str] = frozenset(), key: RoutingKey = None,
                    exclude: frozenset[str] = frozenset()) -> tuple[Upstream, int | None]:
        """(server, DP rank) of `role`; the rank is None unless the pool is DP-aware. `avoid` is a
        preference, `exclude` a rule (a migrated stream never goes back to a decode that answered
        it with an error)."""
        healthy = [up for up in self.selectable(role) if up.url not in exclude]
        if not healthy:
            states = ", ".join(f"{up.url} {up.health.state.value}" for up in self._by_role[role]
                               if up.url not in exclude)
            other = f" other than {', '.join(sorted(exclude))}" if exclude else ""
            raise Unavailable(f"no healthy {role.value} server{other} ({states or 'none configured'})")
        preferred = [up for up in healthy if up.url not in avoid] or healthy
        policy = self.policy(role)
        if not self.dp_aware:
            return policy.pick(preferred, key), None
        if policy.per_rank:
            slots = [slot for up in preferred for slot in up.rank_slots()]
            slot = policy.pick(slots, key)
            return slot.upstream, slot.rank
        up = policy.pick(preferred, key)
        return up, up.next_dp_rank()

    def pick_pair(self, avoid: frozenset[str] = frozenset(), key: RoutingKey = None,
                  exclude_decodes: frozenset[str] = frozenset()) -> Pair:
        prefill, p_rank = self.pick_target(Role.PREFILL, avoid, key)
        decode, d_rank = self.pick_target(Role.DECODE, avoid, key, exclude_decodes)
        return Pair(prefill, decode, p_rank, d_rank)

    # ---- a server's cache is gone: its policy forgets it ---------------------------------------
    def forget(self, up: Upstream, rank: int | None = None) -> None:
        """`up` left selection, restarted or flushed its cache (or only its DP rank `rank` did)."""
        self.policy(up.role).forget(up.url, rank)

    def update_server_info(self, up: Upstream, info: dict) -> None:
        """Apply a /server_info reply; a restarted server, or DP ranks now dead, lose their state."""
        old_dead = up.dead_ranks
        if up.update_from_server_info(info):
            log.info("%s server %s restarted (instance %s): its cache-aware state is dropped",
                     up.role.value, up.url, up.instance_id)
            self.forget(up)
        for rank in up.dead_ranks - old_dead:
            self.forget(up, rank)

    def first_healthy(self, role: Role) -> Upstream:
        healthy = self.selectable(role)
        if not healthy:
            raise Unavailable(f"no healthy {role.value} server")
        return healthy[0]
