"""What the router knows about each upstream server, and picking a prefill/decode pair from them."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from urllib.parse import urlparse

from pdserve.core.config import Role
from pdserve.core.errors import Unavailable

from .config import RouterConfig, ServerSpec
from .health import HealthTracker
from .policies import Policy


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
    _next_dp_rank: int = 0

    @cached_property
    def bootstrap_host(self) -> str:  # asked on every request: parse the URL once
        return urlparse(self.url).hostname or ""

    @property
    def load(self) -> int:
        return self.reported_load + self.inflight

    def next_dp_rank(self) -> int:
        """Round robin over this server's DP ranks."""
        rank = self._next_dp_rank % max(1, self.dp_size)
        self._next_dp_rank = rank + 1
        return rank

    def update_from_server_info(self, info: dict) -> None:
        self.server_info = info
        dp = info.get("dp_size")
        if isinstance(dp, int) and not isinstance(dp, bool) and dp >= 1:
            self.dp_size = dp
        workers = info.get("workers")
        if isinstance(workers, list):
            self.reported_load = sum(
                int(w.get("running_requests", 0) or 0) + int(w.get("waiting_requests", 0) or 0)
                for w in workers if isinstance(w, dict))

    def describe(self) -> dict:
        return {"url": self.url, "role": self.role.value, "bootstrap_port": self.bootstrap_port,
                "health": self.health.state.value, "last_error": self.health.last_error,
                "dp_size": self.dp_size, "load": self.load, "inflight": self.inflight}


@dataclass(frozen=True)
class Pair:
    prefill: Upstream
    decode: Upstream


@dataclass
class UpstreamPool:
    """All upstreams by role; picks a pair with each role's policy among selectable servers."""

    prefill: list[Upstream]
    decode: list[Upstream]
    prefill_policy: Policy
    decode_policy: Policy
    _by_role: dict[Role, list[Upstream]] = field(init=False)

    def __post_init__(self) -> None:
        self._by_role = {Role.PREFILL: self.prefill, Role.DECODE: self.decode}

    @classmethod
    def from_config(cls, cfg: RouterConfig, prefill_policy: Policy, decode_policy: Policy,
                    assume_healthy: bool = False) -> "UpstreamPool":
        def make(spec: ServerSpec, role: Role) -> Upstream:
            tracker = HealthTracker(cfg.health_failure_threshold, cfg.health_success_threshold)
            if assume_healthy:
                tracker.record(True)
            return Upstream(spec.url, role, tracker, spec.bootstrap_port)

        return cls([make(s, Role.PREFILL) for s in cfg.prefill], [make(s, Role.DECODE) for s in cfg.decode],
                   prefill_policy, decode_policy)

    def all(self) -> list[Upstream]:
        return self.prefill + self.decode

    def selectable(self, role: Role) -> list[Upstream]:
        return [up for up in self._by_role[role] if up.health.selectable]

    def pick(self, role: Role, avoid: frozenset[str] = frozenset()) -> Upstream:
        """Pick one selectable server of `role`, avoiding URLs in `avoid` while others remain."""
        healthy = self.selectable(role)
        if not healthy:
            states = ", ".join(f"{up.url} {up.health.state.value}" for up in self._by_role[role])
            raise Unavailable(f"no healthy {role.value} server ({states})")
        preferred = [up for up in healthy if up.url not in avoid] or healthy
        policy = self.prefill_policy if role is Role.PREFILL else self.decode_policy
        return policy.pick(preferred)

    def pick_pair(self, avoid: frozenset[str] = frozenset()) -> Pair:
        return Pair(self.pick(Role.PREFILL, avoid), self.pick(Role.DECODE, avoid))

    def first_healthy(self, role: Role) -> Upstream:
        healthy = self.selectable(role)
        if not healthy:
            raise Unavailable(f"no healthy {role.value} server")
        return healthy[0]
