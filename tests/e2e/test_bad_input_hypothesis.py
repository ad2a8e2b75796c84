"""Property tests with generated request bodies (hypothesis, derandomized).

Generation routes, through the router to a prefill and a decode server: whatever the body (known
fields with odd values, unknown fields, any JSON shape, NaN, unpaired surrogates), the answer is
a result (200, JSON or a complete SSE stream) or a 4xx JSON error, never a 5xx or a hang, and the
servers end idle. Bootstrap service (in-process, its own table): any body on any route gets 200
or a 4xx JSON error, never a 5xx.
"""

from __future__ import annotations

import json

import httpx
import pytest
from fault_tools import Router  # noqa: E402
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from shared_servers import DECODE, PREFILL, borrow  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
# servers borrowed from the session's shared ones (shared_servers.py)
LENT = {"P": PREFILL, "D": DECODE}

SETTINGS = settings(max_examples=200, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])

EDGE_INTS = st.sampled_from([-(2 ** 64), -(2 ** 31), -2, -1, 0, 1, 2, 3, 63, 64, 511, 512, 513, 2 ** 16,
                             2 ** 31, 2 ** 63 - 1, 2 ** 63, 2 ** 64, 10 ** 30])
INTS = st.one_of(st.integers(-3, 40), EDGE_INTS)
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, 0.5, 1.0, 1e-9, 2.0]))
TEXT = st.one_of(st.text(max_size=40),
                 st.sampled_from(["", " ", "\ud800", "a\udc00", "\x00", "👩‍👩‍👧", "hello " * 5]))
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
ANY = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                    st.dictionaries(TEXT, inner, max_size=3)), max_leaves=8)


def maybe(strategy):
    """Mostly a value of the field's own type, sometimes anything."""
    return st.one_of(strategy, strategy, strategy, ANY)


GOOD_TEXT = st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=40)
GOOD_IDS = st.lists(st.integers(0, 399), min_size=1, max_size=8)
SAMPLING = st.fixed_dictionaries({}, optional={
    "max_new_tokens": maybe(st.integers(1, 12)), "temperature": maybe(st.floats(0, 2)),
    "top_p": maybe(st.floats(0.01, 1)), "top_k": maybe(st.sampled_from([-1, 1, 5, 50])),
    "min_p": maybe(st.floats(0, 1)), "n": maybe(st.integers(1, 2)), "stop": maybe(st.lists(GOOD_TEXT, max_size=2)),
    "stop_token_ids": maybe(st.lists(st.integers(0, 399), max_size=3)), "ignore_eos": maybe(st.booleans()),
    "seed": maybe(st.integers(0, 2 ** 63 - 1))})
COMMON = {"stream": maybe(st.booleans()), "rid": maybe(st.uuids().map(str)), "routed_dp_rank": maybe(st.just(0)),
          "return_logprob": maybe(st.booleans()), "unknown_field": ANY}
PROMPT = st.one_of(st.fixed_dictionaries({"text": maybe(st.one_of(GOOD_TEXT, st.lists(GOOD_TEXT, min_size=1,
                                                                                      max_size=2)))}),
                   st.fixed_dictionaries({"input_ids": maybe(GOOD_IDS)}), st.fixed_dictionaries({}))
GENERATE = st.builds(lambda p, rest: {**rest, **p}, PROMPT, st.fixed_dictionaries({}, optional={
    "sampling_params": maybe(SAMPLING), **COMMON}))
COMPLETIONS = st.fixed_dictionaries({"prompt": maybe(st.one_of(GOOD_TEXT, st.lists(GOOD_TEXT, min_size=1, max_size=2),
                                                              GOOD_IDS))}, optional={
    "max_tokens": maybe(st.integers(1, 12)), "temperature": maybe(st.floats(0, 2)), "n": maybe(st.integers(1, 2)),
    "logprobs": maybe(st.integers(0, 5)), "stop": maybe(GOOD_TEXT), "model": maybe(GOOD_TEXT), **COMMON})
MESSAGE = st.fixed_dictionaries({"role": maybe(st.sampled_from(["user", "system", "assistant"])),
                                 "content": maybe(GOOD_TEXT)})
