"""`pdserve up`: a PD cluster on this machine (router + one prefill + one decode server).

Starts the three as child processes (each in its own process group, output in a log file:
core/launcher.py), waits until each answers /health, prints the URL and an example request, and stops every
child on Ctrl-C or SIGTERM, start-up included. The children die with `up` however it dies
(core/child_process.py: a parent-death signal), and their DP workers die with them.
`--ask TEXT` sends one chat request through the router, prints only the answer on stdout, and
stops everything.

The router is cache_aware and DP-aware (each turn of a chat goes to the prefill and decode DP
ranks that hold its prefix) with `--balance-abs-threshold 1` (chats sharing a system prompt
spread over the ranks). Every worker gets cores of its own: dp 2 + 2 from 4 cores, dp 1 + 1
below (core/cpu_binding.up_layout). Measured against a colocated server on the same cores by
`pdserve bench up` (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request

from .core.cpu_binding import UP_DP, up_layout
from .core.launcher import ProcessGroup, http_ok, stop_all
from .core.netaddr import host_port, local_connect_host
from .core.pd_vocab import SERVED_BACKENDS
from .router.config import POLICY_NAMES

STOP_GRACE_S = 20.0  # SIGTERM to each front, then SIGKILL to its whole group
UP_BALANCE_ABS_THRESHOLD = 1  # cache_aware balances DP ranks whose loads differ by more than this


def _url(bind_host: str, port: int) -> str:
    """Where this machine reaches a listener bound to bind_host (IPv6 bracketed)."""
    return "http://" + host_port(local_connect_host(bind_host), port)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve up", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000, help="router port")
    p.add_argument("--prefill-port", type=int, default=30001)
    p.add_argument("--decode-port", type=int, default=30002)
    p.add_argument("--bootstrap-port", type=int, default=8998)
    p.add_argument("--prefill-dp", type=int, default=None,
                   help=f"prefill DP workers (default {UP_DP} with at least {2 * UP_DP} cores, else 1)")
    p.add_argument("--decode-dp", type=int, default=None,
                   help=f"decode DP workers (default {UP_DP} with at least {2 * UP_DP} cores, else 1)")
    p.add_argument("--transfer-backend", default="tcp", choices=SERVED_BACKENDS)
    p.add_argument("--max-total-tokens", type=int, default=32768, help="KV pool tokens per worker")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--disable-prefix-cache", "--disable-radix-cache", action="store_true",
                   help="no KV reuse across requests on the prefill and decode servers")
    p.add_argument("--policy", default="cache_aware", choices=POLICY_NAMES,
                   help="the router's server (and, with --dp-aware, DP rank) selection for both roles "
                        "(sglang-router's flag and default)")
    p.add_argument("--prefill-policy", default=None, choices=POLICY_NAMES, help="prefill's own policy")
    p.add_argument("--decode-policy", default=None, choices=POLICY_NAMES, help="decode's own policy")
    p.add_argument("--dp-aware", action=argparse.BooleanOptionalAction, default=True,
                   help="the router picks each server's DP rank (sglang-router's --dp-aware): with "
                        "cache_aware a prompt goes to the rank that holds its prefix (default on; "
                        "--no-dp-aware leaves the rank to each server)")
    p.add_argument("--cache-threshold", type=float, default=None,
                   help="cache_aware: the router's flag (default: the router's, 0.3)")
    p.add_argument("--balance-abs-threshold", type=int, default=UP_BALANCE_ABS_THRESHOLD,
                   help="cache_aware: the router's flag; its default (64) would let every chat that "
                        "shares a system prompt pile onto the first DP rank that saw it while the other "
                        "ranks idle, so here a rank 2 requests busier than another is passed over "
                        "(default %(default)s)")
    p.add_argument("--balance-rel-threshold", type=float, default=None,
                   help="cache_aware: the router's flag (default: the router's, 1.5)")
    p.add_argument("--disagg-local-prefill-max-tokens", type=int, default=0,
                   help="the decode prefills a request itself when at most this many of its prompt tokens "
                        "are missing from its prefix cache (pdserve serve's flag; default 0 = never: on "
                        "one host the decode's core then also does the prefill's work, and the prefill "
                        "starts each such prompt before the drop reaches it)")
    p.add_argument("--prefill-cpu-bind", default="",
                   help="the prefill server's --cpu-bind (per-rank CPU lists like 0|1; default: split below)")
    p.add_argument("--decode-cpu-bind", default="", help="the decode server's --cpu-bind")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", default=None, help="where the children's logs go (default: a new temp dir)")
    p.add_argument("--ask", default=None, help="send this chat message, print the answer, then stop")
    p.add_argument("--max-tokens", type=int, default=64, help="for --ask")
    return p


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived; raised from the handler so that any wait stops at once."""


