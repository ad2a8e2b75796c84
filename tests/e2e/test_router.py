"""End-to-end router tests: the real router process in front of stub prefill/decode servers.

Every process binds 127.0.0.1 on a free port (port 0, announced on stdout) and is stopped by
pid in a fixture finalizer. Waits poll with deadlines; nothing asserts absolute timings.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from pdserve.core.launcher import ProcessGroup, free_port

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parents[2]
STUB = Path(__file__).resolve().parents[1] / "harness" / "stub_pd_server.py"
BOOT_PORT = 18991
SPAWN_TIMEOUT = 30.0


class Proc:
    """A child in its own process group that announces its port on its output (it binds port 0)."""

    def __init__(self, cmd: list[str], ready: re.Pattern):
        fd, log = tempfile.mkstemp(prefix="router-test-", suffix=".log")
        os.close(fd)
        env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.group = ProcessGroup(cmd, name=Path(cmd[1]).name if cmd[1] != "-m" else cmd[2], log_path=log,
                                  cwd=ROOT, env=env)
        try:
            self.port = int(self.group.wait_output(ready.pattern, SPAWN_TIMEOUT).group(1))
        except BaseException:
            self.stop()
            raise
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.group.stop(grace_s=10.0)
        if os.path.exists(self.group.log_path):
            os.unlink(self.group.log_path)


class Stub(Proc):
    def __init__(self, role: str, *flags: str):
        super().__init__([sys.executable, str(STUB), "--role", role, "--port", "0", *flags],
                         re.compile(r"STUB READY port=(\d+)"))
        self.role = role

    def received(self) -> dict:
        return httpx.get(self.url + "/_received", timeout=10).json()

    def bodies(self) -> list[dict]:
        return [r["body"] for r in self.received()["requests"]]

    def control(self, **knobs) -> None:
        httpx.post(self.url + "/_control", json=knobs, timeout=10).raise_for_status()

    def reset(self) -> None:
        self.control(delay=0, hold=False, fail_status=0, fail_times=0, close_mid_stream=False, stream_gate=False,
                     healthy=True, load=0)
        httpx.post(self.url + "/_reset", timeout=10).raise_for_status()


class Router(Proc):
    def __init__(self, *flags: str):
        super().__init__([sys.executable, "-m", "pdserve.router", "--host", "127.0.0.1", "--port", "0", *flags],
                         re.compile(r"listening on http://127\.0\.0\.1:(\d+)"))
        try:
            wait_for(lambda: httpx.get(self.url + "/health", timeout=5).status_code == 200, "router healthy")
        except BaseException:
            self.stop()
            raise

    def post(self, path: str, body, timeout: float = 30, **kw) -> httpx.Response:
        data = body if isinstance(body, (bytes, str)) else json.dumps(body)
        return httpx.post(self.url + path, content=data, timeout=timeout, **kw)

    def metric(self, name: str, headers: dict | None = None) -> float:
        text = httpx.get(self.url + "/metrics", headers=headers or {}, timeout=10).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(name) and not line.startswith("#"))


def wait_for(cond, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = cond()
            if value:
                return value
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.fixture(scope="module")
def procs():
    """Start processes through procs.start(cls, ...); all are stopped by pid at module end."""
    started: list[Proc] = []

    class Starter:
        @staticmethod
        def start(cls, *args):
            proc = cls(*args)
            started.append(proc)
            return proc

    yield Starter
    errors = []
    for proc in reversed(started):
        try:
            proc.stop()
        except Exception as exc:  # stop the others anyway
            errors.append(exc)
    assert not errors, errors


@pytest.fixture(scope="module")
def base(procs):
    prefill = procs.start(Stub, "prefill")
    decode = procs.start(Stub, "decode")
    router = procs.start(Router, "--prefill", prefill.url, str(BOOT_PORT), "--decode", decode.url,
                         "--health-check-interval-secs", "60")
    return prefill, decode, router


@pytest.fixture
def stubs(base):
    prefill, decode, router = base
    prefill.reset(), decode.reset()
    yield prefill, decode, router
    prefill.reset(), decode.reset()


def error_of(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"} and {"message", "type"} <= set(body["error"]), body
    return body["error"]


# ---- the wire ----------------------------------------------------------------------------
def test_both_legs_get_the_same_body_with_pd_fields(stubs):
    prefill, decode, router = stubs
    client_body = {"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8, "temperature": 0},
                   "rid": "r1", "custom_field": [1, 2]}
    resp = router.post("/generate", client_body)
    assert resp.status_code == 200, resp.text
    (p_body,), (d_body,) = prefill.bodies(), decode.bodies()
    assert p_body == d_body
    room = p_body.pop("bootstrap_room")
    assert isinstance(room, int) and 0 <= room < 2**63
    assert p_body == {**client_body, "bootstrap_host": "127.0.0.1", "bootstrap_port": BOOT_PORT}
    out = resp.json()
    assert out["text"] == 'decode saw "The capital of France is"'  # decode's answer, not prefill's
    assert out["meta_info"]["pd"]["bootstrap_room"] == room


def test_openai_routes_and_chat_max_tokens_rename(stubs):
    prefill, decode, router = stubs
    chat = router.post("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 8, "temperature": 0})
    comp = router.post("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 8})
    assert chat.status_code == comp.status_code == 200
    assert chat.json()["choices"][0]["message"]["content"].startswith("decode saw")
    p_chat, p_comp = prefill.bodies()
    assert p_chat == decode.bodies()[0] and p_comp == decode.bodies()[1]
    assert p_chat["max_completion_tokens"] == 8 and "max_tokens" not in p_chat
    assert p_comp["max_tokens"] == 8 and "max_completion_tokens" not in p_comp
    assert p_chat["bootstrap_port"] == BOOT_PORT and isinstance(p_chat["bootstrap_room"], int)


def test_rooms_are_fresh_per_request(stubs):
    prefill, decode, router = stubs
    for _ in range(20):
        assert router.post("/generate", {"text": "x"}).status_code == 200
    rooms = [b["bootstrap_room"] for b in prefill.bodies()]
    assert len(set(rooms)) == 20 and all(0 <= r < 2**63 for r in rooms)
    assert rooms == [b["bootstrap_room"] for b in decode.bodies()]


@pytest.mark.parametrize("path,body,count", [
    ("/generate", {"text": ["a", "b", "c"]}, 3),
    ("/generate", {"text": "a", "sampling_params": {"n": 2}}, 2),
    ("/generate", {"input_ids": [[1, 2], [3]], "sampling_params": {"n": 3}}, 6),
    ("/generate", {"input_ids": [1, 2, 3]}, None),
    ("/v1/completions", {"prompt": "a", "n": 2}, 2),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a"}], "n": 4}, 4),
])
def test_batch_and_n_get_room_lists(stubs, path, body, count):
    prefill, decode, router = stubs
    assert router.post(path, body).status_code == 200
    rooms = prefill.bodies()[0]["bootstrap_room"]
    assert rooms == decode.bodies()[0]["bootstrap_room"]
    if count is None:
        assert isinstance(rooms, int)
    else:
        assert isinstance(rooms, list) and len(set(rooms)) == count
        assert all(isinstance(r, int) and 0 <= r < 2**63 for r in rooms)
    assert prefill.bodies()[0]["bootstrap_host"] == "127.0.0.1"


def test_stream_passes_through_chunk_by_chunk(stubs):
    prefill, decode, router = stubs
    decode.control(stream_gate=True)  # the stub holds its stream after chunk 0 until /_release
    body = {"text": "hello", "stream": True}
    with httpx.stream("POST", router.url + "/generate", content=json.dumps(body), timeout=30) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        chunks = resp.iter_raw()
        first = next(chunks)  # arrives while the stub still holds the rest
        assert first.startswith(b"data: ") and b'"chunk": 0' in first
        httpx.post(decode.url + "/_release", timeout=10)
        rest = b"".join(chunks)
    events = [e for e in (first + rest).decode().split("\n\n") if e]
    assert [json.loads(e[6:])["chunk"] for e in events[:-1]] == [0, 1, 2]
    assert events[-1] == "data: [DONE]"
    assert prefill.bodies()[0]["stream"] is True
    assert prefill.bodies()[0]["bootstrap_room"] == decode.bodies()[0]["bootstrap_room"]


def test_logprobs_merged_prefill_first(stubs):
    prefill, decode, router = stubs
    out = router.post("/generate", {"text": "x", "return_logprob": True}).json()
    assert out["meta_info"]["input_token_logprobs"] == [[-0.5, 0, None], [-9.0, 0, None]]
    batch = router.post("/generate", {"text": ["x", "y"], "return_logprob": True}).json()
    assert [b["meta_info"]["input_token_logprobs"] for b in batch] == [[[-0.5, 0, None], [-9.0, 0, None]],
                                                                       [[-0.5, 1, None], [-9.0, 1, None]]]


# ---- failures ----------------------------------------------------------------------------
@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("failing,status", [("prefill", 400), ("decode", 400)])
def test_failing_leg_gives_one_error_and_cancels_the_other(stubs, failing, status, stream):
    prefill, decode, router = stubs
    bad, other = (prefill, decode) if failing == "prefill" else (decode, prefill)
    bad.control(fail_status=status, hold=True)  # fails once released, after both legs have arrived
    other.control(delay=120)  # would hang far past the client's timeout if not cancelled
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(router.post, "/generate", {"text": "x", "stream": stream}, 60)
        wait_for(lambda: bad.bodies() and other.bodies(), "both legs sent")
        httpx.post(bad.url + "/_release", timeout=10)
        resp = future.result()
    assert resp.status_code == status
    err = error_of(resp)
    room = bad.bodies()[0]["bootstrap_room"]
    assert err["message"].startswith(f"{failing} server {bad.url} failed with status {status}")
    assert f"stub {failing} failure for room {room}" in err["message"] and f"bootstrap_room={room}" in err["message"]
    wait_for(lambda: other.received()["cancelled"] == [{"path": "/generate", "room": room}], "cancelled leg")


@pytest.mark.parametrize("status", [500, 503])
def test_a_prefill_5xx_before_any_token_is_tried_again_with_new_rooms(stubs, status):
    """sglang-router's retry set: a prefill that answers 500/503 before any token (a lost worker,
    a failed handoff) is tried again with fresh rooms; the client gets the second try's answer."""
    prefill, decode, router = stubs
    prefill.control(fail_status=status, fail_times=1)
    decode.control(delay=0.5)  # answers after the prefill's failure (a stub decode needs no KV)
    before = router.metric('pdserve_router_retries_total{reason="status"}')
    resp = router.post("/generate", {"text": "x"})
    assert resp.status_code == 200, resp.text
    rooms = [b["bootstrap_room"] for b in prefill.bodies()]
    assert len(rooms) == 2 and rooms[0] != rooms[1]
    assert decode.bodies()[-1]["bootstrap_room"] == rooms[1]
    assert router.metric('pdserve_router_retries_total{reason="status"}') == before + 1


