"""`pdserve router` flags, spelled like sglang-router's PD mode, and their translation to RouterConfig.

`--pd-disaggregation` and `--mini-lb` describe what this router always is (PD; batched `text`
lists sent as lists of rooms, as sglang's mini load balancer does), so they are accepted and
change nothing; `--worker-startup-timeout-secs` makes start-up wait for every server.
"""

from __future__ import annotations

import argparse
from urllib.parse import urlparse

from .config import POLICY_NAMES, RouterConfig, ServerSpec
from .policies import CacheAwareConfig

_POLICY_CHOICES = POLICY_NAMES
_CACHE = CacheAwareConfig()


class _PrefillAction(argparse.Action):
    """`--prefill URL [BOOTSTRAP_PORT|none]`, repeatable."""

    def __call__(self, parser, namespace, values, option_string=None):
        if not 1 <= len(values) <= 2:
            parser.error(f"{option_string} takes URL [BOOTSTRAP_PORT|none], got {values}")
        port: int | None = None
        if len(values) == 2 and values[1].lower() not in ("none", "null"):
            try:
                port = int(values[1])
            except ValueError:
                parser.error(f"{option_string} {values[0]}: bootstrap port {values[1]!r} is not a number or 'none'")
            if not 0 < port < 65536:
                parser.error(f"{option_string} {values[0]}: bootstrap port {port} out of range")
        specs = list(getattr(namespace, self.dest) or [])
        specs.append(ServerSpec(_check_url(parser, values[0]), port))
        setattr(namespace, self.dest, specs)


