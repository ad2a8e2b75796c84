"""Across hosts: router, prefills and decodes each in its own network namespace on a bridge the
test makes (tests/harness/netns.py), so every byte between them crosses a veth, and nothing is on loopback.

The servers exercise bind vs advertise: the tcp prefill binds `::` and advertises its IPv6
address (the router reaches it over IPv6), the tcp decode binds its IPv4 address, the mooncake
prefill binds its IPv4 address (issue 18's `--host 127.0.0.2` case: its workers must register at
the bound address), the mooncake decode binds 0.0.0.0 and advertises its only address; the nixl
pair binds its IPv4 addresses with UCX held to its TCP transport (else UCX would move the pages
between namespaces of one kernel through memory, never over the veth). Greedy output through our
router (for every backend) and through sglang-router, each in its own namespace, equals a
colocated server's. Then the network faults: delay and loss on the pages' path (a test-owned TCP
proxy the tcp decode advertises, pdserve/bench/tcp_proxy.py), a bandwidth cap (tc tbf), the prefill cut off
(its veth down) while its room prefills (the decode's heartbeat fails it) or while its pages
move (both legs fail within their deadlines), healed after: pages freed on both sides, the next
requests succeed; the pages of a room the decode gave up while the prefill was cut off stay held
(quarantined) until the healed prefill has answered. Skipped where namespaces cannot be made.
"""

from __future__ import annotations

import os
import random
import signal
import sys
import time
import types

import httpx
import pytest

from pdserve.bench.tcp_proxy import TcpProxy  # noqa: E402
from pdserve.core.launcher import free_port  # noqa: E402
from pdserve.transfer.mooncake import import_problem as mooncake_problem  # noqa: E402
from pdserve.transfer.nixl import import_problem as nixl_problem  # noqa: E402
from tests.harness import netns  # noqa: E402
from tests.harness.cluster import (  # noqa: E402
    ROOT,
    GenerateProbe,
    Server,
)
from tests.harness.fault_tools import (  # noqa: E402
    KnobServer,
    error_of,
    flush_cache,
    prefilling,
    shared_tiny_model,
    transferring,
    wait_for,
)

_why = netns.unavailable()
if _why:
    pytest.skip(_why, allow_module_level=True)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]
MOONCAKE_PROBLEM = mooncake_problem()
NIXL_PROBLEM = nixl_problem()
PROBLEMS = {"tcp": None, "mooncake": MOONCAKE_PROBLEM, "nixl": NIXL_PROBLEM}
NIXL_ENV = {"UCX_TLS": "tcp"}  # what UCX has between hosts without RDMA

GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
PROMPTS = ["Hello world", "The capital of France is"]
LONG = "hello " * 100  # 300 prompt tokens: 5 prefill chunks of 64, 75 pages to move
LEG_TIMEOUT = 60.0  # a leg with no answer by then hung (FAST_ENV deadlines are <= 20 s)
# the tcp decode's quarantine outlasts every wait here: its rooms are freed by the prefill's answer
QUARANTINE = {"PDSERVE_KV_QUARANTINE_TIMEOUT": str(3 * LEG_TIMEOUT)}


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return str(tmp_path_factory.mktemp("multihost"))


@pytest.fixture(scope="module")
def lan():
    net = netns.Lan()
    try:
        yield net
    finally:
        net.close()


@pytest.fixture(scope="module")
def hosts(lan):
    return types.SimpleNamespace(**{n: lan.host(n) for n in ("pt", "dt", "pm", "dm", "pn", "dn", "router", "sgl")})