def test_decode_breaking_mid_stream_ends_the_stream_with_an_error(stubs):
    prefill, decode, router = stubs
    decode.control(close_mid_stream=True)
    resp = router.post("/generate", {"text": "x", "stream": True})
    assert resp.status_code == 200  # already streaming when it broke
    events = [e for e in resp.text.split("\n\n") if e]
    assert json.loads(events[0][6:])["chunk"] == 0
    error = json.loads(events[1][6:])["error"]
    assert "decode server" in error["message"] and "connection failed" in error["message"]
    assert events[2:] == ["data: [DONE]"]


def test_prefill_failing_after_decode_started_streaming_ends_stream_with_its_error(stubs):
    prefill, decode, router = stubs
    prefill.control(fail_status=500, hold=True)
    decode.control(stream_gate=True)
    with httpx.stream("POST", router.url + "/generate", content=json.dumps({"text": "x", "stream": True}),
                      timeout=30) as resp:
        assert resp.status_code == 200
        chunks = resp.iter_raw()
        assert b'"chunk": 0' in next(chunks)
        httpx.post(prefill.url + "/_release", timeout=10)
        rest = b"".join(chunks).decode()
    events = [e for e in rest.split("\n\n") if e]
    error = json.loads(events[0][6:])["error"]
    assert error["message"].startswith(f"prefill server {prefill.url} failed with status 500")
    assert error["code"] == 500 and events[1:] == ["data: [DONE]"]
    room = decode.bodies()[0]["bootstrap_room"]
    wait_for(lambda: decode.received()["cancelled"] == [{"path": "/generate", "room": room}], "decode cancelled")


