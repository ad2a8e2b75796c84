"""The HTTP front end to end: a real front process (`python -m pdserve.server.launch`) with
fake DP workers (tests/harness/fake_worker.py) on 127.0.0.1. Every route, batching, streaming, stop
strings, aborts on disconnect, bad input, DP methods, API key, the openai client, start-up
failures and shutdown without orphans."""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import time
from pathlib import Path

import httpx
import pytest

from pdserve.core.launcher import ProcessGroup, free_port, http_ok
from tests.harness.fake_worker import fake_generate, fake_logprob, write_fake_model
from tests.harness.procs import alive

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parents[2]
ERROR_TOKEN = 399
START_DEADLINE_S = 60.0


def children_of(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
    return out


def wait_until(cond, deadline_s: float = 20.0, what: str = "condition"):
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


class Server:
    """One front process plus its fake workers, in a process group of their own; `stop()`
    leaves no process behind."""

    def __init__(self, model_dir: str, log_path: Path, dp: int = 2, method: str = "auto",
                 env: dict | None = None, args: tuple = ()):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        cmd = [sys.executable, "-m", "pdserve.server.launch", "--model-dir", model_dir,
               "--worker-module", "tests.harness.fake_worker", "--port", str(self.port), "--dp-size", str(dp),
               "--load-balance-method", method, "--log-level", "warning", "--start-timeout", "30", *args]
        full_env = {**os.environ, "PYTHONPATH": str(REPO), "FAKE_WORKER_ERROR_TOKEN": str(ERROR_TOKEN), **(env or {})}
        self.group = ProcessGroup(cmd, name="front", log_path=str(log_path), cwd=REPO, env=full_env)
        self.workers: list[int] = []

    @property
    def proc(self):
        return self.group.proc

    def wait_ready(self) -> "Server":
        self.group.wait_healthy(lambda: http_ok(self.url + "/health"), START_DEADLINE_S, what="/health",
                                poll_s=0.05)
        self.workers = children_of(self.proc.pid)
        return self

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, sig=signal.SIGTERM) -> int:
        """`sig` to the front alone: it must stop its workers itself (checked before the group
        is killed, which ends whatever it left)."""
        if self.group.running():
            self.group.signal(sig, group=False)
            if self.group.wait(20) is None:
                self.group.signal(signal.SIGKILL, group=False)
                self.group.wait(10)
        leftovers = [p for p in self.workers + children_of(self.proc.pid) if alive(p)]
        rc = self.group.stop()
        assert not leftovers, f"worker processes {leftovers} outlived the front"
        return rc

    # helpers
    def get(self, path, **kw):
        return httpx.get(self.url + path, timeout=30, **kw)

    def post(self, path, body, **kw):
        return httpx.post(self.url + path, json=body, timeout=30, **kw)

    def workers_info(self, **kw) -> list[dict]:
        r = self.get("/server_info", **kw)
        assert r.status_code == 200, r.text
        return r.json()["workers"]

    def idle(self, **kw) -> bool:
        return all(w["free_pages"] + w["cached_pages"] == w["total_pages"] and w["running_requests"] == 0
                   and w["waiting_requests"] == 0 and w["inflight_transfers"] == 0
                   and w["front_inflight_requests"] == 0 for w in self.workers_info(**kw))

    def assert_idle(self, **kw):
        wait_until(lambda: self.idle(**kw), 20, "workers to be idle")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    d = tmp_path_factory.mktemp("fake-model")
    write_fake_model(str(d))
    return str(d)


@pytest.fixture(scope="module")
def tok(model_dir):
    from pdserve.server.tokenizer import ServerTokenizer
    return ServerTokenizer.from_dir(model_dir)


@pytest.fixture
def make_server(model_dir, tmp_path):
    started: list[Server] = []

    def make(**kw) -> Server:
        s = Server(model_dir, tmp_path / f"front{len(started)}.log", **kw)
        started.append(s)
        return s
    yield make
    for s in started:
        s.stop()