class _DecodeAction(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        specs = list(getattr(namespace, self.dest) or [])
        specs.append(ServerSpec(_check_url(parser, values)))
        setattr(namespace, self.dest, specs)


def _check_url(parser: argparse.ArgumentParser, url: str) -> str:
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        parser.error(f"server URL {url!r} must look like http://HOST:PORT")
    return url.rstrip("/")


def build_router_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the router's flags to `parser` (a new one when None) and return it."""
    p = parser or argparse.ArgumentParser(prog="pdserve router", description="PD disaggregation router")
    p.add_argument("--prefill", nargs="+", action=_PrefillAction, default=[], metavar="URL [BOOTSTRAP_PORT]",
                   help="prefill server URL and its bootstrap port ('none' or omitted = the default 8998)")
    p.add_argument("--decode", action=_DecodeAction, default=[], metavar="URL", help="decode server URL")
    p.add_argument("--host", default="127.0.0.1", help="bind address")
    p.add_argument("--port", type=int, default=30000, help="bind port (0 = any free port)")
    p.add_argument("--policy", choices=_POLICY_CHOICES, default="round_robin",
                   help="server selection for both roles (default round_robin; sglang-router's is cache_aware)")
    p.add_argument("--prefill-policy", choices=_POLICY_CHOICES, default=None, help="prefill's own policy")
    p.add_argument("--decode-policy", choices=_POLICY_CHOICES, default=None, help="decode's own policy")
    p.add_argument("--cache-threshold", type=float, default=_CACHE.cache_threshold,
                   help="cache_aware: follow the longest prefix match when it covers more than this share "
                        "of the request (0.0-1.0, default %(default)s); else the server with the smallest tree")
    p.add_argument("--balance-abs-threshold", type=int, default=_CACHE.balance_abs_threshold,
                   help="cache_aware: load is imbalanced (pick the least loaded) when max - min load > this "
                        "(default %(default)s) and max > min * --balance-rel-threshold")
    p.add_argument("--balance-rel-threshold", type=float, default=_CACHE.balance_rel_threshold,
                   help="cache_aware: see --balance-abs-threshold (default %(default)s)")
    p.add_argument("--eviction-interval-secs", type=float, default=_CACHE.eviction_interval_secs,
                   help="cache_aware: seconds between LRU evictions of the prefix trees "
                        "(default %(default)s; 0 = never)")
    p.add_argument("--max-tree-size", type=int, default=_CACHE.max_tree_size,
                   help="cache_aware: eviction bound per server tree, in characters or token ids "
                        "(default %(default)s = 2**26)")
    p.add_argument("--request-timeout-secs", type=float, default=1800.0, help="total deadline per request")
    p.add_argument("--max-retries", "--retry-max-retries", dest="max_retries", type=int, default=3,
                   help="tries per request (connection failures before streaming move to another pair)")
    p.add_argument("--disable-retries", action="store_true", help="one try per request")
    p.add_argument("--migration-limit", type=int, default=1,
                   help="times one request may move to another (prefill, decode) pair when its decode "
                        "fails after the stream began: prompt + tokens so far, the rest of the budget "
                        "(Dynamo's name; default %(default)s, 0 = never; docs/reliability.md)")
    p.add_argument("--dp-aware", action="store_true",
                   help="pick each server's DP rank here and send routed_dp_rank / disagg_prefill_dp_rank")
    p.add_argument("--api-key", default="", help="require this Bearer token on every route but /health")
    p.add_argument("--pd-disaggregation", action="store_true", help="accepted (always PD)")
    p.add_argument("--mini-lb", action="store_true",
                   help="accepted: this router always does what sglang's mini LB does (PD; batched text lists)")
    p.add_argument("--health-check-interval-secs", type=float, default=10.0)
    p.add_argument("--health-check-timeout-secs", type=float, default=5.0)
    p.add_argument("--health-failure-threshold", type=int, default=3,
                   help="consecutive failed checks before a server leaves selection")
    p.add_argument("--health-success-threshold", type=int, default=1,
                   help="consecutive passed checks before a removed server returns")
    p.add_argument("--health-check-endpoint", default="/health")
    p.add_argument("--disable-health-check", action="store_true", help="treat every server as healthy")
    p.add_argument("--max-payload-size", type=int, default=512 * 1024 * 1024, help="max request body bytes")
    p.add_argument("--prometheus-host", default="", help="also serve /metrics on this host")
    p.add_argument("--prometheus-port", type=int, default=0, help="also serve /metrics on this port")
    p.add_argument("--worker-startup-timeout-secs", type=float, default=None,
                   help="at start-up, wait this long for every server to pass a health check, then exit "
                        "naming those that did not (default: no wait; servers join when healthy)")
    p.add_argument("--log-level", choices=("debug", "info", "warn", "warning", "error"), default="info")
    return p


def config_from_args(args: argparse.Namespace) -> RouterConfig:
    """Turn parsed flags into a RouterConfig (raises ValueError on an inconsistent set)."""
    def policy(name: str | None) -> str:
        return name or args.policy

    extra = {k: getattr(args, k) for k in ("pd_disaggregation", "mini_lb")}
    return RouterConfig(
        prefill=tuple(args.prefill),
        decode=tuple(args.decode),
        host=args.host,
        port=args.port,
        prefill_policy=policy(args.prefill_policy),
        decode_policy=policy(args.decode_policy),
        request_timeout_secs=args.request_timeout_secs,
        max_tries=1 if args.disable_retries else args.max_retries,
        migration_limit=args.migration_limit,
        dp_aware=args.dp_aware,
        api_key=args.api_key,
        health_check_interval_secs=args.health_check_interval_secs,
        health_check_timeout_secs=args.health_check_timeout_secs,
        health_failure_threshold=args.health_failure_threshold,
        health_success_threshold=args.health_success_threshold,
        health_check_endpoint=args.health_check_endpoint,
        health_check_enabled=not args.disable_health_check,
        max_payload_size=args.max_payload_size,
        prometheus_host=args.prometheus_host,
        prometheus_port=args.prometheus_port,
        log_level="warning" if args.log_level == "warn" else args.log_level,
        cache_threshold=args.cache_threshold,
        balance_abs_threshold=args.balance_abs_threshold,
        balance_rel_threshold=args.balance_rel_threshold,
        eviction_interval_secs=args.eviction_interval_secs,
        max_tree_size=args.max_tree_size,
        worker_startup_timeout_secs=args.worker_startup_timeout_secs,
        extra=extra,
    )
