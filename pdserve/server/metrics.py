"""Prometheus metrics of one front, in its own registry (served at GET /metrics)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from .request_state import ItemProgress

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class FrontMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, role: str):
        self.registry = CollectorRegistry()
        labels = ("role",)
        self.requests = Counter("pdserve_requests", "HTTP generation requests", ("role", "route"),
                                registry=self.registry)
        self.errors = Counter("pdserve_request_errors", "requests answered with an error",
                              ("role", "status"), registry=self.registry)
        self.items = Counter("pdserve_items", "request items sent to workers", labels, registry=self.registry)
        self.aborted = Counter("pdserve_items_aborted", "items aborted before finishing", labels,
                               registry=self.registry)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "prompt tokens of finished items", labels,
                                     registry=self.registry)
        self.generation_tokens = Counter("pdserve_generation_tokens", "tokens generated", labels,
                                         registry=self.registry)
        self.running = Gauge("pdserve_running_items", "items in flight", labels, registry=self.registry)
        self.e2e = Histogram("pdserve_e2e_latency_seconds", "item latency, arrival to finish", labels,
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.role = role

    def request(self, route: str) -> None:
        self.requests.labels(self.role, route).inc()

    def error(self, status: int) -> None:
        self.errors.labels(self.role, str(status)).inc()

    def items_started(self, n: int) -> None:
        self.items.labels(self.role).inc(n)
        self.running.labels(self.role).inc(n)

    def item_finished(self, prog: ItemProgress) -> None:
        self.running.labels(self.role).dec()
        self.prompt_tokens.labels(self.role).inc(prog.prompt_tokens)
        self.generation_tokens.labels(self.role).inc(len(prog.output_ids))
        self.e2e.labels(self.role).observe(prog.e2e_latency())

    def item_aborted(self) -> None:
        self.running.labels(self.role).dec()
        self.aborted.labels(self.role).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