CHAT = st.fixed_dictionaries({"messages": maybe(st.lists(MESSAGE, min_size=1, max_size=3))}, optional={
    "max_tokens": maybe(st.integers(1, 12)), "max_completion_tokens": maybe(st.integers(1, 12)),
    "temperature": maybe(st.floats(0, 2)), "n": maybe(st.integers(1, 2)), **COMMON})
ROUTES = {"/generate": GENERATE, "/v1/completions": COMPLETIONS, "/v1/chat/completions": CHAT}


def body_bytes(body) -> bytes:
    """Encoded as a lenient client would: NaN as NaN, surrogates as \\u escapes."""
    return json.dumps(body, ensure_ascii=True, allow_nan=True).encode()


def assert_answered(r: httpx.Response, what: str) -> None:
    event(f"HTTP {r.status_code // 100}xx")
    assert r.status_code < 500, f"{what} -> {r.status_code}: {r.text[:400]}"
    if r.status_code >= 400:
        err = r.json()["error"]
        assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), what
    elif r.headers.get("content-type", "").startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]"), f"{what}: {r.text[-300:]}"
        assert '"error"' not in r.text, f"{what}: {r.text[-400:]}"
    else:
        r.json()


@pytest.fixture(scope="module")
def stack(shared_servers, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("hypothesis"))
    with borrow(shared_servers, LENT) as s:
        P, D = s["P"], s["D"]
        router = Router([P], [D], log_dir=logs).wait_healthy()
        try:
            with httpx.Client(timeout=60) as client:
                yield P, D, router, client
        finally:
            router.stop()


@SETTINGS
@given(data=st.data())
def test_generated_generation_bodies(stack, data):
    P, D, router, client = stack
    path = data.draw(st.sampled_from(sorted(ROUTES)), label="route")
    body = data.draw(st.one_of(ROUTES[path], ROUTES[path], ANY), label="body")
    r = client.post(router.url + path, content=body_bytes(body), headers={"Content-Type": "application/json"})
    assert_answered(r, f"POST {path} {body!r}"[:600])


def test_servers_idle_after_generated_bodies(stack):
    P, D, router, client = stack
    P.wait_idle()
    D.wait_idle()
    r = client.post(router.url + "/generate", json={"text": "still here", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200, r.text


@pytest.fixture(scope="module")
def bootstrap():
    from pdserve.disagg.bootstrap_server import ThreadedBootstrap
    from pdserve.disagg.bootstrap_table import BootstrapTable, RankInfo

    table = BootstrapTable(dp_size=2)
    for rank in (0, 1):  # ready: a 503 (not every rank registered) is then never right
        table.register_rank(RankInfo(rank, 2, "127.0.0.1", 9000 + rank, 4, "float32", "follow_bootstrap_room"))
    srv = ThreadedBootstrap(table)
    with httpx.Client(timeout=10) as client:
        yield f"http://{srv.addr}", client
    srv.stop()


RANK = st.fixed_dictionaries({}, optional={k: maybe(v) for k, v in {
    "dp_rank": INTS, "dp_size": INTS, "rank_ip": TEXT, "rank_port": INTS, "page_size": INTS,
    "kv_cache_dtype": TEXT, "load_balance_method": st.sampled_from(["auto", "round_robin", "follow_bootstrap_room"]),
    "fingerprint": ANY, "endpoint": ANY, "transfer_backend": TEXT}.items()})


@SETTINGS
@given(data=st.data())
def test_generated_bootstrap_bodies(bootstrap, data):
    base, client = bootstrap
    register = st.fixed_dictionaries({}, optional={"bootstrap_room": maybe(INTS), "dp_rank": maybe(INTS)})
    query = st.fixed_dictionaries({}, optional={"bootstrap_rooms": maybe(st.lists(INTS))})
    method, path, strategy = data.draw(st.sampled_from([
        ("PUT", "/route", RANK), ("POST", "/register_dp_rank", register), ("POST", "/query_dp_ranks", query)]),
        label="route")
    body = data.draw(st.one_of(strategy, ANY), label="body")
    r = client.request(method, base + path, content=body_bytes(body), headers={"Content-Type": "application/json"})
    assert_answered(r, f"{method} {path} {body!r}"[:600])
    k = data.draw(st.one_of(st.text(max_size=20), INTS.map(str)), label="prefill_dp_rank")
    r = client.get(base + "/route", params={"prefill_dp_rank": k})
    assert_answered(r, f"GET /route?prefill_dp_rank={k!r}")
