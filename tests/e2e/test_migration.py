"""Request migration through `pdserve router` on real processes (tiny model, 127.0.0.1): a decode
DP worker killed mid-answer moves every request it held to the other decode, which finishes the
answer with the colocated greedy text (streamed: one unbroken stream; not streamed: a new try);
with --migration-limit 0, or with no other healthy decode, a stream whose decode server dies
ends at once with an error that says why it was not moved, and nothing is left held; a stream
whose connection to the only decode is cut (the decode stays healthy) continues on that decode.

One module-scoped set: prefill P, decodes D1 and D2 (tests.harness.slow_worker, so the decode window is
wide), a colocated reference C; router R1 (limit 1) over P + D1 + D2, router R0 (limit 0) over
P + D2, router RC (limit 1) over P + a cuttable proxy to D2. The tests run in order: the first
cuts RC's connections, the second kills D1's worker, the third all of D2.
"""

from __future__ import annotations

import json
import threading
import types
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdserve.bench.tcp_proxy import TcpProxy
from tests.harness.cluster import Server
from tests.harness.fault_tools import KnobServer, Router, decoding, wait_for
from tests.harness.shared_servers import COLOCATED

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]
LENT = {"C": COLOCATED}  # only the colocated reference is borrowed (shared_servers.py)

N = 32  # output tokens
STEP_S = 0.1  # decode step while a test waits to kill (32 tokens take 3.2 s)
HOLD_S = 0.5  # decode step while the requests are sent one by one
GREEDY = {"temperature": 0, "ignore_eos": True}
PROMPTS = {"/generate": "the quick brown fox", "/v1/completions": "once upon a time",
           "/v1/chat/completions": "tell me a story"}


def body_for(path: str, stream: bool) -> dict:
    if path == "/generate":
        return {"text": PROMPTS[path], "sampling_params": {"max_new_tokens": N, **GREEDY}, "stream": stream}
    out = {"max_tokens": N, **GREEDY, "stream": stream}
    if stream:
        out["stream_options"] = {"include_usage": True}
    if path == "/v1/completions":
        return {**out, "prompt": PROMPTS[path]}
    return {**out, "messages": [{"role": "user", "content": PROMPTS[path]}]}


@pytest.fixture(scope="module")
def cluster(shared_servers, tmp_path_factory):
    logs = str(tmp_path_factory.mktemp("migration"))
    model = shared_servers.model_dir
    servers = {"P": KnobServer("prefill", model, log_dir=logs), "D1": KnobServer("decode", model, log_dir=logs),
               "D2": KnobServer("decode", model, log_dir=logs)}
    P, D1, D2 = servers["P"], servers["D1"], servers["D2"]  # the routers wait for them (health checks)
    proxy = TcpProxy(("127.0.0.1", D2.port))
    routers = [Router([P], [D1, D2], "--migration-limit", "1", log_dir=logs),
               Router([P], [D2], "--migration-limit", "0", log_dir=logs),
               Router([P], [types.SimpleNamespace(url=f"http://127.0.0.1:{proxy.port}")], "--migration-limit", "1",
                      log_dir=logs)]
    try:
        servers.update(shared_servers.lend(LENT))
        for s in servers.values():
            s.wait_ready()
        for r in routers:
            r.wait_healthy()
        yield types.SimpleNamespace(**servers, R1=routers[0], R0=routers[1], RC=routers[2], proxy=proxy)
    finally:
        with ThreadPoolExecutor(len(servers) + len(routers)) as pool:  # each stop waits for its exit
            list(pool.map(lambda proc: proc.stop(), [*routers, P, D1, D2]))
        proxy.close()
    shared_servers.give_back(LENT)


