"""A bad-input corpus for every HTTP route of the servers (prefill, decode), the router and the
bootstrap service: malformed JSON, wrong types, missing fields, huge bodies, out-of-range ranks
and rooms, unicode edge cases, prompts over the context. Each gets a 4xx with a JSON
{"error": {"message", "type"}}; afterwards nothing crashed, nothing is in flight, no fds leaked,
and a normal request is served. Valid-but-odd unicode is served (200), not refused.
"""

from __future__ import annotations

import random

import httpx
import pytest

from tests.harness.cluster import Server, stop_all  # noqa: E402
from tests.harness.fault_tools import Router, shared_tiny_model, wait_for  # noqa: E402
from tests.harness.procs import fd_count  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

LIMIT = 1_000_000  # --max-request-bytes / --max-payload-size in this module
DEEP = b"[" * 50_000 + b"]" * 50_000
BAD_JSON = [b"", b"{", b"not json", b"[1, 2]", b'"text"', b"null", b"123", b"\xff\xfe{}", b'{"text": NaN}',
            b'{"text": "hi", "sampling_params": {"temperature": Infinity}}', DEEP, b'{"text": "\\ud800"}',
            b'{"text": "a\\udc00b"}', b'{"text": "hi"', b"{\"text\": \"hi\"}}"]

SP = "sampling_params"
GENERATE = [
    {}, {"text": 123}, {"text": []}, {"text": [1, 2]}, {"text": ""}, {"text": [""]}, {"text": "a", "input_ids": [1]},
    {"input_ids": "abc"}, {"input_ids": []}, {"input_ids": [1.5]}, {"input_ids": [-1]}, {"input_ids": [10 ** 30]},
    {"input_ids": [[]]}, {"input_ids": [True]}, {"input_ids": [5] * 600},
    {"text": "hi", SP: "x"}, {"text": "hi", SP: [{}, {}]}, {"text": ["a", "b"], SP: [{}]},
    {"text": "hi", SP: {"max_new_tokens": -1}}, {"text": "hi", SP: {"max_new_tokens": "10"}},
    {"text": "hi", SP: {"max_new_tokens": 10 ** 9}}, {"text": "hi", SP: {"max_new_tokens": 600}},
    {"text": "hi", SP: {"temperature": -1}}, {"text": "hi", SP: {"temperature": "hot"}},
    {"text": "hi", SP: {"top_p": 2}}, {"text": "hi", SP: {"top_p": 0}}, {"text": "hi", SP: {"top_k": 0}},
    {"text": "hi", SP: {"top_k": -5}}, {"text": "hi", SP: {"min_p": 1.5}}, {"text": "hi", SP: {"n": 0}},
    {"text": "hi", SP: {"n": 1000}}, {"text": "hi", SP: {"n": 65}}, {"text": "hi", SP: {"stop": 5}},
    {"text": "hi", SP: {"stop": [""]}},
    {"text": "hi", SP: {"stop_token_ids": ["a"]}}, {"text": "hi", SP: {"stop_token_ids": [-1]}},
    {"text": "hi", SP: {"seed": "x"}}, {"text": "hi", SP: {"seed": 1.5}}, {"text": "hi", SP: {"ignore_eos": "yes"}},
    {"text": "hi", "stream": "yes"}, {"text": "hi", "return_logprob": 1}, {"text": "hi", "rid": 5},
    {"text": "hi", "rid": ""}, {"text": ["a", "b"], "rid": ["r", "r"]}, {"text": ["a", "b"], "rid": ["r"] * 3},
    {"text": "hello " * 400},  # over the 512-token context
    {"text": "hi", "routed_dp_rank": 5}, {"text": "hi", "routed_dp_rank": -1},
    {"text": "hi", "routed_dp_rank": "0"},
    {"text": "hi", "routed_dp_rank": 2 ** 70}, {"text": "hi", "routed_dp_rank": 1.5},
    {"text": "hi", "data_parallel_rank": 9},
    {"text": "hi", "bootstrap_room": -1}, {"text": "hi", "bootstrap_room": 2 ** 63},
    {"text": "hi", "bootstrap_room": "1"},
    {"text": "hi", "bootstrap_room": 1.5}, {"text": "hi", "bootstrap_room": [1, 2]},
    {"text": "hi", "bootstrap_port": 0}, {"text": "hi", "bootstrap_port": 70000},
    {"text": "hi", "bootstrap_port": "x"},
    {"text": "hi", "bootstrap_host": 5}, {"text": "hi", "disagg_prefill_dp_rank": -1},
]
PREFILL_ONLY = [{"text": "hi", "disagg_prefill_dp_rank": 9},  # out of range on a dp 2 prefill
                {"text": "hi", "routed_dp_rank": 1, "disagg_prefill_dp_rank": 0}]