def _module_server(model_dir, tmp_path_factory, **kw):
    s = Server(model_dir, tmp_path_factory.mktemp("log") / "front.log", **kw)
    try:
        s.wait_ready()
    except BaseException:
        s.stop()
        raise
    return s


@pytest.fixture(scope="module")
def srv(model_dir, tmp_path_factory):
    """dp=2, auto (= round_robin for colocated), fast fake workers."""
    s = _module_server(model_dir, tmp_path_factory, dp=2)
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def slow(model_dir, tmp_path_factory):
    """dp=3, shortest_queue, 50 ms per decode step: requests stay in flight for seconds."""
    s = _module_server(model_dir, tmp_path_factory, dp=3, method="shortest_queue",
                       env={"FAKE_WORKER_STEP_S": "0.05"})
    yield s
    assert s.stop() == 0


def expected(tok, prompt: str | list[int], max_new: int, **kw):
    ids = tok.encode(prompt) if isinstance(prompt, str) else prompt
    out, reason = fake_generate(ids, max_new, 400, 2, **kw)
    return ids, out, reason


def sse_events(resp: httpx.Response) -> list:
    events = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


def stream(server: Server, path: str, body: dict, **kw) -> list:
    with httpx.stream("POST", server.url + path, json=body, timeout=30, **kw) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r)


def counters(server: Server) -> tuple[int, int]:
    ws = server.workers_info()
    return (sum(w["extra"]["requests_seen"] for w in ws), sum(w["extra"]["requests_aborted"] for w in ws))


class OpenStream:
    """A streaming request held open; `first()` reads up to the first event."""

    def __init__(self, server: Server, body: dict, path: str = "/generate"):
        self.client = httpx.Client(timeout=30)
        self.cm = self.client.stream("POST", server.url + path, json={**body, "stream": True})
        self.resp = self.cm.__enter__()
        assert self.resp.status_code == 200
        self.lines = self.resp.iter_lines()

    def first(self) -> dict:
        for line in self.lines:
            if line.startswith("data: "):
                return json.loads(line[6:])
        raise AssertionError("stream ended without an event")

    def close(self):
        self.cm.__exit__(None, None, None)
        self.client.close()


# ---- routes ------------------------------------------------------------------------------------

def test_info_routes(srv, model_dir):
    assert srv.get("/health").status_code == 200
    info = srv.get("/server_info").json()
    assert info == {**info, "model_path": model_dir, "disaggregation_mode": None, "dp_size": 2, "tp_size": 1,
                    "load_balance_method": "round_robin", "page_size": 16, "bootstrap_port": 8998}
    assert os.path.isfile(os.path.join(info["model_path"], "tokenizer.json")) and info["version"]
    assert [w["dp_rank"] for w in info["workers"]] == [0, 1]
    for w in info["workers"]:
        assert w["total_pages"] == 64 and w["free_pages"] + w["cached_pages"] == w["total_pages"]
        for k in ("running_requests", "waiting_requests", "inflight_transfers"):
            assert w[k] == 0
    assert srv.get("/get_server_info").json().keys() == info.keys()
    mi = srv.get("/model_info").json()
    assert mi == srv.get("/get_model_info").json()
    assert (mi["model_path"], mi["tokenizer_path"], mi["is_generation"]) == (model_dir, model_dir, True)
    models = srv.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == os.path.basename(model_dir)
    assert srv.get("/health_generate").status_code == 200
    assert srv.get("/health_generate").status_code == 200  # the other rank
    metrics = srv.get("/metrics")
    assert metrics.status_code == 200 and "pdserve_items_total" in metrics.text
    with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as c:  # a gRPC probe (router)
        c.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00" * 32)
        c.recv(1024)
    assert srv.get("/health").status_code == 200
    r = srv.get("/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = srv.get("/generate")
    assert r.status_code == 405 and "message" in r.json()["error"]


def test_generate_matches_the_worker(srv, tok):
    ids, out, reason = expected(tok, "Hello world", 12)
    r = srv.post("/generate", {"text": "Hello world", "rid": "my-rid",
                               "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["output_ids"] == out and body["text"] == tok.decode(out)
    m = body["meta_info"]
    assert (m["id"], m["prompt_tokens"], m["completion_tokens"], m["finish_reason"]) == ("my-rid", len(ids), 12, reason)
    assert m["e2e_latency"] >= 0 and m["fake_sampling"]["temperature"] == 0.0  # worker meta passed through
    same = srv.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 12}}).json()
    assert same["output_ids"] == out