def test_client_leaving_a_stream_cancels_both_legs(stubs):
    prefill, decode, router = stubs
    prefill.control(hold=True)
    decode.control(stream_gate=True)
    with httpx.stream("POST", router.url + "/generate", content=json.dumps({"text": "x", "stream": True}),
                      timeout=30) as resp:
        assert b'"chunk": 0' in next(resp.iter_raw())
    room = decode.bodies()[0]["bootstrap_room"]
    for stub in (prefill, decode):
        wait_for(lambda: stub.received()["cancelled"] == [{"path": "/generate", "room": room}],
                 f"{stub.role} leg cancelled")


def test_client_authorization_passes_through_without_router_key(stubs):
    prefill, decode, router = stubs
    assert router.post("/generate", {"text": "x"}, headers={"Authorization": "Bearer upstream-key"}).status_code == 200
    assert prefill.received()["requests"][0]["authorization"] == "Bearer upstream-key"
    assert decode.received()["requests"][0]["authorization"] == "Bearer upstream-key"


def test_client_disconnect_cancels_both_legs(stubs):
    prefill, decode, router = stubs
    prefill.control(delay=120)
    decode.control(delay=120)
    body = json.dumps({"text": "bye"}).encode()
    with socket.create_connection(("127.0.0.1", router.port), timeout=10) as sock:
        sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_for(lambda: prefill.bodies() and decode.bodies(), "both legs sent")
    room = prefill.bodies()[0]["bootstrap_room"]
    for stub in (prefill, decode):
        wait_for(lambda: stub.received()["cancelled"] == [{"path": "/generate", "room": room}],
                 f"{stub.role} leg cancelled")
    wait_for(lambda: router.metric('pdserve_router_cancelled_legs_total{reason="client_disconnect"') >= 2,
             "cancel metric")


