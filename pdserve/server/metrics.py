"""Prometheus metrics of one server front, in its own registry (served at GET /metrics).

Every series carries `role`; labels are bounded (dp_rank, status, reason, path, cause, state),
never a room or rid. Per-item facts are counted when the item finishes, from what the front
saw and what its worker reported in the item's outputs (meta, timeline); per-rank gauges are
refreshed from the workers' stats at scrape time. docs/observability.md lists every series.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..core.failures import CONFLICT_PREFIX, FailureCause, cause_of_error
from ..core.messages import WorkerStats
from ..core.timeline import Stage
from .request_state import ItemProgress

disable_created_metrics()  # no `_created` series: Prometheus derives resets itself

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)
STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)
BYTES_BUCKETS = tuple(4096 * 4 ** i for i in range(12))  # 4 KiB .. 16 GiB
SPEED_BUCKETS = (1e6, 1e7, 5e7, 1e8, 2.5e8, 5e8, 1e9, 2.5e9, 5e9, 1e10, 2.5e10, 5e10, 1e11)
# worker meta key -> the handoff histogram it feeds (each role reports its own keys)
HANDOFF_SECONDS = {"prefill_bootstrapping_s": "bootstrap", "bootstrap_s": "bootstrap",
                   "prealloc_wait_s": "prealloc", "resolve_s": "resolve", "kv_transfer_s": "transfer"}
RANK_GAUGES = {  # WorkerStats field (or extra key) -> gauge name, help
    "running_requests": ("pdserve_worker_running_requests", "requests in the engine's running batch"),
    "waiting_requests": ("pdserve_worker_waiting_requests", "requests waiting in the engine's queue"),
    "preallocated_requests": ("pdserve_worker_preallocated_requests",
                              "PD rooms holding KV pages for a handoff (decode: reserved, prefill: prefilled)"),
    "inflight_transfers": ("pdserve_worker_inflight_transfers", "PD rooms in any handoff state"),
    "queued_handoffs": ("pdserve_worker_queued_handoffs",
                        "decode: handoffs waiting in the admission queue for KV pages"),
    "total_pages": ("pdserve_kv_pages_total", "KV pool pages"),
    "free_pages": ("pdserve_kv_pages_free", "free KV pool pages"),
    "cached_pages": ("pdserve_kv_pages_cached", "KV pool pages held only by the prefix cache"),
}


CACHE_COUNTERS = {  # the workers' prefix_cache stats key -> counter name, help
    "queried_tokens": ("pdserve_prefix_cache_queried_tokens", "prompt tokens looked up in the prefix cache"),
    "hit_tokens": ("pdserve_prefix_cache_hit_tokens", "prompt tokens whose KV the prefix cache held"),
    "evicted_pages": ("pdserve_prefix_cache_evicted_pages", "cached KV pages evicted to make room"),
}


class _WorkerCounters:
    """Counters kept by the workers themselves (cumulative since each worker started), exported
    as the last values seen; a restarted worker starts again from 0, as Prometheus expects."""

    def __init__(self, role: str):
        self.role = role
        self.last: dict[int, dict] = {}  # dp_rank -> the worker's prefix_cache stats

    def collect(self):
        for key, (name, doc) in CACHE_COUNTERS.items():
            fam = CounterMetricFamily(name, doc, labels=("role", "dp_rank"))
            for rank, c in sorted(self.last.items()):
                fam.add_metric((self.role, str(rank)), c.get(key, 0))
            yield fam


class FrontMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, role: str, instance_id: str = "", version: str = ""):
        self.role = role
        r = self.registry = CollectorRegistry()
        R, RD = ("role",), ("role", "dp_rank")

        def counter(name, doc, labels=R):
            return Counter(name, doc, labels, registry=r)

        def hist(name, doc, buckets):
            return Histogram(name, doc, R, buckets=buckets, registry=r).labels(role)

        Gauge("pdserve_server_info", "1, labelled with this server's role, instance id and version",
              ("role", "instance_id", "version"), registry=r).labels(role, instance_id, version).set(1)
        self.http = counter("pdserve_http_requests", "HTTP requests by route and status", ("role", "route", "status"))
        self.items = counter("pdserve_items", "request items sent to DP workers").labels(role)
        self.dispatch = counter("pdserve_dispatch", "items dispatched, by DP rank and why",
                                ("role", "dp_rank", "reason"))
        self.finished = counter("pdserve_items_finished", "items finished, by finish reason",
                                ("role", "finish_reason"))
        self.failures = counter("pdserve_request_failures", "items that failed, by cause", ("role", "cause"))
        self.conflicts = counter("pdserve_dp_rank_conflicts", "follow_bootstrap_room conflicts rejected").labels(role)
        self.admission_refused = counter(
            "pdserve_admission_refused", "items refused with 429 by admission control, by why: decode "
            "queue_full or timeout (no KV pages in time), prefill held_tokens (--max-held-prefill-tokens)",
            ("role", "reason"))
        self.resolutions = counter("pdserve_dp_rank_resolutions",
                                   "prefill DP ranks resolved by this decode, by path", ("role", "path"))
        self.pd_decisions = counter("pdserve_disagg_decisions",
                                    "PD requests by where the prompt was prefilled: remote (the prefill), "
                                    "local (this decode, conditional disaggregation), dropped (prefill: "
                                    "its decode took it)", ("role", "decision"))
        self.kv_pages = counter("pdserve_handoff_kv_pages",
                                "decode: prompt KV pages per handoff, reused from its own prefix cache or "
                                "transferred from the prefill", ("role", "kind"))
        self.prompt_tokens = counter("pdserve_prompt_tokens", "prompt tokens of finished items").labels(role)
        self.generation_tokens = counter("pdserve_generation_tokens", "tokens generated").labels(role)
        self.running = Gauge("pdserve_running_items", "items in flight at this front", R, registry=r).labels(role)
        self.ttft = hist("pdserve_time_to_first_token_seconds", "arrival to first token", LATENCY_BUCKETS)
        self.itl = hist("pdserve_inter_token_latency_seconds", "time between output tokens", ITL_BUCKETS)
        self.e2e = hist("pdserve_e2e_request_latency_seconds", "item latency, arrival to finish", LATENCY_BUCKETS)
        self.queue = hist("pdserve_queue_time_seconds", "in the engine before its first forward step", STAGE_BUCKETS)
        self.handoff_seconds = {
            "bootstrap": hist("pdserve_handoff_bootstrap_wait_seconds",
                              "prefill: waiting for the decode's metadata; decode: arrival to metadata sent",
                              STAGE_BUCKETS),
            "prealloc": hist("pdserve_handoff_prealloc_wait_seconds", "decode: rank resolved to KV pages reserved",
                             STAGE_BUCKETS),
            "resolve": hist("pdserve_handoff_rank_resolution_seconds",
                            "decode: topology, prefill DP rank and endpoint lookup", STAGE_BUCKETS),
            "transfer": hist("pdserve_kv_transfer_seconds", "KV page write, first byte moving to last",
                             STAGE_BUCKETS),
        }
        self.kv_bytes = hist("pdserve_kv_transfer_bytes", "KV bytes moved per request", BYTES_BUCKETS)
        self.kv_speed = hist("pdserve_kv_transfer_throughput_bytes_per_second",
                             "bytes over the write's own time, per transfer", SPEED_BUCKETS)
        self.worker_up = Gauge("pdserve_worker_up", "1 while the DP worker process is alive", RD, registry=r)
        self.rank_gauges = {k: Gauge(n, d, RD, registry=r) for k, (n, d) in RANK_GAUGES.items()}
        self.handoff_rooms = Gauge("pdserve_handoff_rooms", "PD rooms by handoff state", ("role", "dp_rank", "state"),
                                   registry=r)
        self._states_seen: set[str] = set()
        self.worker_counters = _WorkerCounters(role)
        r.register(self.worker_counters)

    # ---- the request path ------------------------------------------------------------------
    def http_request(self, route: str, status: int) -> None:
        self.http.labels(self.role, route, str(status)).inc()

    def dispatched(self, dp_rank: int, reason: str) -> None:
        self.dispatch.labels(self.role, str(dp_rank), reason).inc()

    def rejected(self, error: BaseException, n_items: int) -> None:
        """Items refused before any was sent to a worker (bad input, DP-rank conflict)."""
        message = getattr(error, "message", "") or str(error)
        if getattr(error, "admission_refused", None):  # pd_roles.HeldTokensFull
            self.admission_refused.labels(self.role, error.admission_refused).inc(n_items)
        if CONFLICT_PREFIX in message:
            self.conflicts.inc()
            cause = FailureCause.CONFLICT
        else:
            cause = cause_of_error(getattr(error, "type", ""), getattr(error, "status", 500), None)
        self.failures.labels(self.role, cause.value).inc(n_items)

    def items_started(self, n: int) -> None:
        self.items.inc(n)
        self.running.inc(n)

    def tokens_arrived(self, prog: ItemProgress, n_new: int, prev_token_at: float | None) -> None:
        """`n_new` tokens just reached `prog`; the previous ones had arrived at `prev_token_at`.
        Every token after an item's first adds one inter-token observation."""
        if n_new <= 0:
            return
        if prev_token_at is None:
            self.ttft.observe(prog.first_token_at - prog.arrival)
            for _ in range(n_new - 1):
                self.itl.observe(0.0)  # arrived together with the first
            return
        gap = (prog.last_token_at - prev_token_at) / n_new
        for _ in range(n_new):
            self.itl.observe(gap)

    def item_finished(self, prog: ItemProgress) -> None:
        self.running.dec()
        self.prompt_tokens.inc(prog.prompt_tokens)
        self.generation_tokens.inc(len(prog.output_ids))
        self.e2e.observe(prog.e2e_latency())
        meta, stages = prog.meta, prog.stages
        if prog.error is not None:
            if meta.get("admission") == "refused":
                self.admission_refused.labels(self.role, str(meta.get("admission_refused", ""))).inc()
            cause = cause_of_error(prog.error.type, prog.error.status, meta.get("failure_cause"))
            self.failures.labels(self.role, cause.value).inc()
            reason = "abort" if cause is FailureCause.ABORTED else "error"
        else:
            reason = str((prog.finish_reason or {}).get("type", "stop"))
        self.finished.labels(self.role, reason).inc()
        queued, scheduled = stages.get(Stage.QUEUED.value), stages.get(Stage.SCHEDULED.value)
        if queued and scheduled:
            self.queue.observe(max(0.0, scheduled - queued))
        self.handoff(meta)

    def handoff(self, meta: dict) -> None:
        """Handoff facts a worker reported for one item (either role reports its own keys)."""
        for key, name in HANDOFF_SECONDS.items():
            v = meta.get(key)
            if isinstance(v, (int, float)):
                self.handoff_seconds[name].observe(v)
        if meta.get("dp_rank_path"):
            self.resolutions.labels(self.role, str(meta["dp_rank_path"])).inc()
        if meta.get("disaggregation") in ("local", "dropped"):
            self.pd_decisions.labels(self.role, meta["disaggregation"]).inc()
        elif meta.get("dp_rank_path") or meta.get("prefill_dp_rank") is not None:
            self.pd_decisions.labels(self.role, "remote").inc()
        for kind in ("reused", "transferred"):
            pages = meta.get(f"kv_{kind}_pages")
            if isinstance(pages, int) and pages:
                self.kv_pages.labels(self.role, kind).inc(pages)
        nbytes, secs = meta.get("kv_bytes"), meta.get("kv_transfer_s")
        if isinstance(nbytes, int):
            self.kv_bytes.observe(nbytes)
            if isinstance(secs, (int, float)) and secs > 0:
                self.kv_speed.observe(nbytes / secs)

    def item_aborted(self) -> None:
        """An item the front gave up on before it finished (client gone, error elsewhere)."""
        self.running.dec()
        self.failures.labels(self.role, FailureCause.ABORTED.value).inc()
        self.finished.labels(self.role, "abort").inc()

    # ---- scrape time -----------------------------------------------------------------------
    def worker_stats(self, stats: list[WorkerStats]) -> None:
        for s in stats:
            rank = str(s.dp_rank)
            for key, gauge in self.rank_gauges.items():
                v = getattr(s, key, None)
                if v is None:
                    v = s.extra.get(key, 0)
                gauge.labels(self.role, rank).set(v)
            if isinstance(s.extra.get("prefix_cache"), dict):
                self.worker_counters.last[s.dp_rank] = s.extra["prefix_cache"]
            states = s.extra.get("handoff_states") or {}
            self._states_seen.update(states)
            for state in self._states_seen:
                self.handoff_rooms.labels(self.role, rank, state).set(states.get(state, 0))

    def worker_liveness(self, dp_size: int, dead: dict[int, str]) -> None:
        for rank in range(dp_size):
            self.worker_up.labels(self.role, str(rank)).set(0 if rank in dead else 1)

    def render(self) -> bytes:
        return generate_latest(self.registry)