def test_batches_and_n_are_lists_spread_round_robin(srv, tok):
    texts = ["Hello world", "The capital of France is", "naïve café"]
    r = srv.post("/generate", {"text": texts, "sampling_params": {"max_new_tokens": 5}}).json()
    assert isinstance(r, list) and len(r) == 3
    for text, item in zip(texts, r):
        assert item["output_ids"] == expected(tok, text, 5)[1]
    assert {item["meta_info"]["dp_rank"] for item in r} == {0, 1}
    r = srv.post("/generate", {"input_ids": [[5, 6], [7]], "sampling_params": {"max_new_tokens": 3, "n": 2},
                               "rid": ["a", "b"]}).json()
    assert [x["meta_info"]["id"] for x in r] == ["a_0", "a_1", "b_0", "b_1"]
    assert [x["output_ids"] for x in r] == [expected(tok, p, 3)[1] for p in ([5, 6], [5, 6], [7], [7])]
    ranks = [x["meta_info"]["dp_rank"] for x in r]
    assert ranks in ([0, 1, 0, 1], [1, 0, 1, 0])
    srv.assert_idle()


def test_stream_equals_non_stream(srv, tok):
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 20}}
    full = srv.post("/generate", body).json()
    events = stream(srv, "/generate", {**body, "stream": True})
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) >= 2
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))  # cumulative
    assert chunks[-1]["text"] == full["text"] and chunks[-1]["output_ids"] == full["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    batch = stream(srv, "/generate", {"text": ["a b", "c d"], "sampling_params": {"max_new_tokens": 4},
                                      "stream": True})
    assert {c["index"] for c in batch[:-1]} == {0, 1}
    for k, text in enumerate(["a b", "c d"]):
        last = [c for c in batch[:-1] if c["index"] == k][-1]
        assert last["output_ids"] == expected(tok, text, 4)[1]


def _stop_case(tok):
    """A prompt whose fake output text has a 2-character stop string well inside it."""
    for prompt in ("Hello world", "The capital of France is", "Once upon a time", "abc", "xyz 123"):
        ids, out, _ = expected(tok, prompt, 40)
        text = tok.decode(out)
        for pos in range(4, len(text) - 4):
            stop = text[pos:pos + 2]
            if "\ufffd" not in stop and text.find(stop) == pos:
                k = next(k for k in range(1, len(out) + 1) if stop in tok.decode(out[:k]))
                return prompt, stop, text[:pos], out[:k]
    raise AssertionError("no usable stop string")


def test_stop_strings_trim_and_abort(srv, tok):
    prompt, stop, want_text, want_ids = _stop_case(tok)
    seen0, aborted0 = counters(srv)
    body = {"text": prompt, "sampling_params": {"max_new_tokens": 40, "stop": [stop, "never-there"]}}
    r = srv.post("/generate", body).json()
    assert r["text"] == want_text and r["output_ids"] == want_ids
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    events = stream(srv, "/generate", {**body, "stream": True})
    assert events[-2]["text"] == want_text and all(stop not in e["text"] for e in events[:-1])
    comp = srv.post("/v1/completions", {"prompt": prompt, "max_tokens": 40, "stop": stop}).json()
    assert comp["choices"][0]["text"] == want_text and comp["choices"][0]["finish_reason"] == "stop"
    chunks = stream(srv, "/v1/completions", {"prompt": prompt, "max_tokens": 40, "stop": stop, "stream": True})
    assert "".join(c["choices"][0]["text"] for c in chunks[:-1]) == want_text
    srv.assert_idle()
    seen1, aborted1 = counters(srv)
    assert seen1 - seen0 == 4 and aborted1 - aborted0 <= 4  # abort proven on slow workers below