def test_request_timeout_cancels_both_legs(procs):
    prefill, decode = procs.start(Stub, "prefill", "--delay", "120"), procs.start(Stub, "decode", "--delay", "120")
    router = procs.start(Router, "--prefill", prefill.url, "--decode", decode.url, "--request-timeout-secs", "1")
    resp = router.post("/generate", {"text": "x"}, timeout=60)
    assert resp.status_code == 504
    assert "timed out after 1s" in error_of(resp)["message"]
    for stub in (prefill, decode):
        wait_for(lambda: len(stub.received()["cancelled"]) == 1, f"{stub.role} leg cancelled")


def test_connection_failure_is_retried_on_another_pair(procs):
    prefill = procs.start(Stub, "prefill")
    dead, alive = procs.start(Stub, "decode"), procs.start(Stub, "decode")
    router = procs.start(Router, "--prefill", prefill.url, "--decode", dead.url, "--decode", alive.url,
                         "--health-check-interval-secs", "60")
    dead.stop()  # was healthy at the router's first check; now refuses connections
    for _ in range(4):
        resp = router.post("/generate", {"text": "x"})
        assert resp.status_code == 200, resp.text
    assert router.metric("pdserve_router_retries_total") >= 1
    answered = [b["bootstrap_room"] for b in alive.bodies()]
    assert len(answered) == 4 and len(set(answered)) == 4
    # Tries that hit the dead decode used rooms of their own, never reused by the retry.
    failed_rooms = {b["bootstrap_room"] for b in prefill.bodies()} - set(answered)
    assert len(prefill.bodies()) == 4 + len(failed_rooms)


