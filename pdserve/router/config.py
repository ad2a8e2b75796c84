"""The router's frozen configuration: which servers it fronts and how it picks, retries and probes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .policies import CacheAwareConfig

POLICY_NAMES = ("random", "round_robin", "power_of_two", "cache_aware")


@dataclass(frozen=True)
class ServerSpec:
    """One upstream server as given on the command line. `bootstrap_port` None means JSON null."""

    url: str
    bootstrap_port: int | None = None


@dataclass(frozen=True)
class RouterConfig:
    prefill: tuple[ServerSpec, ...]
    decode: tuple[ServerSpec, ...]
    host: str = "127.0.0.1"
    port: int = 30000
    prefill_policy: str = "round_robin"
    decode_policy: str = "round_robin"
    request_timeout_secs: float = 1800.0
    max_tries: int = 3
    migration_limit: int = 1  # decode failures after the stream began that move it to another pair
    dp_aware: bool = False
    api_key: str = ""
    health_check_interval_secs: float = 10.0
    health_check_timeout_secs: float = 5.0
    health_failure_threshold: int = 3
    health_success_threshold: int = 1
    health_check_endpoint: str = "/health"
    health_check_enabled: bool = True
    max_payload_size: int = 512 * 1024 * 1024
    prometheus_host: str = ""
    prometheus_port: int = 0
    log_level: str = "info"
    # cache_aware (sglang-router's names and 0.3.2 CLI defaults; see policies.CacheAwareConfig)
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    eviction_interval_secs: float = 60.0
    max_tree_size: int = 2 ** 26
    worker_startup_timeout_secs: float | None = None  # wait for every server at start-up
    extra: dict = field(default_factory=dict)  # accepted-for-compatibility flags, reported only

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("the router needs at least one --prefill and one --decode server")
        for name in (self.prefill_policy, self.decode_policy):
            if name not in POLICY_NAMES:
                raise ValueError(f"unknown policy {name!r}; choose from {', '.join(POLICY_NAMES)}")
        if self.max_tries < 1:
            raise ValueError("--max-retries must be at least 1 (it counts tries)")
        if self.worker_startup_timeout_secs is not None and self.worker_startup_timeout_secs <= 0:
            raise ValueError("--worker-startup-timeout-secs must be positive")
        if self.worker_startup_timeout_secs is not None and not self.health_check_enabled:
            raise ValueError("--worker-startup-timeout-secs waits on health checks: drop --disable-health-check")
        if self.migration_limit < 0:
            raise ValueError("--migration-limit must not be negative (0 = never migrate)")
        if self.health_failure_threshold < 1 or self.health_success_threshold < 1:
            raise ValueError("health thresholds must be at least 1")
        if self.request_timeout_secs <= 0 or self.health_check_interval_secs <= 0:
            raise ValueError("timeouts and intervals must be positive")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError("--cache-threshold must be between 0 and 1")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 0:
            raise ValueError("--balance-abs-threshold and --balance-rel-threshold must not be negative")
        if self.eviction_interval_secs < 0 or self.max_tree_size < 0:
            raise ValueError("--eviction-interval-secs and --max-tree-size must not be negative")

    def cache_aware(self) -> CacheAwareConfig:
        return CacheAwareConfig(self.cache_threshold, self.balance_abs_threshold, self.balance_rel_threshold,
                                self.eviction_interval_secs, self.max_tree_size)

    def describe(self) -> dict:
        """The config as JSON-safe data for /server_info, with the API key hidden."""
        out = asdict(self)
        out["api_key"] = "***" if self.api_key else ""
        return out