def test_stop_token_ids_eos_and_ignore_eos(srv, tok):
    ids, out, _ = expected(tok, "Hello world", 30)
    stop_id = out[3]
    r = srv.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 30,
                                                                     "stop_token_ids": [stop_id]}}).json()
    assert r["output_ids"] == out[:4]
    assert r["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert r["text"] == tok.decode(out[:3])  # the matched stop token is not text
    prompt = [(2 - 7) * pow(31, -1, 400) % 400]  # the first generated token is the EOS id 2
    r = srv.post("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 5}}).json()
    assert r["output_ids"] == [2] and r["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}
    r = srv.post("/generate", {"input_ids": prompt, "sampling_params": {"max_new_tokens": 5, "ignore_eos": True}})
    assert r.json()["output_ids"] == expected(tok, prompt, 5, ignore_eos=True)[1]


def test_logprobs(srv, tok):
    ids, out, _ = expected(tok, "Hello world", 4)
    m = srv.post("/generate", {"input_ids": ids, "return_logprob": True,
                               "sampling_params": {"max_new_tokens": 4}}).json()["meta_info"]
    assert m["input_token_logprobs"] == [[None, ids[0], None]] + [[fake_logprob(t), t, None] for t in ids[1:]]
    assert m["output_token_logprobs"] == [[fake_logprob(t), t, None] for t in out]
    m = srv.post("/generate", {"input_ids": ids, "return_logprob": True, "return_text_in_logprobs": True,
                               "sampling_params": {"max_new_tokens": 4}}).json()["meta_info"]
    assert m["output_token_logprobs"][0][2] == tok.token_text(out[0])
    c = srv.post("/v1/completions", {"prompt": ids, "max_tokens": 4, "logprobs": 0}).json()["choices"][0]
    assert c["logprobs"]["token_logprobs"] == [fake_logprob(t) for t in out]
    c = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
                                          "logprobs": True}).json()["choices"][0]
    assert len(c["logprobs"]["content"]) == 3 and all(x["logprob"] < 0 for x in c["logprobs"]["content"])


def test_openai_client(srv, tok, model_dir):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0)
    name = os.path.basename(model_dir)  # the served model name (--served-model-name's default)
    ids, out, _ = expected(tok, "Hello world", 6)
    comp = client.completions.create(model=name, prompt="Hello world", max_tokens=6, temperature=0)
    assert comp.choices[0].text == tok.decode(out) and comp.choices[0].finish_reason == "length"
    assert (comp.usage.prompt_tokens, comp.usage.completion_tokens) == (len(ids), 6)
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    chat_ids = tok.encode_chat(msgs)
    chat = client.chat.completions.create(model=name, messages=msgs, max_tokens=8, n=2, seed=1)
    assert len(chat.choices) == 2 and chat.choices[0].message.role == "assistant"
    want = tok.decode(expected(tok, chat_ids, 8)[1])
    assert chat.choices[0].message.content == want
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (len(chat_ids), 16)
    parts, usage = [], None
    for chunk in client.chat.completions.create(model=name, messages=msgs, max_tokens=8, stream=True,
                                                stream_options={"include_usage": True}):
        if chunk.choices:
            parts.append(chunk.choices[0].delta.content or "")
        if chunk.usage:
            usage = chunk.usage
    assert "".join(parts) == want and usage.completion_tokens == 8
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=name, prompt="Hello world", max_tokens=6, stream=True))
    assert text == tok.decode(out)
    assert client.models.list().data[0].id == os.path.basename(model_dir)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=name, prompt="Hello world", max_tokens=10**6)