def test_no_other_pair_gives_a_clear_connection_error(procs):
    """A refused leg makes the router probe that server at once: the failed probe takes it out of
    selection, and the client hears both (without health checks: the tries it gave up after)."""
    prefill, decode = procs.start(Stub, "prefill"), procs.start(Stub, "decode")
    router = procs.start(Router, "--prefill", prefill.url, "--decode", decode.url, "--max-retries", "2",
                         "--health-check-interval-secs", "60", "--health-failure-threshold", "5")
    unchecked = procs.start(Router, "--prefill", prefill.url, "--decode", decode.url, "--max-retries", "2",
                            "--disable-health-check")
    decode.stop()
    resp = router.post("/generate", {"text": "x"})
    assert resp.status_code == 502
    msg = error_of(resp)["message"]
    assert f"decode server {decode.url} connection failed" in msg and "no retry" in msg, msg
    assert f"no healthy decode server ({decode.url} unhealthy)" in msg, msg
    resp = unchecked.post("/generate", {"text": "x"})
    assert resp.status_code == 502
    msg = error_of(resp)["message"]
    assert f"decode server {decode.url} connection failed" in msg and "gave up after 2 tries" in msg, msg


def test_cut_connections_to_a_decode_that_answers_its_probe_keep_it_in_selection(procs):
    """Each leg to the one decode is dropped before it answers, more times in a row than the
    failure threshold: its probes pass, so it stays in selection and the last try succeeds."""
    prefill, decode = procs.start(Stub, "prefill"), procs.start(Stub, "decode")
    router = procs.start(Router, "--prefill", prefill.url, "--decode", decode.url, "--max-retries", "5",
                         "--health-check-interval-secs", "60", "--health-failure-threshold", "2")
    decode.control(drop_times=3)
    resp = router.post("/generate", {"text": "x"})
    assert resp.status_code == 200, resp.text
    assert router.metric('pdserve_router_retries_total{reason="connection"}') == 3
    assert len(decode.bodies()) == 4


# ---- DP awareness, policies, health ------------------------------------------------------
def test_dp_aware_pins_ranks_on_both_legs(procs):
    prefill, decode = procs.start(Stub, "prefill", "--dp-size", "2"), procs.start(Stub, "decode", "--dp-size", "3")
    router = procs.start(Router, "--prefill", prefill.url, "none", "--decode", decode.url, "--dp-aware")
    for _ in range(6):
        assert router.post("/generate", {"text": "x", "data_parallel_rank": 5}).status_code == 200
    p_bodies, d_bodies = prefill.bodies(), decode.bodies()
    assert [b["routed_dp_rank"] for b in p_bodies] == [0, 1, 0, 1, 0, 1]
    assert [b["routed_dp_rank"] for b in d_bodies] == [0, 1, 2, 0, 1, 2]
    for p, d in zip(p_bodies, d_bodies):
        assert d["disagg_prefill_dp_rank"] == p["routed_dp_rank"] == p["disagg_prefill_dp_rank"]
        assert p["bootstrap_room"] == d["bootstrap_room"] and p["bootstrap_port"] is None
        assert "data_parallel_rank" not in p and "data_parallel_rank" not in d


