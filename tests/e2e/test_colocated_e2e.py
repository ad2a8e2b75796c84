"""A real colocated server (dp 2, tiny random-weight model) over HTTP: concurrent and batched
requests equal one-at-a-time greedy outputs, streams concatenate to the non-streamed text,
each DP method spreads real workers' load as it says, and every bad input gets a 4xx JSON
error after which the workers are idle."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.harness.fault_tools import KnobServer  # noqa: E402
from tests.harness.tiny_model import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.e2e
CONTEXT = 20000  # long enough for requests that stay in flight while load is inspected
VOCAB = 400


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("colocated_tiny")), max_context=CONTEXT)


def start(model_dir: str, method: str, request) -> KnobServer:
    # knob workers: full speed, except while the DP-method test holds requests in flight
    server = KnobServer("colocated", model_dir, dp=2,
                    extra=["--load-balance-method", method, "--max-total-tokens", "48000"])
    request.addfinalizer(server.stop)
    return server.wait_ready()


@pytest.fixture(scope="module")
def server(model_dir, request):
    return start(model_dir, "round_robin", request)


def gen_body(ids, max_new: int, **kw) -> dict:
    sp = {"max_new_tokens": max_new, "temperature": 0.0, **kw.pop("sampling", {})}
    return {"input_ids": ids, "sampling_params": sp, **kw}


def mixed_prompts(n: int = 16) -> list[tuple[list[int], int]]:
    lengths = [1, 3, 7, 12, 20, 33, 47, 64, 65, 90, 5, 130, 2, 28, 71, 9]
    return [([(37 * i + 11 * j) % (VOCAB - 3) + 3 for j in range(lengths[i % 16])], 4 + (5 * i) % 29)
            for i in range(n)]


async def post_all(url: str, bodies: list[dict], path: str = "/generate") -> list[httpx.Response]:
    async with httpx.AsyncClient(timeout=120) as c:
        return await asyncio.gather(*(c.post(url + path, json=b) for b in bodies))


def test_concurrent_and_batched_equal_one_at_a_time(server):
    prompts = mixed_prompts()
    bodies = [gen_body(ids, n) for ids, n in prompts]
    alone = []
    for b in bodies:
        r = httpx.post(server.url + "/generate", json=b, timeout=120)
        assert r.status_code == 200, r.text
        alone.append(r.json())
    together = [r.json() for r in asyncio.run(post_all(server.url, bodies))]
    batched = httpx.post(server.url + "/generate", timeout=120, json={
        "input_ids": [ids for ids, _ in prompts],
        "sampling_params": [{"max_new_tokens": n, "temperature": 0.0} for _, n in prompts]}).json()
    for i, (ids, n) in enumerate(prompts):
        want = alone[i]
        assert want["meta_info"]["prompt_tokens"] == len(ids)
        assert 1 <= len(want["output_ids"]) <= n
        for got in (together[i], batched[i]):
            assert got["output_ids"] == want["output_ids"], i
            assert got["text"] == want["text"]
            assert got["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]
    assert len({tuple(a["output_ids"]) for a in alone}) > 8  # distinct outputs: a mix-up would show
    server.wait_idle()


def sse_events(resp: httpx.Response) -> list:
    events = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def stream(url: str, path: str, body: dict) -> list:
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    return events[:-1]


def test_streams_concatenate_to_the_non_streamed_text(server):
    body = {"text": "Hello, streaming world!", "sampling_params": {"max_new_tokens": 40, "temperature": 0.0}}
    full = httpx.post(server.url + "/generate", json=body, timeout=120).json()
    events = stream(server.url, "/generate", body)  # native: each event carries the text so far
    texts = [e["text"] for e in events]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:])) and len(events) > 1
    assert texts[-1] == full["text"] and events[-1]["output_ids"] == full["output_ids"]
    stop = full["text"][len(full["text"]) // 2:][:3]  # a stop string held back mid-stream
    for path, body, text_of in [
        ("/v1/completions", {"prompt": "Hello, streaming world!", "max_tokens": 40, "temperature": 0},
         lambda c: c["text"]),
        ("/v1/completions", {"prompt": "Hello, streaming world!", "max_tokens": 40, "temperature": 0,
                             "stop": [stop]}, lambda c: c["text"]),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 40,
                                  "temperature": 0}, lambda c: c["message"]["content"]),
    ]:
        reply = httpx.post(server.url + path, json=body, timeout=120).json()
        want = text_of(reply["choices"][0])
        chunks = stream(server.url, path, body)
        deltas = [c["choices"][0]["delta"].get("content", "") if "delta" in c["choices"][0]
                  else c["choices"][0]["text"] for c in chunks if c.get("choices")]
        assert "".join(deltas) == want, path
        assert want, path
    assert reply["usage"]["completion_tokens"] >= 1
    server.wait_idle()


class Hold:
    """A long streaming request, in flight once its first event arrived; close() disconnects
    (which should abort it; if not, it runs to its end, a few seconds)."""

    def __init__(self, url: str, prompt_len: int, max_new: int):
        self.client = httpx.Client(timeout=60)
        body = gen_body([5] * prompt_len, max_new, sampling={"ignore_eos": True}, stream=True)
        self.ctx = self.client.stream("POST", url + "/generate", json=body)
        resp = self.ctx.__enter__()
        try:
            assert resp.status_code == 200
            self.lines = resp.iter_lines()  # kept: dropping the iterator would close the stream
            assert next(line for line in self.lines if line.startswith("data: "))  # running
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.ctx.__exit__(None, None, None)
        self.client.close()


@pytest.fixture
def method_server(request, server, model_dir) -> tuple[str, KnobServer]:
    method = request.param
    return method, server if method == "round_robin" else start(model_dir, method, request)


# One sequence for every method: H1 (a long prompt: cost ~19000 tokens), a short request that
# finishes, then H2, H3, H4 (cost ~6000 each), all in flight while the load is read.
# round_robin ignores the load (rank 0 gets H1, H2, H4); shortest_queue balances requests (ties
# by tokens); minimum_tokens balances tokens (H2..H4 together cost less than H1).
# The workers sleep before each step meanwhile, so no hold can reach its max_new_tokens (and
# leave its worker while the front, blocked on the unread stream, still counts it) on a slow CI.
EXPECTED = {"round_robin": [3, 1], "shortest_queue": [2, 2], "minimum_tokens": [1, 3]}


@pytest.mark.parametrize("method_server", list(EXPECTED), indirect=True)
def test_dp_methods_spread_load_as_they_say(method_server):
    method, s = method_server
    assert s.info()["load_balance_method"] == method
    s.wait_idle()
    holds = []
    s.slow(step_s=0.005)  # >= 30 s before a hold could finish its 6000 tokens
    try:
        holds.append(Hold(s.url, 13000, 6000))
        short = httpx.post(s.url + "/generate", json=gen_body([7, 8, 9], 2), timeout=60)
        assert short.status_code == 200
        for _ in range(3):
            holds.append(Hold(s.url, 8, 6000))
        workers = sorted(s.info()["workers"], key=lambda w: w["dp_rank"])
        front = [w["front_inflight_requests"] for w in workers]
        real = [w["running_requests"] + w["waiting_requests"] for w in workers]
        assert front == EXPECTED[method] and real == EXPECTED[method], (method, workers)
    finally:
        s.slow(step_s=0.0)
        for h in holds:
            h.close()
    s.wait_idle(timeout=120)


BAD_GENERATE = {
    "not an object": [1, 2],
    "text not a string": {"text": 5},
    "both text and ids": {"text": "a", "input_ids": [5]},
    "ids not ints": {"input_ids": [5, "x"]},
    "empty text": {"text": ""},
    "empty ids": {"input_ids": []},
    "token outside vocab": {"input_ids": [VOCAB + 7]},
    "prompt past context": {"input_ids": [5] * (CONTEXT + 1)},
    "prompt + max_new past context": gen_body([5] * 10, CONTEXT),
    "negative max_new_tokens": gen_body([5], -1),
    "huge max_new_tokens": gen_body([5], 1 << 40),
    "max_new_tokens a string": gen_body([5], "ten"),
    "sampling_params not an object": {"input_ids": [5], "sampling_params": "greedy"},
    "temperature negative": gen_body([5], 4, sampling={"temperature": -1}),
    "top_p zero": gen_body([5], 4, sampling={"top_p": 0}),
    "top_k zero": gen_body([5], 4, sampling={"top_k": 0}),
    "stop not strings": gen_body([5], 4, sampling={"stop": 5}),
    "stop_token_ids negative": gen_body([5], 4, sampling={"stop_token_ids": [-3]}),
    "ignore_eos not bool": gen_body([5], 4, sampling={"ignore_eos": "yes"}),
    "stream not bool": gen_body([5], 4, stream="yes"),
    "routed_dp_rank out of range": gen_body([5], 4, routed_dp_rank=2),
    "data_parallel_rank out of range": gen_body([5], 4, data_parallel_rank=-1),
}
BAD_OPENAI = {
    "/v1/completions": {
        "no prompt": {"max_tokens": 4},
        "prompt a number": {"prompt": 5, "max_tokens": 4},
        "negative max_tokens": {"prompt": "hi", "max_tokens": -2},
        "max_tokens a string": {"prompt": "hi", "max_tokens": "many"},
        "prompt past context": {"prompt": [5] * (CONTEXT + 1)},
    },
    "/v1/chat/completions": {
        "messages a string": {"messages": "hi", "max_tokens": 4},
        "no messages": {"messages": [], "max_tokens": 4},
        "message without role": {"messages": [{"content": "hi"}], "max_tokens": 4},
        "huge max_completion_tokens": {"messages": [{"role": "user", "content": "hi"}],
                                       "max_completion_tokens": 1 << 40},
    },
}


def _assert_4xx(resp: httpx.Response, what: str) -> None:
    assert 400 <= resp.status_code < 500, (what, resp.status_code, resp.text[:300])
    err = resp.json()["error"]
    assert isinstance(err["message"], str) and err["message"], what
    assert isinstance(err["type"], str) and err["type"], what


def test_bad_inputs_get_4xx_and_workers_stay_idle(server):
    with httpx.Client(timeout=60) as c:
        for path in ("/generate", "/v1/completions", "/v1/chat/completions"):
            r = c.post(server.url + path, content=b'{"text": "unterminated',
                       headers={"content-type": "application/json"})
            _assert_4xx(r, f"malformed JSON on {path}")
        for what, body in BAD_GENERATE.items():
            _assert_4xx(c.post(server.url + "/generate", json=body), what)
        for path, cases in BAD_OPENAI.items():
            for what, body in cases.items():
                _assert_4xx(c.post(server.url + path, json=body), f"{path}: {what}")
        # unknown fields are ignored; the server still serves
        ok = c.post(server.url + "/generate", json={**gen_body([5, 6], 3), "frobnicate": {"x": [1]},
                                                    "sampling_params": {"max_new_tokens": 3, "temperature": 0,
                                                                        "ignore_eos": True, "whatever": 1}})
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3, ok.text
    server.wait_idle()