BAD_REQUESTS = [
    ("/generate", b"{not json", "not valid JSON"),
    ("/generate", [1, 2], "JSON object"),
    ("/generate", {"text": 5}, "text must be"),
    ("/generate", {"text": ""}, "must not be empty"),
    ("/generate", {"input_ids": []}, "must not be empty"),
    ("/generate", {"input_ids": [5, 400]}, "outside the vocabulary"),
    ("/generate", {"input_ids": [-1]}, "outside the vocabulary"),
    ("/generate", {"input_ids": [5] * 10, "sampling_params": {"max_new_tokens": 250}}, "context length"),
    ("/generate", {"input_ids": [5] * 256}, "no room"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 10**12}}, "max_new_tokens"),
    ("/generate", {"text": "a", "sampling_params": {"temperature": "hot"}}, "temperature"),
    ("/generate", {"text": "a", "routed_dp_rank": 2}, "out of range"),
    ("/generate", {"text": "a", "routed_dp_rank": "0"}, "routed_dp_rank"),
    ("/generate", {"text": ["a", "b"], "bootstrap_room": [1]}, "bootstrap_room"),
    ("/generate", {"text": ["a", "b"], "routed_dp_rank": [0, 5]}, "out of range"),
    ("/generate", {"text": "a", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": ""}, "empty"),
    ("/v1/completions", {"prompt": [1, 999]}, "outside the vocabulary"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 300}, "context"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "x"}, "temperature"),
    # fields this server does not implement: refused naming the field, never accepted and ignored
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs=21 is out of range"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix is not supported"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of=3 is not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "structural_tag"}},
     "response_format type 'structural_tag' is not supported"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "guided_regex": "(x"},
     "guided_regex is invalid"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
     "tools[0] must be"),
    ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "x"}]}, "role 'robot'"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
     "top_logprobs needs logprobs: true"),
    ("/generate", {"text": "a", "sampling_params": {"structural_tag": "{}"}},
     "sampling_params.structural_tag is not supported"),
    ("/generate", {"text": "a", "sampling_params": {"regex": "(a"}}, "sampling_params.regex is invalid"),
    ("/generate", {"text": "a", "sampling_params": {"presence_penalty": 5}}, "presence_penalty"),
]


@pytest.mark.parametrize("path, body, match", BAD_REQUESTS, ids=[str(i) for i in range(len(BAD_REQUESTS))])
def test_bad_input_is_400_and_reaches_no_worker(srv, path, body, match):
    seen = counters(srv)[0]
    if isinstance(body, bytes):
        r = httpx.post(srv.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    else:
        r = srv.post(path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert match in err["message"] and err["type"] == "invalid_request_error"
    assert counters(srv)[0] == seen
    assert srv.idle()


def test_worker_error_reaches_the_client(srv):
    r = srv.post("/generate", {"input_ids": [5, ERROR_TOKEN], "sampling_params": {"max_new_tokens": 3}})
    assert r.status_code == 500 and "on purpose" in r.json()["error"]["message"]
    assert r.json()["error"]["type"] == "worker_error"
    events = stream(srv, "/generate", {"input_ids": [[5, 6], [5, ERROR_TOKEN]], "stream": True,
                                       "sampling_params": {"max_new_tokens": 50}})
    assert events[-1] == "[DONE]" and "on purpose" in events[-2]["error"]["message"]
    chunks = stream(srv, "/v1/completions", {"prompt": [5, ERROR_TOKEN], "stream": True})
    assert chunks[-1] == "[DONE]" and "error" in chunks[-2]
    srv.assert_idle()


def test_routed_dp_rank_and_pd_fields_on_colocated(srv):
    for rank in (1, 0, 1):
        m = srv.post("/generate", {"text": "x", "routed_dp_rank": rank,
                                   "sampling_params": {"max_new_tokens": 1}}).json()["meta_info"]
        assert (m["dp_rank"], m["dispatch_reason"]) == (rank, "routed_dp_rank")
    m = srv.post("/generate", {"text": "x", "data_parallel_rank": 1, "bootstrap_host": "127.0.0.1",
                               "bootstrap_port": None, "bootstrap_room": 12345, "disagg_prefill_dp_rank": 0,
                               "sampling_params": {"max_new_tokens": 1}}).json()["meta_info"]
    assert m["dp_rank"] == 1 and m["pd"] is None  # colocated: PD fields accepted, not used
    chat = srv.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                                             "routed_dp_rank": 1, "bootstrap_room": 3})
    assert chat.status_code == 200