def test_policies_spread_as_they_say(procs):
    p1, p2 = procs.start(Stub, "prefill"), procs.start(Stub, "prefill")
    idle, busy = procs.start(Stub, "decode"), procs.start(Stub, "decode", "--load", "50")
    router = procs.start(Router, "--prefill", p1.url, "--prefill", p2.url, "--decode", idle.url,
                         "--decode", busy.url, "--prefill-policy", "round_robin", "--decode-policy", "power_of_two")
    for _ in range(8):
        assert router.post("/generate", {"text": "x"}).status_code == 200
    assert len(p1.bodies()) == len(p2.bodies()) == 4
    assert len(idle.bodies()) == 8 and busy.bodies() == []


def test_cache_aware_keeps_each_conversation_on_its_decode_rank(procs):
    prefill = procs.start(Stub, "prefill")
    d1, d2 = procs.start(Stub, "decode", "--dp-size", "2"), procs.start(Stub, "decode", "--dp-size", "2")
    router = procs.start(Router, "--prefill", prefill.url, "--decode", d1.url, "--decode", d2.url,
                         "--policy", "cache_aware", "--dp-aware", "--health-check-interval-secs", "60")
    systems = ["You answer in French.", "You answer in haiku.", "You are a pirate.", "You are terse."]
    for turn in range(3):
        for system in systems:
            messages = [{"role": "system", "content": system}]
            for t in range(turn + 1):
                messages += [{"role": "user", "content": f"question {t} about {system}"},
                             {"role": "assistant", "content": f"answer {t}"}]
            resp = router.post("/v1/chat/completions", {"model": "m", "messages": messages[:-1]})
            assert resp.status_code == 200, resp.text
    homes: dict[str, set] = {}
    for stub in (d1, d2):
        for body in stub.bodies():
            homes.setdefault(body["messages"][0]["content"], set()).add((stub.url, body["routed_dp_rank"]))
    # Each conversation stayed on one (decode, rank); the four went to four different slots.
    assert all(len(slots) == 1 for slots in homes.values()), homes
    assert len(set().union(*homes.values())) == 4
    assert router.metric('pdserve_router_cache_aware_decisions_total{outcome="matched",role="decode"}') == 8


def test_health_removes_and_returns_servers(procs):
    prefill = procs.start(Stub, "prefill")
    d1, d2 = procs.start(Stub, "decode"), procs.start(Stub, "decode")
    router = procs.start(Router, "--prefill", prefill.url, "--decode", d1.url, "--decode", d2.url,
                         "--health-check-interval-secs", "0.1", "--health-failure-threshold", "2")

    def states() -> dict:
        info = httpx.get(router.url + "/server_info", timeout=10).json()
        return {e["url"]: e["health"] for e in info["prefill"] + info["decode"]}

    d2.control(healthy=False)
    wait_for(lambda: states()[d2.url] == "unhealthy", "d2 removed")
    assert router.metric(f'pdserve_router_upstream_healthy{{role="decode",server="{d2.url}"}}') == 0
    for _ in range(4):
        assert router.post("/generate", {"text": "x"}).status_code == 200
    assert len(d1.bodies()) == 4 and d2.bodies() == []
    d2.control(healthy=True)
    wait_for(lambda: states()[d2.url] == "healthy", "d2 returned")
    for _ in range(4):
        assert router.post("/generate", {"text": "x"}).status_code == 200
    assert len(d2.bodies()) == 2
    prefill.control(healthy=False)
    wait_for(lambda: httpx.get(router.url + "/health", timeout=5).status_code == 503, "router unhealthy")
    resp = router.post("/generate", {"text": "x"})
    assert resp.status_code == 503 and "no healthy prefill server" in error_of(resp)["message"]