@pytest.fixture(scope="module")
def proxy(lan, hosts):
    """On the tcp decode's transfer path: the prefill writes pages to it, it forwards to the decode."""
    port = free_port()
    p = TcpProxy((hosts.dt.ip, port), listen=(lan.gateway, port))
    try:
        yield p
    finally:
        p.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory, logs, hosts, lan, proxy):
    model = shared_tiny_model(tmp_path_factory)
    started = {}
    try:
        started["col"] = Server("colocated", model, log_dir=logs)  # the reference, on loopback
        started["pt"] = netns.ns_server(KnobServer, hosts.pt, "prefill", model, v6=True, log_dir=logs,
                                        extra=["--host", "::", "--advertise-host", hosts.pt.ip6])
        started["dt"] = netns.ns_server(KnobServer, hosts.dt, "decode", model, log_dir=logs, env=QUARANTINE,
                                        extra=["--transfer-port", str(proxy.port), "--advertise-host", lan.gateway])
        if MOONCAKE_PROBLEM is None:
            started["pm"] = netns.ns_server(Server, hosts.pm, "prefill", model, log_dir=logs,
                                            extra=["--transfer-backend", "mooncake"])
            started["dm"] = netns.ns_server(Server, hosts.dm, "decode", model, log_dir=logs,
                                            extra=["--host", "0.0.0.0", "--transfer-backend", "mooncake"])
        if NIXL_PROBLEM is None:
            for name, role in (("pn", "prefill"), ("dn", "decode")):
                started[name] = netns.ns_server(Server, getattr(hosts, name), role, model, log_dir=logs,
                                                env=NIXL_ENV, extra=["--transfer-backend", "nixl"])
        for s in started.values():
            s.wait_ready(timeout=90)
        yield types.SimpleNamespace(**started)
    finally:
        for s in started.values():  # every front told first, so the shutdowns overlap
            s.kill(signal.SIGTERM)
        for s in started.values():
            s.stop()


class NsRouter(netns.NsProcess):
    """`pdserve router` (or sglang-router) inside a host, fronting one prefill and one decode."""

    def __init__(self, host, prefill_url: str, bootstrap_port: int, decode_url: str, log_dir: str,
                 sglang: bool = False):
        self.port = free_port()
        module = "sglang_router.launch_router" if sglang else "pdserve.router"
        cmd = [sys.executable, "-m", module, "--pd-disaggregation", "--host", host.ip, "--port", str(self.port),
               "--prefill", prefill_url, str(bootstrap_port), "--decode", decode_url, "--policy", "round_robin"]
        cmd += ["--prometheus-host", host.ip, "--prometheus-port", str(free_port()), "--log-level", "warn"] \
            if sglang else ["--log-level", "warning", "--health-check-interval-secs", "1"]
        super().__init__(host, cmd, os.path.join(log_dir, f"router-{module}-{self.port}.log"),
                         env={"PYTHONPATH": ROOT}, cwd=ROOT)
        self.url = f"http://{host.ip}:{self.port}"

    def wait_serving(self, timeout: float = 90.0) -> "NsRouter":
        probe = GenerateProbe(self.url)

        def serves() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited ({self.proc.returncode}):\n{self.tail()}")
            return probe()

        try:
            netns.wait_for(serves, timeout, f"router at {self.url} serving", step=0.3)
        except AssertionError as e:
            raise AssertionError(f"{e} (last answer: {probe.last})") from None
        return self


@pytest.fixture(scope="module")
def routers(servers, hosts, logs):
    made = {}
    try:
        made["tcp"] = NsRouter(hosts.router, servers.pt.url, servers.pt.bootstrap_port, servers.dt.url, logs)
        if MOONCAKE_PROBLEM is None:
            made["mooncake"] = NsRouter(hosts.router, servers.pm.url, servers.pm.bootstrap_port, servers.dm.url,
                                        logs)
        if NIXL_PROBLEM is None:
            made["nixl"] = NsRouter(hosts.router, servers.pn.url, servers.pn.bootstrap_port, servers.dn.url, logs)
        for r in made.values():
            r.wait_serving()
        yield made
    finally:
        for r in made.values():
            r.stop()


@pytest.fixture(scope="module")
def reference(servers):
    """The colocated server's greedy answers, by prompt."""
    return {p: generate(servers.col.url, p) for p in [*PROMPTS, LONG]}


def generate(url: str, text: str, timeout: float = LEG_TIMEOUT) -> list[int]:
    r = httpx.post(url + "/generate", json={"text": text, "sampling_params": GREEDY}, timeout=timeout)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def rank0(server) -> dict:
    return httpx.get(f"http://{server.bootstrap_addr}/route", params={"prefill_dp_rank": 0},
                     timeout=5).json()