# ---- client disconnects and DP methods on slow workers -------------------------------------------

def test_disconnect_aborts_non_stream(slow):
    seen, aborted = counters(slow)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow.url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 200}},
                   timeout=httpx.Timeout(30, read=1.0))
    slow.assert_idle()
    assert counters(slow) == (seen + 1, aborted + 1)


def test_disconnect_aborts_stream(slow):
    seen, aborted = counters(slow)
    for path, body in (("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 200}}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]})):
        s = OpenStream(slow, body, path)
        s.first()
        s.close()
    slow.assert_idle()
    assert counters(slow) == (seen + 2, aborted + 2)


def test_shortest_queue_follows_requests_in_flight(slow):
    body = {"text": "x", "sampling_params": {"max_new_tokens": 200}}
    streams = [OpenStream(slow, body) for _ in range(3)]
    try:
        ranks = [s.first()["meta_info"]["dp_rank"] for s in streams]
        assert sorted(ranks) == [0, 1, 2]
        streams[1].close()  # frees ranks[1]
        wait_until(lambda: slow.workers_info()[ranks[1]]["front_inflight_requests"] == 0, 20, "release")
        streams.append(OpenStream(slow, body))
        assert streams[-1].first()["meta_info"]["dp_rank"] == ranks[1]
        streams.append(OpenStream(slow, body))  # all have one now: any rank, but only one more
        streams[-1].first()
        assert sorted(w["front_inflight_requests"] for w in slow.workers_info()) == [1, 1, 2]
    finally:
        for s in streams:
            s.close()
    slow.assert_idle()


def test_stop_string_aborts_the_worker(slow, tok):
    prompt, stop, want_text, want_ids = _stop_case(tok)
    seen, aborted = counters(slow)
    r = slow.post("/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 200, "stop": stop}})
    assert r.json()["text"] == want_text and r.json()["output_ids"] == want_ids
    slow.assert_idle()
    assert counters(slow) == (seen + 1, aborted + 1)


def test_rid_in_flight_is_rejected_until_done(slow):
    s = OpenStream(slow, {"text": "x", "rid": "dup", "sampling_params": {"max_new_tokens": 200}})
    try:
        s.first()
        r = slow.post("/generate", {"text": "y", "rid": "dup"})
        assert r.status_code == 400 and "already in flight" in r.json()["error"]["message"]
    finally:
        s.close()
    slow.assert_idle()
    r = slow.post("/generate", {"text": "y", "rid": "dup", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and r.json()["meta_info"]["id"] == "dup"


def test_minimum_tokens_follows_tokens_in_flight(make_server):
    s = make_server(dp=2, method="minimum_tokens", env={"FAKE_WORKER_STEP_S": "0.05"}).wait_ready()
    assert s.get("/server_info").json()["load_balance_method"] == "minimum_tokens"
    streams = []
    try:
        ranks = []
        for max_new in (200, 100, 20, 20):
            streams.append(OpenStream(s, {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": max_new}}))
            ranks.append(streams[-1].first()["meta_info"]["dp_rank"])
        big = ranks[0]
        assert ranks[1:] == [1 - big] * 3  # fewer tokens in flight beats fewer requests
    finally:
        for st in streams:
            st.close()
    s.assert_idle()


def test_follow_bootstrap_room(make_server):
    s = make_server(dp=4, method="follow_bootstrap_room").wait_ready()
    for room in (0, 5, 6, 7, 2**62 + 3):
        m = s.post("/generate", {"text": "x", "bootstrap_room": room, "bootstrap_host": "127.0.0.1",
                                 "sampling_params": {"max_new_tokens": 1}}).json()["meta_info"]
        assert (m["dp_rank"], m["dispatch_reason"]) == (room % 4, "follow_bootstrap_room")
    r = s.post("/generate", {"text": ["a", "b", "c"], "bootstrap_room": [9, 2, 3],
                             "sampling_params": {"max_new_tokens": 1}}).json()
    assert [x["meta_info"]["dp_rank"] for x in r] == [1, 2, 3]
    r = s.post("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 1, "n": 2}, "bootstrap_room": 3})
    assert [x["meta_info"]["dp_rank"] for x in r.json()] == [3, 0]  # rooms 3 and 4
    m = s.post("/generate", {"text": "a", "sampling_params": {"max_new_tokens": 1}}).json()["meta_info"]
    assert "round_robin" in m["dispatch_reason"]
    r = s.post("/generate", {"text": "x", "bootstrap_room": 5, "routed_dp_rank": 2,
                             "sampling_params": {"max_new_tokens": 1}}).json()["meta_info"]
    assert r["dp_rank"] == 2


# ---- API key, start-up, shutdown --------------------------------------------------------------------

def test_api_key(make_server):
    s = make_server(dp=1, args=("--api-key", "sekret")).wait_ready()
    assert s.get("/health").status_code == 200
    assert s.get("/health_generate").status_code == 200
    for path in ("/server_info", "/v1/models", "/model_info"):
        r = s.get(path)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert s.get("/server_info", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert s.post("/generate", {"text": "x"}).status_code == 401
    ok = {"Authorization": "Bearer sekret"}
    assert s.get("/server_info", headers=ok).status_code == 200
    assert s.post("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2}}, headers=ok).status_code == 200
    openai = pytest.importorskip("openai")
    good = openai.OpenAI(base_url=s.url + "/v1", api_key="sekret", max_retries=0)
    name = good.models.list().data[0].id
    assert good.completions.create(model=name, prompt="x", max_tokens=2).usage.completion_tokens == 2
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=s.url + "/v1", api_key="bad", max_retries=0).completions.create(
            model="m", prompt="x", max_tokens=2)


@pytest.mark.parametrize("env, message", [
    ({"FAKE_WORKER_FAIL_RANK": "1"}, "dp worker rank 1 failed to start: fake start-up failure on rank 1"),
    ({"FAKE_WORKER_EXIT_RANK": "0"}, "dp worker rank 0 (pid"),
    ({"FAKE_WORKER_HANG_RANK": "1"}, "dp worker ranks [1] not ready within 2s"),
])
def test_start_up_failure_exits_without_orphans(make_server, env, message):
    s = make_server(dp=2, env=env, args=("--start-timeout", "2"))
    s.proc.wait(START_DEADLINE_S)
    assert s.proc.returncode == 3
    assert message in s.log_text()
    if "EXIT" in next(iter(env)):
        assert "exited with code 7 during start-up" in s.log_text()
    assert children_of(s.proc.pid) == []


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_front_and_workers(make_server, sig):
    s = make_server(dp=2).wait_ready()
    workers = list(s.workers)
    assert len(workers) == 2 and all(alive(p) for p in workers)
    assert s.stop(sig) == 0  # stop() also asserts that no worker outlived the front
    assert not any(alive(p) for p in workers)


def test_dead_worker_is_reported(make_server):
    s = make_server(dp=2).wait_ready()
    rank1 = next(p for p in s.workers if "--dp-rank\x001\x00" in Path(f"/proc/{p}/cmdline").read_text())
    os.kill(rank1, signal.SIGKILL)
    wait_until(lambda: s.get("/health").status_code == 503, 20, "/health to report the dead worker")
    assert "dp rank 1" in s.get("/health").json()["error"]["message"]
    r = s.post("/generate", {"text": "x", "routed_dp_rank": 1})
    assert r.status_code == 503 and "rank 1 is gone" in r.json()["error"]["message"]
    r = s.post("/generate", {"text": "x", "routed_dp_rank": 0, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200
