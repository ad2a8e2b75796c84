"""Access control and limits on real processes: the API key on servers and router (Bearer;
/health stays open), the cluster token on the bootstrap service's write routes (a stranger cannot
register a rank or steer a room; secrets stay off worker command lines), loopback binds by
default, and the overload limits: 413 for a body over the cap, 429 + Retry-After when the server
is full or a request's queue wait runs out, and a refused prefill leg failing its decode at once.
"""

from __future__ import annotations

import random

import httpx
import pytest

from tests.harness.cluster import Server, pd_body, stop_all  # noqa: E402
from tests.harness.fault_tools import KnobServer, Legs, Router, error_of, shared_tiny_model, wait_for  # noqa: E402
from tests.harness.procs import children  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

KEY = "sk-test-key"
TOKEN = "cluster-token-123"
AUTH = {"Authorization": f"Bearer {KEY}"}
GEN = {"text": "hello there", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Prefill (dp 2, API key, cluster token by flag, one request at a time, no queue), decode
    (API key), a router with the key, and a colocated server with a 1-slot, 1-deep, 1 s queue."""
    logs = str(tmp_path_factory.mktemp("access"))
    model = shared_tiny_model(tmp_path_factory)
    P = Server("prefill", model, dp=2, log_dir=logs, extra=[
        "--api-key", KEY, "--bootstrap-token", TOKEN, "--max-concurrent-requests", "1", "--max-queued-requests", "0"])
    D = Server("decode", model, dp=1, log_dir=logs, extra=["--api-key", KEY])
    C = KnobServer("colocated", model, dp=1, log_dir=logs, extra=[
        "--max-concurrent-requests", "1", "--max-queued-requests", "1", "--queue-timeout", "1",
        "--max-request-bytes", "100000"])
    router = None
    try:
        for s in (P, D, C):
            s.wait_ready()
        router = Router([P], [D], "--api-key", KEY, log_dir=logs).wait_healthy()
        yield P, D, C, router
    finally:
        if router is not None:
            router.stop()
        stop_all([P, D, C])


def info(srv: Server) -> dict:
    return httpx.get(srv.url + "/server_info", headers=AUTH, timeout=10).json()


def wait_idle(srv: Server) -> None:
    def idle() -> bool:
        return all(w["free_pages"] + w["cached_pages"] == w["total_pages"] and w["running_requests"] == 0
                   and w["waiting_requests"] == 0 and w["inflight_transfers"] == 0 for w in info(srv)["workers"])
    wait_for(idle, 20, f"{srv.role} idle", lambda: str(info(srv)["workers"]))


def assert_401(r: httpx.Response) -> None:
    assert r.status_code == 401, r.text
    assert r.json()["error"]["type"] == "authentication_error"


# ---- API key ----------------------------------------------------------------------------------
def test_api_key_on_servers(stack):
    P, D, _, _ = stack
    body = pd_body(GEN, P, random.getrandbits(63))
    for srv in (P, D):
        assert httpx.get(srv.url + "/health", timeout=10).status_code == 200  # open
        for method, path in (("GET", "/server_info"), ("GET", "/v1/models"), ("GET", "/metrics"),
                             ("POST", "/generate"), ("POST", "/v1/chat/completions"), ("GET", "/nope")):
            assert_401(httpx.request(method, srv.url + path, json=body, timeout=10))
            assert_401(httpx.request(method, srv.url + path, json=body, timeout=10,
                                     headers={"Authorization": "Bearer wrong"}))
            assert_401(httpx.request(method, srv.url + path, json=body, timeout=10, headers={"Authorization": KEY}))
        assert httpx.get(srv.url + "/server_info", headers=AUTH, timeout=10).status_code == 200


def test_api_key_on_router(stack):
    P, D, _, router = stack
    assert httpx.get(router.url + "/health", timeout=10).status_code == 200
    for path in ("/generate", "/v1/completions"):
        assert_401(httpx.post(router.url + path, json=GEN, timeout=10))
        assert_401(httpx.post(router.url + path, json=GEN, timeout=10, headers={"Authorization": "Bearer x"}))
    assert_401(httpx.get(router.url + "/server_info", timeout=10))
    r = httpx.post(router.url + "/generate", json=GEN, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text  # the router's own key opens both servers
    wait_idle(P)
    wait_idle(D)


def test_router_without_key_passes_the_clients_key_on(stack, tmp_path):
    P, D, _, _ = stack
    open_router = Router([P], [D], log_dir=str(tmp_path)).wait_healthy()
    try:
        assert httpx.post(open_router.url + "/generate", json=GEN, timeout=60).status_code == 401
        r = httpx.post(open_router.url + "/generate", json=GEN, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
    finally:
        open_router.stop()


# ---- cluster token on the bootstrap service -----------------------------------------------------
def test_bootstrap_token_guards_writes_only(stack):
    P, D, _, router = stack
    boot = f"http://127.0.0.1:{P.bootstrap_port}"
    rank0 = httpx.get(boot + "/route?prefill_dp_rank=0", timeout=10).json()  # reads stay open
    assert rank0["rank_ip"] == "127.0.0.1"
    stranger = {k: rank0[k] for k in ("dp_rank", "dp_size", "rank_ip", "page_size", "kv_cache_dtype",
                                      "load_balance_method", "fingerprint")}
    stranger.update(rank_port=9, endpoint={"backend": "tcp", "ip": "10.6.6.6", "port": 9})
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}, AUTH):
        assert_401(httpx.put(boot + "/route", json=stranger, headers=headers, timeout=10))
    room = random.getrandbits(63) // 2 * 2  # follow_bootstrap_room: rank 0
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        assert_401(httpx.post(boot + "/register_dp_rank", json={"bootstrap_room": room, "dp_rank": 1},
                              headers=headers, timeout=10))
    # nothing was registered or steered: the rank's endpoint is intact, the room is unknown
    assert httpx.get(boot + "/route?prefill_dp_rank=0", timeout=10).json()["endpoint"] == rank0["endpoint"]
    assert httpx.post(boot + "/query_dp_ranks", json={"bootstrap_rooms": [room]}, timeout=10).json() == {}
    assert httpx.get(boot + "/health", timeout=10).status_code == 200
    # with the token a write goes through (our own workers registered with it at start)
    ok = httpx.post(boot + "/register_dp_rank", json={"bootstrap_room": room + 2, "dp_rank": 0},
                    headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10)
    assert ok.status_code == 200, ok.text
    r = httpx.post(router.url + "/generate", json=GEN, headers=AUTH, timeout=60)
    assert r.status_code == 200, r.text


def test_secrets_stay_off_worker_command_lines(stack):
    P, D, _, _ = stack
    for srv in (P, D):
        for pid in children(srv.proc.pid):
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv = f.read()
            assert b"--dp-rank" in argv
            assert TOKEN.encode() not in argv and KEY.encode() not in argv


def test_bootstrap_token_from_the_environment():
    from pdserve.core.config import Role, ServerConfig
    from pdserve.core.envs import Envs
    from pdserve.server.pd_roles import PrefillFrontRole

    envs = Envs.read({"PDSERVE_BOOTSTRAP_TOKEN": "from-env"})
    assert envs.bootstrap_token == "from-env"
    assert PrefillFrontRole(ServerConfig(role=Role.PREFILL), envs).token == "from-env"
    assert PrefillFrontRole(ServerConfig(role=Role.PREFILL, bootstrap_token="flag"), envs).token == "flag"


def test_loopback_by_default():
    from pdserve.core.config import ServerConfig
    from pdserve.router.cli_args import build_router_parser

    assert ServerConfig().host == "127.0.0.1"
    assert build_router_parser().parse_args(["--prefill", "http://a:1", "--decode", "http://b:2"]).host == "127.0.0.1"


# ---- limits -------------------------------------------------------------------------------------
def test_body_over_the_cap_is_413(stack):
    _, _, C, _ = stack
    r = httpx.post(C.url + "/generate", json={"text": "x" * 200_000}, timeout=10)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large", r.text
    assert httpx.post(C.url + "/generate", json=GEN, timeout=60).status_code == 200


def test_full_server_refuses_early_with_retry_after(stack):
    """One slot, one queue place, 1 s queue deadline: a second request waits and is refused when
    its wait runs out, a third is refused at once; the first finishes; then the server serves."""
    _, _, C, _ = stack
    C.slow(step_s=0.15)
    legs = Legs(4)
    try:
        long = {"text": "hello", "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}
        first = legs.post(C.url + "/generate", long)
        wait_for(lambda: info(C)["admission"]["running"] == 1, 10, "the first request admitted")
        queued = legs.post(C.url + "/generate", GEN)
        wait_for(lambda: info(C)["admission"]["queued"] == 1, 10, "the second request queued")
        third = httpx.post(C.url + "/generate", json=GEN, timeout=10)
        assert third.status_code == 429, third.text
        assert third.headers["Retry-After"] == "1"
        assert "full" in error_of(third) and third.json()["error"]["type"] == "overloaded_error"
        second = queued.result()
        assert second.status_code == 429 and "no free slot within 1s" in error_of(second), second.text
        assert second.headers["Retry-After"] == "1"
        assert first.result().status_code == 200
    finally:
        C.slow()
        legs.close()
    assert httpx.post(C.url + "/generate", json=GEN, timeout=60).status_code == 200
    assert info(C)["admission"]["running"] == 0 and info(C)["admission"]["refused"] >= 2
    wait_idle(C)


def test_refused_prefill_leg_fails_its_decode_at_once(stack):
    """The prefill takes one request at a time: while a lone prefill leg holds its slot, a PD
    request's prefill leg gets 429 and its decode leg fails at once with the same reason."""
    P, D, _, _ = stack
    legs = Legs(4)
    try:
        hog = pd_body(GEN, P, random.getrandbits(63))
        with httpx.Client(timeout=1.5, headers=AUTH) as c:  # gives up after 1.5 s: frees the slot
            holder = legs.pool.submit(lambda: _quietly(c.post, P.url + "/generate", json=hog))
            wait_for(lambda: info(P)["admission"]["running"] == 1, 10, "the prefill slot taken")
            body = pd_body(GEN, P, random.getrandbits(63))
            with httpx.Client(timeout=60, headers=AUTH) as c2:
                rp = c2.post(P.url + "/generate", json=body)
                rd = c2.post(D.url + "/generate", json=body)
            holder.result()
        assert rp.status_code == 429 and rp.headers["Retry-After"] == "1", rp.text
        assert rd.status_code >= 500 and "full" in error_of(rd) and str(body["bootstrap_room"]) in error_of(rd)
    finally:
        legs.close()
    wait_for(lambda: info(P)["admission"]["running"] == 0, 20, "the prefill slot freed")
    wait_idle(P)
    wait_idle(D)


def _quietly(fn, *a, **kw):
    try:
        return fn(*a, **kw)
    except httpx.HTTPError as e:
        return e