class StopSignals:
    """SIGINT/SIGTERM raise Interrupted, except inside `deferred()` (a child being spawned and
    recorded), where they are raised at its end. After the first one both are ignored, so the
    clean-up that follows runs to its end."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self._depth = 0
        self._pending: int | None = None

    def install(self) -> None:
        for sig in self.SIGNALS:
            signal.signal(sig, self._handle)

    def ignore(self) -> None:
        for sig in self.SIGNALS:
            signal.signal(sig, signal.SIG_IGN)

    def _handle(self, signum, frame) -> None:
        if self._depth:
            self._pending = signum
            return
        self.ignore()
        raise Interrupted(signal.Signals(signum).name)

    @contextlib.contextmanager
    def deferred(self):
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth and self._pending is not None:
                self._handle(self._pending, None)


def _post(url: str, body: dict, timeout: float = 300.0) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"POST {url} -> {e.code}: {e.read().decode(errors='replace')[:1000]}") from None


class Cluster:
    """The child processes, started in order and stopped in reverse order."""

    def __init__(self, a: argparse.Namespace, model_dir: str, log_dir: str, signals: StopSignals):
        self.a = a
        self.signals = signals
        self.model_dir = model_dir
        self.log_dir = log_dir
        self.groups: list[ProcessGroup] = []
        self.prefill_dp, self.decode_dp, p_cpus, d_cpus = up_layout(a.prefill_dp, a.decode_dp)
        self.prefill_cpus, self.decode_cpus = a.prefill_cpu_bind or p_cpus, a.decode_cpu_bind or d_cpus

    def _spawn(self, name: str, args: list[str]) -> None:
        cmd = [sys.executable, "-m", "pdserve", *args]
        with self.signals.deferred():  # SIGTERM to the front alone: it stops its own workers
            self.groups.append(ProcessGroup(cmd, name=name, log_path=os.path.join(self.log_dir, f"{name}.log"),
                                            term_group=False, die_with_parent=True))  # from the main thread

    def start(self) -> None:
        a = self.a
        common = ["--model", self.model_dir, "--host", a.host, "--transfer-backend", a.transfer_backend,
                  "--max-total-tokens", str(a.max_total_tokens), "--dtype", a.dtype]
        if a.disable_prefix_cache:
            common.append("--disable-prefix-cache")
        local = ["--disagg-local-prefill-max-tokens", str(a.disagg_local_prefill_max_tokens)] \
            if a.disagg_local_prefill_max_tokens else []
        self._spawn("prefill", ["serve", "--role", "prefill", "--port", str(a.prefill_port),
                                "--dp-size", str(self.prefill_dp), "--bootstrap-port", str(a.bootstrap_port),
                                "--cpu-bind", self.prefill_cpus, *common])
        self._spawn("decode", ["serve", "--role", "decode", "--port", str(a.decode_port),
                               "--dp-size", str(self.decode_dp), "--cpu-bind", self.decode_cpus, *local, *common])
        self._wait(_url(a.host, a.prefill_port) + "/health", "prefill")
        self._wait(_url(a.host, a.decode_port) + "/health", "decode")
        self._spawn("router", ["router", "--pd-disaggregation", "--host", a.host, "--port", str(a.port),
                               "--prefill", _url(a.host, a.prefill_port), str(a.bootstrap_port),
                               "--decode", _url(a.host, a.decode_port), *self.router_policy_args()])
        self._wait(_url(a.host, a.port) + "/health", "router")

    def router_policy_args(self) -> list[str]:
        a = self.a
        args = ["--policy", a.policy]
        for flag, value in (("--prefill-policy", a.prefill_policy), ("--decode-policy", a.decode_policy),
                            ("--cache-threshold", a.cache_threshold),
                            ("--balance-abs-threshold", a.balance_abs_threshold),
                            ("--balance-rel-threshold", a.balance_rel_threshold)):
            if value is not None:
                args += [flag, str(value)]
        return args + (["--dp-aware"] if a.dp_aware else [])

    def _wait(self, url: str, name: str) -> None:
        """Until `url` answers; a child that exits meanwhile, or the deadline, is a RuntimeError."""
        group = next(g for g in self.groups if g.name == name)

        def healthy() -> bool:
            self.check_alive()
            return http_ok(url)
        group.wait_healthy(healthy, self.a.start_timeout, what=url, poll_s=0.5)

    def check_alive(self) -> None:
        for g in self.groups:
            g.check_running()

    def stop(self) -> None:
        """SIGTERM each child (router first), wait up to STOP_GRACE_S, then SIGKILL its whole
        group (its workers too)."""
        self.signals.ignore()
        stop_all(reversed(self.groups), STOP_GRACE_S)


def main(argv: list[str] | None = None) -> None:
    a = build_parser().parse_args(argv)
    from .core.envs import Envs
    from .model_files.resolve import ModelNotFound, resolve_model

    try:
        model_dir = resolve_model(a.model, Envs.read().cache_dir)  # convert once here, not in each child
    except ModelNotFound as e:
        sys.exit(f"pdserve up: {e}")
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="pdserve-up-")
    os.makedirs(log_dir, exist_ok=True)
    signals = StopSignals()
    cluster = Cluster(a, model_dir, log_dir, signals)
    signals.install()
    url = _url(a.host, a.port)
    print(f"pdserve up: starting router + prefill (dp {cluster.prefill_dp}, cores {cluster.prefill_cpus}) + decode "
          f"(dp {cluster.decode_dp}, cores {cluster.decode_cpus}); logs in {log_dir}", file=sys.stderr, flush=True)
    try:
        cluster.start()
        example = {"messages": [{"role": "user", "content": a.ask or "What is the capital of France?"}],
                   "max_tokens": a.max_tokens, "temperature": 0}
        if a.ask is not None:
            reply = _post(f"{url}/v1/chat/completions", example)
            print(reply["choices"][0]["message"]["content"], flush=True)
            return
        print(f"pdserve is up: router {url}  (prefill :{a.prefill_port} dp={cluster.prefill_dp}, "
              f"decode :{a.decode_port} dp={cluster.decode_dp}; logs in {log_dir})\n"
              f"try:\n  curl {url}/v1/chat/completions "
              f"-H 'Content-Type: application/json' -d '{json.dumps(example)}'", flush=True)
        while True:
            cluster.check_alive()
            time.sleep(0.5)
    except Interrupted as e:
        print(f"pdserve up: {e}, stopping", file=sys.stderr, flush=True)
    except RuntimeError as e:
        print(f"pdserve up: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        cluster.stop()