@pytest.fixture(scope="module")
def reference(cluster):
    """Colocated greedy answers: path -> (text, prompt_tokens)."""
    out = {}
    for path in PROMPTS:
        r = httpx.post(cluster.C.url + path, json=body_for(path, False), timeout=60)
        assert r.status_code == 200, r.text
        j = r.json()
        if path == "/generate":
            out[path] = (j["text"], j["meta_info"]["prompt_tokens"], j["output_ids"])
        else:
            choice = j["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            out[path] = (text, j["usage"]["prompt_tokens"], None)
    return out


class StreamReader:
    """A streamed request on a thread; `events` are the data events so far (the error one too)."""

    def __init__(self, url: str, body: dict):
        self.events: list[dict] = []
        self.done = False
        self.status: int | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()

    def _run(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", url, json=body, timeout=60) as resp:
                self.status = resp.status_code
                for line in resp.iter_lines():
                    if line == "data: [DONE]":
                        self.done = True
                    elif line.startswith("data: "):
                        self.events.append(json.loads(line[6:]))
                    elif line.startswith(":"):
                        raise AssertionError(f"the router passed on an internal line: {line}")
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def result(self) -> list[dict]:
        self.thread.join(60)
        assert self.error is None and not self.thread.is_alive(), self.error
        assert self.status == 200 and self.done, (self.status, self.events[-1:])
        return self.events


def streamed_text(path: str, events: list[dict]) -> str:
    if path == "/generate":
        return events[-1]["text"]
    return "".join(c["choices"][0]["delta"].get("content") or "" if "delta" in c["choices"][0]
                   else c["choices"][0]["text"] for c in events if c.get("choices"))


def inflight(server: Server) -> int:
    """Requests the server's front holds (dispatched, not yet ended)."""
    return sum(w["front_inflight_requests"] for w in server.info()["workers"])


def metric(router: Router, outcome: str) -> float:
    text = httpx.get(router.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith(f'pdserve_router_migrations_total{{outcome="{outcome}"}}'):
            return float(line.split()[-1])
    return 0.0


def check_answer(path: str, got_text: str, usage_or_meta: dict, reference, output_ids=None) -> None:
    want_text, want_prompt, want_ids = reference[path]
    assert got_text == want_text, path
    if path == "/generate":
        assert usage_or_meta["completion_tokens"] == N and usage_or_meta["prompt_tokens"] == want_prompt
        assert output_ids == want_ids
    else:
        assert usage_or_meta["completion_tokens"] == N and usage_or_meta["prompt_tokens"] == want_prompt
        assert usage_or_meta["total_tokens"] == want_prompt + N


def test_a_cut_connection_to_the_only_decode_continues_the_stream_there(cluster, reference):
    """The router's connection to its one decode breaks mid-answer while the decode lives: its
    probe passes, so the answer moves back onto that decode (which drops the old item of that
    rid at once) and the client sees one unbroken stream with the colocated text."""
    P, D2, RC, path = cluster.P, cluster.D2, cluster.RC, "/v1/chat/completions"
    D2.slow(step_s=STEP_S)
    s = StreamReader(RC.url + path, body_for(path, True))
    wait_for(lambda: len(s.events) >= 3, 30, "the stream under way")
    assert cluster.proxy.cut() >= 1
    D2.slow()
    events = s.result()
    assert "error" not in events[-1], events[-1]
    check_answer(path, streamed_text(path, events), events[-1]["usage"], reference)
    assert len({(e["id"], e["created"]) for e in events}) == 1
    assert metric(RC, "started") == metric(RC, "succeeded") == 1
    P.wait_idle()
    D2.wait_idle()


def test_decode_worker_killed_mid_answer_moves_every_request_to_the_other_decode(cluster, legs, reference):
    P, D1, D2, R1 = cluster.P, cluster.D1, cluster.D2, cluster.R1
    for d in (D1, D2):  # nothing may finish while the requests go out one by one
        d.slow(step_s=HOLD_S)
    # each request twice, the pair after the pairs before it arrived: round robin puts one of
    # each pair on D1, whichever of the two comes first
    streams, plain, sent = [], [], 0
    for path in PROMPTS:
        for stream in (True, False):
            for _ in range(2):
                if stream:
                    streams.append((path, StreamReader(R1.url + path, body_for(path, True))))
                else:
                    plain.append((path, legs.post(R1.url + path, body_for(path, False), timeout=60)))
            sent += 2
            wait_for(lambda: inflight(D1) + inflight(D2) == sent, 20, f"requests {sent - 1}, {sent} at a decode")
    for d in (D1, D2):
        d.slow(step_s=STEP_S)
    wait_for(lambda: all(len(s.events) >= 3 for _, s in streams), 30, "every stream under way")
    assert decoding(D1, 0) and D1.worker(0)["running_requests"] == 6
    D1.kill_worker(0)
    D2.slow()  # the rest can go fast
    for path, s in streams:
        events = s.result()
        last = events[-1]
        assert "error" not in last, last
        if path == "/generate":
            check_answer(path, streamed_text(path, events), last["meta_info"], reference, last["output_ids"])
            assert len({e["meta_info"]["id"] for e in events}) == 1
        else:
            check_answer(path, streamed_text(path, events), last["usage"], reference)
            assert len({(e["id"], e["created"]) for e in events}) == 1  # one reply, however many servers
    for path, f in plain:
        r = f.result()
        assert not isinstance(r, Exception) and r.status_code == 200, r
        j = r.json()
        if path == "/generate":
            check_answer(path, j["text"], j["meta_info"], reference, j["output_ids"])
        else:
            choice = j["choices"][0]
            check_answer(path, choice["message"]["content"] if "message" in choice else choice["text"],
                         j["usage"], reference)
    moved = metric(R1, "started")
    assert moved == 6 and metric(R1, "succeeded") == 6 and metric(R1, "failed") == 0  # 3 routes x 2 kinds
    P.wait_idle()
    D2.wait_idle()


def test_no_other_healthy_decode_or_limit_zero_ends_the_stream_at_once(cluster, reference):
    P, D1, D2, R1, R0 = cluster.P, cluster.D1, cluster.D2, cluster.R1, cluster.R0

    def d1_out() -> bool:
        decodes = httpx.get(R1.url + "/server_info", timeout=10).json()["decode"]
        return next(d for d in decodes if d["url"] == D1.url)["health"] != "healthy"
    wait_for(d1_out, 20, "R1 to take D1 (its worker dead) out of selection")
    D2.slow(step_s=STEP_S)
    chat = StreamReader(R1.url + "/v1/chat/completions", body_for("/v1/chat/completions", True))
    gen = StreamReader(R0.url + "/generate", body_for("/generate", True))
    wait_for(lambda: len(chat.events) >= 3 and len(gen.events) >= 3, 30, "both streams under way")
    D2.kill()  # the whole server this time: its connections drop
    for s, words in ((chat, ["connection failed", "could not migrate", f"{D2.url} unhealthy"]),
                     (gen, ["connection failed", "not migrated: --migration-limit 0"])):
        events = s.result()
        err = events[-1]["error"]["message"]
        for w in words:
            assert w in err, err
        assert "bootstrap_room=" in err and D2.url in err
    # at once: the answers stopped short, and what was shown is the start of the reference
    text = streamed_text("/generate", gen.events[:-1])
    assert len(gen.events[-2]["output_ids"]) < N and reference["/generate"][0].startswith(text)
    assert reference["/v1/chat/completions"][0].startswith(streamed_text("/v1/chat/completions", chat.events[:-1]))
    assert metric(R0, "limit_reached") == 1 and metric(R0, "started") == 0
    assert metric(R1, "failed") == 1 and metric(R1, "started") == 6
    P.wait_idle()  # nothing stranded on the prefill that served them