def test_workers_register_and_advertise_what_peers_reach(servers, hosts):
    assert rank0(servers.pt)["rank_ip"] == hosts.pt.ip6  # bound ::, told its IPv6 address
    if MOONCAKE_PROBLEM is None:
        assert rank0(servers.pm)["rank_ip"] == hosts.pm.ip  # bound a non-loopback address
    if NIXL_PROBLEM is None:
        ep = rank0(servers.pn)
        assert ep["rank_ip"] == hosts.pn.ip and ep["endpoint"]["backend"] == "nixl", ep
        assert ep["endpoint"]["ip"] == hosts.pn.ip, ep  # its control channel's, as the agent's peers see it


@pytest.mark.parametrize("backend", ["tcp", "mooncake", "nixl"])
def test_pd_across_hosts_equals_colocated(routers, reference, backend):
    if PROBLEMS[backend]:
        pytest.skip(f"{backend} backend unavailable: {PROBLEMS[backend]}")
    for p in [*PROMPTS, LONG]:
        assert generate(routers[backend].url, p) == reference[p], p


def test_sglang_router_from_its_own_host(servers, hosts, logs, reference):
    pytest.importorskip("sglang_router")
    router = NsRouter(hosts.sgl, servers.pt.url, servers.pt.bootstrap_port, servers.dt.url, logs, sglang=True)
    try:
        router.wait_serving()
        for p in PROMPTS:
            assert generate(router.url, p) == reference[p], p
    finally:
        router.stop()


def test_unreachable_advertised_address_fails_start_up(tmp_path_factory, hosts, servers, logs):
    """A bootstrap service advertised at another host's address: a start-up error naming it."""
    model = shared_tiny_model(tmp_path_factory)
    cmd = [sys.executable, "-m", "pdserve", "serve", "--role", "prefill", "--model", model, "--host", hosts.sgl.ip,
           "--advertise-host", hosts.pm.ip, "--port", str(free_port()), "--bootstrap-port", str(free_port())]
    proc = netns.NsProcess(hosts.sgl, cmd, os.path.join(logs, "bad-advertise.log"), env={"PYTHONPATH": ROOT},
                           cwd=ROOT)
    try:
        assert proc.proc.wait(timeout=60) != 0
        assert f"advertises {hosts.pm.ip}:" in proc.tail() and "cannot be reached" in proc.tail()
    finally:
        proc.stop()


# ---- network faults ---------------------------------------------------------------------------
def test_bandwidth_cap_slows_but_succeeds(lan, hosts, servers, routers, reference):
    flush_cache(servers.dt)  # every page moves
    lan.cap(hosts.dt, "4mbit")  # pages towards the decode: 150 KiB, a third of a second
    try:
        assert generate(routers["tcp"].url, LONG) == reference[LONG]
        assert lan.capped_bytes(hosts.dt) > 150 << 10  # the pages went through the cap
    finally:
        lan.uncap(hosts.dt)


def test_delay_and_loss_slow_but_succeed(proxy, servers, routers, reference):
    flush_cache(servers.dt)  # every page moves
    before = proxy.forwarded
    proxy.set(delay_s=0.005, loss=0.3)
    try:
        for p in [LONG, *PROMPTS]:
            assert generate(routers["tcp"].url, p) == reference[p], p
    finally:
        proxy.set()
    assert proxy.forwarded > before and proxy.stalls > 0  # the pages went through it, some "lost"