COMPLETIONS = [
    {}, {"prompt": ""}, {"prompt": []}, {"prompt": [1, "a"]}, {"prompt": [[]]}, {"prompt": 5}, {"prompt": {"a": 1}},
    {"prompt": "hi", "max_tokens": -1}, {"prompt": "hi", "max_tokens": "5"}, {"prompt": "hi", "n": 0},
    {"prompt": "hi", "n": 65},
    {"prompt": "hi", "logprobs": 50}, {"prompt": "hi", "echo": "yes"}, {"prompt": "hi", "stream_options": "x"},
    {"prompt": "hi", "model": 5}, {"prompt": "hi", "temperature": "x"}, {"prompt": "hi", "stop": 5},
    {"prompt": "hello " * 400}, {"prompt": [10 ** 6]}, {"prompt": "hi", "max_tokens": 600},
]
MSG = [{"role": "user", "content": "hi"}]
CHAT = [
    {}, {"messages": "hi"}, {"messages": []}, {"messages": [5]}, {"messages": [{"role": 5, "content": "x"}]},
    {"messages": [{"role": "user", "content": 5}]}, {"messages": [{"content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": MSG, "max_tokens": -1}, {"messages": MSG, "max_completion_tokens": "x"},
    {"messages": MSG, "n": 0}, {"messages": MSG, "n": 65},
    {"messages": MSG, "temperature": 500}, {"messages": MSG, "stream": 1},
    {"messages": [{"role": "user", "content": "hello " * 400}]},
]
ROUTER_SETS = {"bootstrap_host", "bootstrap_port", "bootstrap_room"}  # it overwrites what a client sent
ODD_UNICODE = ["\u0000 nul", "\u202e rtl override", "👩‍👩‍👧‍👦 zwj", "a" + "\u0301" * 60, "\ufeff bom", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
               "\U0010ffff max", "日本語 " * 20]


def bootstrap_corpus(dp: int) -> list[tuple[str, str, object]]:
    """(method, path, JSON body or raw bytes); every one must be refused."""
    good = {"dp_rank": 0, "dp_size": dp, "rank_ip": "127.0.0.1", "rank_port": 9, "page_size": 4,
            "kv_cache_dtype": "float32", "load_balance_method": "follow_bootstrap_room"}
    put = [{}, {"dp_rank": 0}, {**good, "dp_size": "2"}, {**good, "rank_port": 70000}, {**good, "page_size": 0},
           {**good, "load_balance_method": "bogus"}, {**good, "dp_rank": dp}, {**good, "dp_size": dp + 1},
           {**good, "fingerprint": "x"}, {**good, "page_size": 8}, {**good, "dp_rank": -1}, {**good, "rank_ip": 5}]
    out = [("PUT", "/route", b) for b in put]
    out += [("GET", f"/route?prefill_dp_rank={k}", None) for k in ("abc", dp, -5, "1.5", "")]
    out += [("POST", "/register_dp_rank", b) for b in (
        {}, {"bootstrap_room": -1, "dp_rank": 0}, {"bootstrap_room": 1, "dp_rank": dp},
        {"bootstrap_room": "1", "dp_rank": 0}, {"bootstrap_room": 1, "dp_rank": True}, {"bootstrap_room": 2 ** 63})]
    out += [("POST", "/query_dp_ranks", b) for b in (
        {}, {"bootstrap_rooms": "x"}, {"bootstrap_rooms": [-1]}, {"bootstrap_rooms": [2 ** 64]},
        {"bootstrap_rooms": [1.5]}, {"bootstrap_rooms": ["1"]}, {"bootstrap_rooms": list(range(5000))})]
    out += [(m, p, raw) for m, p in (("PUT", "/route"), ("POST", "/query_dp_ranks"), ("POST", "/register_dp_rank"))
            for raw in BAD_JSON + [b"x" * (2 << 20)]]
    out += [("POST", "/health", None), ("DELETE", "/route", None), ("GET", "/nope", None)]
    return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("bad_input"))
    model = shared_tiny_model(tmp_path_factory)
    limit = ["--max-request-bytes", str(LIMIT)]
    P = Server("prefill", model, dp=2, log_dir=logs, extra=limit)
    D = Server("decode", model, dp=1, log_dir=logs, extra=limit)
    router = None
    try:
        P.wait_ready()
        D.wait_ready()
        router = Router([P], [D], "--max-payload-size", str(LIMIT), log_dir=logs).wait_healthy()
        yield P, D, router
    finally:
        if router is not None:
            router.stop()
        stop_all([P, D])


def pd_fields(P: Server) -> dict:
    return {"bootstrap_host": "127.0.0.1", "bootstrap_port": P.bootstrap_port,
            "bootstrap_room": random.getrandbits(63)}


def send(client: httpx.Client, method: str, url: str, body) -> httpx.Response:
    if body is None:
        return client.request(method, url)
    if isinstance(body, bytes):
        return client.request(method, url, content=body, headers={"Content-Type": "application/json"})
    return client.request(method, url, json=body)


def assert_refused(resp: httpx.Response, what: str) -> None:
    assert 400 <= resp.status_code < 500, f"{what}: {resp.status_code} {resp.text[:300]}"
    try:
        err = resp.json()["error"]
    except Exception:
        raise AssertionError(f"{what}: not a JSON error body: {resp.text[:300]}") from None
    assert isinstance(err.get("message"), str) and err["message"], f"{what}: {err}"
    assert isinstance(err.get("type"), str) and err["type"], f"{what}: {err}"


def generation_corpus(P: Server) -> list[tuple[str, str, object, bool]]:
    """(path, label, body, add_pd_fields) for the three generation routes."""
    out = []
    for path, bodies in (("/generate", GENERATE), ("/v1/completions", COMPLETIONS), ("/v1/chat/completions", CHAT)):
        out += [(path, f"{path} {raw[:40]!r}", raw, False) for raw in BAD_JSON]
        out += [(path, f"{path} huge body", {"text": "x" * LIMIT, "prompt": "x" * LIMIT}, True)]
        out += [(path, f"{path} {b}"[:200], b, True) for b in bodies]
    return out


def fds(*pids: int) -> list[int]:
    return [fd_count(p) for p in pids]


def test_bad_input_corpus(stack):
    P, D, router = stack
    pids = (P.proc.pid, D.proc.pid, router.proc.pid)
    with httpx.Client(timeout=60) as c:
        send(c, "POST", router.url + "/generate", {"text": "warm up", "sampling_params": {"max_new_tokens": 2}})
        fds_before = fds(*pids)
        cases = generation_corpus(P)
        for srv in (P, D):
            for path, label, body, pd in cases:
                if pd and isinstance(body, dict):
                    body = {**pd_fields(P), **body}
                assert_refused(send(c, "POST", srv.url + path, body), f"{srv.role} {label}")
        for path, label, body, pd in cases:  # the router sets the bootstrap fields itself
            if not (isinstance(body, dict) and ROUTER_SETS & body.keys()):
                assert_refused(send(c, "POST", router.url + path, body), f"router {label}")
        for body in PREFILL_ONLY:
            assert_refused(send(c, "POST", P.url + "/generate", {**pd_fields(P), **body}), f"prefill {body}")
            assert_refused(send(c, "POST", router.url + "/generate", body), f"router {body}")
        for base in (P.url, D.url, router.url):  # the other routes: methods and paths that do not exist
            for method, path in (("POST", "/health"), ("GET", "/generate"), ("DELETE", "/v1/models"),
                                 ("GET", "/nope"), ("PUT", "/server_info"), ("POST", "/metrics")):
                assert_refused(send(c, method, base + path, None), f"{base} {method} {path}")
        for srv in (P, D):  # a chunked body (no Content-Length) is cut off once it passes the limit
            chunks = (b"x" * 65536 for _ in range(2 * LIMIT // 65536))
            r = c.post(srv.url + "/generate", content=chunks, headers={"Content-Type": "application/json"})
            assert r.status_code == 413, r.text
            assert_refused(r, f"{srv.role} chunked huge body")
        boot = f"http://127.0.0.1:{P.bootstrap_port}"
        for method, path, body in bootstrap_corpus(P.dp):
            label = f"bootstrap {method} {path} {str(body)[:60]}"
            assert_refused(send(c, method, boot + path, body), label)
        assert c.get(boot + "/route?prefill_dp_rank=-1").status_code == 200  # the topology is intact

        # valid but odd unicode is text like any other: served through the router
        for text in ODD_UNICODE:
            r = send(c, "POST", router.url + "/generate", {"text": text, "sampling_params": {"max_new_tokens": 3}})
            assert r.status_code == 200, (text, r.text)

        P.wait_idle()
        D.wait_idle()
        assert all(s.proc.poll() is None for s in (P, D)) and router.proc.poll() is None
        for url in (P.url, D.url, router.url):
            assert c.get(url + "/health").status_code == 200
        r = send(c, "POST", router.url + "/v1/chat/completions", {"messages": MSG, "max_tokens": 4})
        assert r.status_code == 200, r.text

    # open connections (keep-alive) close within seconds; a leak would stay
    wait_for(lambda: all(a <= b + 2 for a, b in zip(fds(*pids), fds_before)), 20,
             "fd counts back to where they were", lambda: f"{fds_before} -> {fds(*pids)}")
