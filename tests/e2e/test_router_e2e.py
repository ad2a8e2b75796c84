"""Issue 4 end to end: our router process in front of real prefill/decode servers (tiny model).

Every answer through the router must equal the colocated server's greedy answer; failures must
give one error at once and leave both servers idle; a dead server leaves selection and returns.
All processes bind 127.0.0.1 on free ports and are stopped by pid in fixture finalizers.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.harness import cluster  # noqa: E402
from tests.harness.cluster import Server  # noqa: E402
from tests.harness.fault_tools import Router, wait_for  # noqa: E402
from tests.harness.shared_servers import COLOCATED, DECODE_DP2, PREFILL_DP2, borrow  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]
# servers borrowed from the session's shared ones (shared_servers.py)
LENT = {"colo": COLOCATED, "p": PREFILL_DP2, "d": DECODE_DP2}

PROMPTS = ["Hello world", "The capital of France is", "abc def ghi"]
GREEDY = {"max_new_tokens": 12, "temperature": 0}
NO_HANG_S = 15.0  # below FAST_ENV's 20 s handoff deadlines: an error slower than this was a hang


def sse(text: str) -> list[dict]:
    """The JSON events of an SSE body, which must end with `data: [DONE]`."""
    lines = [ln[len("data: "):] for ln in text.splitlines() if ln.startswith("data: ")]
    assert lines and lines[-1] == "[DONE]", text[-500:]
    return [json.loads(ln) for ln in lines[:-1]]


def post(url: str, path: str, body: dict, timeout: float = 60.0) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=timeout)


# ---------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("router_e2e"))


@pytest.fixture(scope="module")
def model_dir(shared_servers):
    return shared_servers.model_dir


@pytest.fixture(scope="module")
def servers(shared_servers):
    """(colocated, prefill dp 2 follow_bootstrap_room, decode dp 2), all up (lent: no test
    kills them; the ones killed are `spare`'s)."""
    with borrow(shared_servers, LENT) as s:
        yield s["colo"], s["p"], s["d"]


@pytest.fixture(scope="module")
def colo(servers):
    return servers[0]


@pytest.fixture(scope="module")
def router(servers, workdir):
    r = Router([servers[1]], [servers[2]], "--health-check-interval-secs", "1", log_dir=workdir)
    try:
        yield r.wait_healthy()
    finally:
        r.stop()


@pytest.fixture(scope="module")
def dp_router(servers, workdir):
    r = Router([servers[1]], [servers[2]], "--dp-aware", "--health-check-interval-secs", "1", log_dir=workdir)
    try:
        yield r.wait_healthy()
    finally:
        r.stop()


@pytest.fixture(scope="module")
def reference(colo):
    """Colocated greedy /generate answers per prompt."""
    return {p: post(colo.url, "/generate", {"text": p, "sampling_params": GREEDY}).json() for p in PROMPTS}


def assert_idle(*servers: Server) -> None:
    for s in servers:
        s.wait_idle(timeout=20)


# ---------------------------------------------------------------------------------------------- /generate

def test_generate_single_equals_colocated(router, reference, servers):
    for prompt in PROMPTS:
        r = post(router.url, "/generate", {"text": prompt, "sampling_params": GREEDY})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["output_ids"] == reference[prompt]["output_ids"]
        assert out["text"] == reference[prompt]["text"]
        assert out["meta_info"]["dp_rank_path"] == "fast"  # room % dp on a follow_bootstrap_room prefill
    assert_idle(*servers[1:])


def test_flush_cache_reaches_every_server(router, reference, servers):
    """POST /flush_cache on the router empties the prefix cache of each prefill and decode rank."""
    for prompt in PROMPTS:  # fill the caches on both sides
        assert post(router.url, "/generate", {"text": prompt, "sampling_params": GREEDY}).status_code == 200
    P, D = servers[1], servers[2]
    before = sum(w["cached_pages"] for s in (P, D) for w in s.wait_idle(timeout=20))
    assert before > 0
    r = httpx.post(router.url + "/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    got = r.json()
    assert got["success"] and {x["url"] for x in got["servers"]} == {P.url, D.url}
    assert sum(x["flushed_pages"] for x in got["servers"]) == before
    assert all(w["cached_pages"] == 0 and w["free_pages"] == w["total_pages"]
               for s in (P, D) for w in s.info()["workers"])


def test_generate_batch_equals_colocated(router, reference):
    r = post(router.url, "/generate", {"text": PROMPTS, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [o["output_ids"] for o in out] == [reference[p]["output_ids"] for p in PROMPTS]
    assert len({o["meta_info"]["bootstrap_room"] for o in out}) == len(PROMPTS)


def test_generate_stream_equals_colocated(router, reference):
    prompt = PROMPTS[1]
    r = post(router.url, "/generate", {"text": prompt, "sampling_params": GREEDY, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    events = sse(r.text)
    assert len(events) > 1
    # native streaming is cumulative, as in SGLang: the last event holds the whole answer
    assert events[-1]["output_ids"] == reference[prompt]["output_ids"]
    assert events[-1]["text"] == reference[prompt]["text"]
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


# ---------------------------------------------------------------------------------------------- OpenAI routes

def _openai_text(route: str, choice: dict) -> str:
    return choice["text"] if route == "/v1/completions" else choice["message"]["content"]


def _openai_delta(route: str, choice: dict) -> str:
    return choice.get("text", "") if route == "/v1/completions" else (choice["delta"].get("content") or "")


@pytest.mark.parametrize("route,payload", [
    ("/v1/completions", {"prompt": "Once upon a time"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "What is the capital of France?"}]}),
])
def test_openai_routes_equal_colocated_stream_and_not(router, colo, servers, route, payload):
    body = {"model": "tiny", "max_tokens": 10, "temperature": 0, **payload}
    ref = post(colo.url, route, body).json()
    got = post(router.url, route, body)
    assert got.status_code == 200, got.text
    got = got.json()
    text = _openai_text(route, got["choices"][0])
    assert text == _openai_text(route, ref["choices"][0]) and text
    assert got["usage"] == ref["usage"]
    streamed = post(router.url, route, {**body, "stream": True})
    assert streamed.status_code == 200, streamed.text
    events = sse(streamed.text)
    assert "".join(_openai_delta(route, e["choices"][0]) for e in events if e.get("choices")) == text
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert_idle(*servers[1:])


def test_official_openai_client(router, colo):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", timeout=60, max_retries=0)
    ref_client = openai.OpenAI(base_url=colo.url + "/v1", api_key="unused", timeout=60, max_retries=0)
    assert client.models.list().data[0].id == "tiny"
    messages = [{"role": "user", "content": "Name a color."}]
    kw = dict(model="tiny", max_tokens=10, temperature=0)
    ref = ref_client.chat.completions.create(messages=messages, **kw).choices[0].message.content
    chat = client.chat.completions.create(messages=messages, **kw)
    assert chat.choices[0].message.content == ref and chat.usage.completion_tokens == 10
    stream = client.chat.completions.create(messages=messages, stream=True, **kw)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == ref
    comp = client.completions.create(prompt="Hello", **kw)
    assert comp.choices[0].text == ref_client.completions.create(prompt="Hello", **kw).choices[0].text


# ---------------------------------------------------------------------------------------------- rooms

def prefill_items(prefill: Server) -> float:
    text = httpx.get(prefill.url + "/metrics", timeout=10).text
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("pdserve_items_total{"))


def test_n_samples_get_distinct_rooms(router, reference, servers):
    prefill = servers[1]
    before = prefill_items(prefill)
    r = post(router.url, "/generate", {"text": PROMPTS[0], "sampling_params": {**GREEDY, "n": 3}})
    assert r.status_code == 200, r.text
    out = r.json()
    assert len(out) == 3 and all(o["output_ids"] == reference[PROMPTS[0]]["output_ids"] for o in out)
    assert len({o["meta_info"]["bootstrap_room"] for o in out}) == 3
    chat = post(router.url, "/v1/chat/completions", {"model": "tiny", "max_tokens": 4, "temperature": 0, "n": 2,
                                                      "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.status_code == 200 and len(chat.json()["choices"]) == 2, chat.text
    # one room per sample: a room used twice at once would have been refused (400), and every
    # sample reached the prefill
    assert prefill_items(prefill) - before == 3 + 2


# ---------------------------------------------------------------------------------------------- failures

def test_prefill_only_rejection_is_one_fast_error(router, reference, servers):
    """routed_dp_rank=1 conflicts with follow_bootstrap_room whenever room % 2 == 0 (random room)."""
    body = {"text": PROMPTS[2], "sampling_params": GREEDY, "routed_dp_rank": 1}
    for _ in range(40):  # P(no conflict in 40 tries) = 2^-40
        t0 = time.monotonic()
        r = post(router.url, "/generate", body)
        elapsed = time.monotonic() - t0
        if r.status_code == 200:
            assert r.json()["output_ids"] == reference[PROMPTS[2]]["output_ids"]
            continue
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert "follow_bootstrap_room conflict" in err["message"] and "prefill server" in err["message"]
        assert "bootstrap_room=" in err["message"] and err["type"]
        assert elapsed < NO_HANG_S, f"the error took {elapsed:.1f}s: the decode leg was not cancelled"
        break
    else:
        pytest.fail("no follow_bootstrap_room conflict in 40 requests")
    assert_idle(*servers[1:])
    ok = post(router.url, "/generate", {"text": PROMPTS[2], "sampling_params": GREEDY})
    assert ok.json()["output_ids"] == reference[PROMPTS[2]]["output_ids"]


def test_dp_aware_never_conflicts(dp_router, reference, servers):
    def one(i: int) -> dict:
        prompt = PROMPTS[i % len(PROMPTS)]
        r = post(dp_router.url, "/generate", {"text": prompt, "sampling_params": GREEDY})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["output_ids"] == reference[prompt]["output_ids"]
        return out["meta_info"]

    with ThreadPoolExecutor(4) as pool:
        metas = list(pool.map(one, range(24)))
    assert {m["dp_rank_path"] for m in metas} == {"hint"}
    assert {m["prefill_dp_rank"] for m in metas} == {0, 1} and {m["decode_dp_rank"] for m in metas} == {0, 1}
    # mixed routing really happened: some pinned ranks differ from what the room implies
    assert any(m["prefill_dp_rank"] != m["bootstrap_room"] % 2 for m in metas)
    assert_idle(*servers[1:])


@pytest.fixture
def spare(workdir, model_dir):
    """A prefill and a decode (dp 1 each) of their own, to kill and restart; the current ones are
    stopped at the end, successors included."""
    held: dict[str, Server] = {}
    try:
        for role in ("prefill", "decode"):
            held[role] = Server(role, model_dir, log_dir=workdir)
        for s in held.values():
            s.wait_ready()
        yield held
    finally:
        for s in held.values():
            s.stop()


def _restart_on_same_ports(old: Server, model_dir: str, workdir: str, monkeypatch) -> Server:
    ports = iter([old.port, old.bootstrap_port])
    monkeypatch.setattr(cluster, "free_port", lambda: next(ports))
    return Server(old.role, model_dir, log_dir=workdir).wait_ready()


def _load(s: Server) -> int:
    return sum(w["waiting_requests"] + w["inflight_transfers"] + w["running_requests"] for w in s.info()["workers"])


def _health_of(r: Router, role: str) -> str:
    return httpx.get(r.url + "/server_info", timeout=10).json()[role][0]["health"]


def test_killed_servers_fail_fast_leave_selection_and_return(spare, reference, workdir, model_dir, monkeypatch):
    r = Router([spare["prefill"]], [spare["decode"]], "--health-check-interval-secs", "0.3",
               "--health-failure-threshold", "2", log_dir=workdir).wait_healthy()
    body = {"text": PROMPTS[0], "sampling_params": GREEDY}
    expected = reference[PROMPTS[0]]["output_ids"]
    try:
        assert post(r.url, "/generate", body).json()["output_ids"] == expected
        # 1. kill -9 the prefill while a request is in flight (frozen first, so it surely is)
        prefill = spare["prefill"]
        prefill.kill(signal.SIGSTOP)
        result: dict = {}

        def send() -> None:
            t0 = time.monotonic()
            result["resp"] = post(r.url, "/generate", body, timeout=60)
            result["elapsed"] = time.monotonic() - t0

        sender = threading.Thread(target=send)
        sender.start()
        wait_for(lambda: _load(spare["decode"]) > 0, 20, "the decode to hold the request")
        prefill.kill(signal.SIGKILL)
        sender.join(60)
        assert not sender.is_alive()
        resp = result["resp"]
        assert resp.status_code >= 500 and prefill.url in resp.json()["error"]["message"], resp.text
        assert result["elapsed"] < NO_HANG_S, f"the error took {result['elapsed']:.1f}s"
        assert_idle(spare["decode"])

        # 2. taken out of selection, and back once a new prefill listens on the same ports
        wait_for(lambda: httpx.get(r.url + "/health", timeout=5).status_code == 503, 20, "router /health 503")
        assert _health_of(r, "prefill") == "unhealthy"
        down = post(r.url, "/generate", body)
        assert down.status_code == 503 and "no healthy prefill" in down.json()["error"]["message"], down.text
        spare["prefill"] = _restart_on_same_ports(prefill, model_dir, workdir, monkeypatch)
        r.wait_healthy(timeout=30)
        assert _health_of(r, "prefill") == "healthy"
        # the decode must notice the new instance behind the same address (no stale endpoint)
        after = post(r.url, "/generate", body)
        assert after.status_code == 200, after.text
        assert after.json()["output_ids"] == expected
        assert_idle(spare["prefill"], spare["decode"])

        # 3. the same for the decode (killed idle), then a request end to end through the new pair
        decode = spare["decode"]
        decode.kill(signal.SIGKILL)
        wait_for(lambda: httpx.get(r.url + "/health", timeout=5).status_code == 503, 20, "router /health 503")
        assert _health_of(r, "decode") == "unhealthy"
        spare["decode"] = _restart_on_same_ports(decode, model_dir, workdir, monkeypatch)
        r.wait_healthy(timeout=30)
        again = post(r.url, "/generate", body)
        assert again.status_code == 200, again.text
        assert again.json()["output_ids"] == expected
        assert_idle(spare["prefill"], spare["decode"])
    finally:
        r.stop()