@pytest.mark.parametrize("phase", ["prefill", "transfer"])
def test_prefill_partitioned_then_healed(lan, hosts, servers, routers, reference, legs, phase):
    """The prefill's veth goes down while its room prefills or its pages move: the decode's
    heartbeat fails the room, the client gets an error within the deadlines, the decode holds
    the room's pages (quarantined) while the prefill may still write them, and once healed both
    sides are idle and serve again."""
    pt, dt = servers.pt, servers.dt
    flush_cache(pt)  # LONG prefills in all its chunks
    flush_cache(dt)
    if phase == "prefill":
        pt.slow(step_s=0.5)
    else:
        pt.slow(transfer_s=4.0)
    t0 = time.monotonic()
    try:
        fut = legs.post(routers["tcp"].url + "/generate", {"text": LONG, "sampling_params": GREEDY},
                        timeout=LEG_TIMEOUT)
        in_window = (lambda: prefilling(pt, 0)) if phase == "prefill" else (lambda: transferring(pt, 0))
        wait_for(in_window, 20, f"prefill in its {phase} window")
        lan.partition(hosts.pt)
        resp = fut.result(timeout=LEG_TIMEOUT)
        failed_after = time.monotonic() - t0
        assert not isinstance(resp, Exception) and resp.status_code >= 400, error_of(resp)
        print(f"{phase}: {resp.status_code} after {failed_after:.2f}s: {error_of(resp)}")
        assert "room" in error_of(resp) and "heartbeat" in error_of(resp), error_of(resp)
        held = dt.info()["workers"][0]["extra"]
        assert held["quarantined_handoffs"] == 1 and held["handoff_states"] == {"quarantined": 1}, held
    finally:
        lan.heal(hosts.pt)
        pt.slow()
    pt.wait_idle(timeout=LEG_TIMEOUT)
    dt.wait_idle(timeout=LEG_TIMEOUT)  # the healed prefill's answer ended the quarantine
    assert failed_after < LEG_TIMEOUT
    wait_for(lambda: generate_ok(routers["tcp"].url), 30, "serving again after the heal")
    assert generate(routers["tcp"].url, LONG) == reference[LONG]
    pt.wait_idle()
    dt.wait_idle()


def test_a_partitioned_prefill_never_writes_into_freed_pages(lan, hosts, servers, legs):
    """The decode gives a room up while the prefill is cut off mid-prefill: its client is failed
    at once, but the room's pages stay quarantined; once healed, the prefill writes them (or
    answers the decode's kv_abort) while the decode still holds them, and only then are they freed
    (within the leg's deadline, far below the quarantine's own: an answer ended it)."""
    pt, dt = servers.pt, servers.dt
    flush_cache(pt)
    flush_cache(dt)
    pt.slow(step_s=0.5)
    body = {"text": LONG, "sampling_params": GREEDY, "bootstrap_host": hosts.pt.ip6,
            "bootstrap_port": pt.bootstrap_port, "bootstrap_room": random.getrandbits(63)}
    try:
        p_leg, d_leg = legs.both(pt, dt, body, timeout=LEG_TIMEOUT)
        wait_for(lambda: prefilling(pt, 0), 20, "prefill in its prefill window")
        lan.partition(hosts.pt)
        d_resp = d_leg.result(timeout=LEG_TIMEOUT)
        assert not isinstance(d_resp, Exception) and d_resp.status_code >= 400, error_of(d_resp)
        assert str(body["bootstrap_room"]) in error_of(d_resp) and "heartbeat" in error_of(d_resp), error_of(d_resp)
        w = dt.info()["workers"][0]
        still_held = w["free_pages"] + w["cached_pages"] < w["total_pages"]
    finally:
        lan.heal(hosts.pt)
        pt.slow()
    p_resp = p_leg.result(timeout=LEG_TIMEOUT)
    wrote = not isinstance(p_resp, Exception) and p_resp.status_code == 200
    pt.wait_idle(timeout=LEG_TIMEOUT)
    dt.wait_idle(timeout=LEG_TIMEOUT)
    assert still_held or not wrote, "the prefill wrote the room's pages after the decode had freed them"
    assert still_held and w["extra"]["quarantined_handoffs"] == 1, w
    assert w["extra"]["handoff_states"] == {"quarantined": 1} and w["inflight_transfers"] == 1, w


def generate_ok(url: str) -> bool:
    try:
        return httpx.post(url + "/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}},
                          timeout=20).status_code == 200
    except httpx.HTTPError:
        return False