# ---- API key, bad input, info routes -----------------------------------------------------
def test_api_key_guards_everything_but_health(procs):
    prefill, decode = procs.start(Stub, "prefill"), procs.start(Stub, "decode")
    router = procs.start(Router, "--prefill", prefill.url, "--decode", decode.url, "--api-key", "sekret")
    assert httpx.get(router.url + "/health", timeout=10).status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        resp = router.post("/generate", {"text": "x"}, headers=headers)
        assert resp.status_code == 401 and error_of(resp)["type"] == "authentication_error"
        assert httpx.get(router.url + "/metrics", headers=headers, timeout=10).status_code == 401
    assert prefill.bodies() == []
    good = {"Authorization": "Bearer sekret"}
    assert router.post("/generate", {"text": "x"}, headers=good).status_code == 200
    assert prefill.received()["requests"][0]["authorization"] == "Bearer sekret"
    assert httpx.get(router.url + "/v1/models", headers=good, timeout=10).status_code == 200


@pytest.mark.parametrize("raw,fragment", [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b'"text"', "must be a JSON object"),
    (b'{"text": "x", "sampling_params": {"n": 0}}', "sampling_params.n must be a positive integer"),
    (b'{"text": []}', "text is an empty list"),
])
def test_bad_input_is_400_without_touching_upstreams(stubs, raw, fragment):
    prefill, decode, router = stubs
    resp = router.post("/generate", raw)
    assert resp.status_code == 400
    err = error_of(resp)
    assert fragment in err["message"] and err["type"] == "invalid_request_error"
    assert prefill.bodies() == [] and decode.bodies() == []


def test_info_routes_and_metrics(stubs):
    prefill, decode, router = stubs
    assert router.post("/generate", {"text": "x"}).status_code == 200
    info = httpx.get(router.url + "/server_info", timeout=10).json()
    assert info["router"]["prefill"][0]["bootstrap_port"] == BOOT_PORT
    assert info["prefill"][0]["server_info"]["disaggregation_mode"] == "prefill"
    assert info["decode"][0]["server_info"]["disaggregation_mode"] == "decode"
    assert info["model_path"] == "/tmp/stub-model"
    assert httpx.get(router.url + "/get_server_info", timeout=10).status_code == 200
    assert httpx.get(router.url + "/v1/models", timeout=10).json()["data"][0]["owned_by"] == "decode"
    assert httpx.get(router.url + "/health_generate", timeout=10).status_code == 200
    assert httpx.get(router.url + "/nope", timeout=10).status_code == 404
    text = httpx.get(router.url + "/metrics", timeout=10).text
    assert 'pdserve_router_requests_total{route="/generate",status="200"}' in text
    assert "pdserve_router_upstream_latency_seconds_bucket" in text
    labels = " ".join(re.findall(r"\{[^}]*\}", text))
    assert not re.search(r"\d{12,}", labels), "room ids must not appear in labels"


def test_worker_startup_timeout_waits_for_every_server_then_names_the_missing(procs, base):
    """--worker-startup-timeout-secs (sglang-router's flag): start-up waits for every server to
    pass a health check; one that never does makes the router exit, naming it and the flag."""
    prefill, decode, _ = base
    ok = procs.start(Router, "--prefill", prefill.url, str(BOOT_PORT), "--decode", decode.url,
                     "--worker-startup-timeout-secs", "20")
    assert httpx.get(ok.url + "/health", timeout=5).status_code == 200
    dead = f"http://127.0.0.1:{free_port()}"  # a port nobody listens on
    cmd = [sys.executable, "-m", "pdserve.router", "--host", "127.0.0.1", "--port", "0", "--prefill", prefill.url,
           str(BOOT_PORT), "--decode", dead, "--worker-startup-timeout-secs", "1.5"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    t0 = time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT, env=env)
    assert r.returncode != 0, r.stdout + r.stderr
    out = r.stdout + r.stderr
    assert "--worker-startup-timeout-secs 1.5" in out and f"decode {dead}" in out, out
    assert time.monotonic() - t0 < 50
