"""Prometheus metrics of one router instance (its own registry; labels never hold room ids;
`server` is an upstream URL from the router's configuration, so the label set stays bounded).
docs/observability.md lists every series."""

from __future__ import annotations

from typing import Callable

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()  # no `_created` series: Prometheus derives resets itself

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300,
                    600, 1800)


class RouterMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("pdserve_router_requests", "client requests by route and HTTP status",
                                ["route", "status"], registry=r)
        self.request_latency = Histogram("pdserve_router_request_duration_seconds",
                                         "client request duration, to the last byte", ["route"],
                                         buckets=_LATENCY_BUCKETS, registry=r)
        self.upstream_latency = Histogram("pdserve_router_upstream_latency_seconds",
                                          "duration of one leg to its last byte", ["role", "server"],
                                          buckets=_LATENCY_BUCKETS, registry=r)
        self.upstream_errors = Counter("pdserve_router_upstream_errors", "failed legs by role and kind",
                                       ["role", "server", "kind"], registry=r)
        self.retries = Counter("pdserve_router_retries", "tries repeated on another pair", ["reason"], registry=r)
        self.migrations = Counter(
            "pdserve_router_migrations",
            "decode failures and what became of them: started (a continuation sent to another pair), "
            "succeeded / failed (a migrated request's end), limit_reached (--migration-limit used up), "
            "unsupported (the request cannot move: see docs/reliability.md)", ["outcome"], registry=r)
        self.cancelled_legs = Counter("pdserve_router_cancelled_legs", "legs cancelled by the router",
                                      ["role", "reason"], registry=r)
        self.upstream_healthy = Gauge("pdserve_router_upstream_healthy", "1 while a server is selectable",
                                      ["role", "server"], registry=r)
        self.upstream_inflight = Gauge("pdserve_router_upstream_inflight", "legs open to a server",
                                       ["role", "server"], registry=r)
        self.cache_aware_decisions = Counter(
            "pdserve_router_cache_aware_decisions",
            "cache_aware picks by role and outcome: matched (prefix match over --cache-threshold), "
            "balanced (load imbalanced: least loaded), smallest_tree (no good match: most free cache)",
            ["role", "outcome"], registry=r)

    def cache_aware_recorder(self, role: str) -> Callable[[str], None]:
        """`record(outcome)` for one role's cache_aware policy (label children resolved once)."""
        children: dict = {}

        def record(outcome: str) -> None:
            child = children.get(outcome)
            if child is None:
                child = children[outcome] = self.cache_aware_decisions.labels(role, outcome)
            child.inc()

        return record

    def render(self) -> bytes:
        return generate_latest(self.registry)
