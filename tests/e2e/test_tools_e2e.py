"""Tools, reasoning and the rest of the serving API on a real front process with scripted fake
workers (tests/harness/scripted_worker.py: the "model" writes what the prompt says after SAY:), through
the official openai client: tool calls parsed (streamed and not), reasoning_content, served
model names and the 404, /tokenize, /detokenize, /abort_request (the stream ends with
finish_reason abort and the KV pages come back), generation_config defaults reaching the
workers, and an unknown role refused. One real tiny model checks that tool_choice "required" and
a named function are held by the grammar, streamed and not."""

from __future__ import annotations

import json
import shutil
import threading

import httpx
import pytest

from tests.harness.cluster import Server  # noqa: E402
from tests.harness.fake_worker import write_fake_model  # noqa: E402
from tests.harness.fault_tools import Router, shared_tiny_model  # noqa: E402
from tests.harness.tool_templates import TIME_TOOL, WEATHER_TOOL, use_template  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
openai = pytest.importorskip("openai")
from openai.lib.streaming.chat import ChatCompletionStreamState  # noqa: E402

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
TOOLS = [WEATHER_TOOL, TIME_TOOL]


class ScriptedServer(Server):
    def _entry(self) -> list[str]:
        return ["-m", "pdserve.server.launch", "--model-dir", self.model_dir,
                "--worker-module", "tests.harness.scripted_worker", "--start-timeout", "60"]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("hermes-model"))
    write_fake_model(d, max_context=1024)  # the tools' system prompt is long in this tiny vocabulary
    use_template(d)
    with open(f"{d}/generation_config.json", "w") as f:
        json.dump({"temperature": 0.3, "top_k": 5, "eos_token_id": 2}, f)
    s = ScriptedServer("colocated", d, extra=["--served-model-name", "tiny", "tiny-alias", "--reasoning-parser",
                                              "qwen3", "--max-total-tokens", "8192"],
                       env={"FAKE_WORKER_STEP_S": "0.002"},
                       log_dir=str(tmp_path_factory.mktemp("logs")))
    try:
        yield s.wait_ready(60)
    finally:
        s.stop()


@pytest.fixture(scope="module")
def client(srv):
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def say(text: str) -> list[dict]:
    return [{"role": "user", "content": "SAY:" + text}]


def test_tool_calls_with_the_openai_client(srv, client):
    r = client.chat.completions.create(model="tiny", messages=say("Checking.\n" + CALL), tools=TOOLS)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Checking.\n"
    (tc,) = ch.message.tool_calls
    assert tc.type == "function" and tc.id.startswith("call_") and tc.function.name == "get_weather"
    assert json.loads(tc.function.arguments) == {"city": "Rome"}
    # streamed: the client's own accumulator rebuilds the same message from the deltas
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(model="tiny", messages=say("Checking.\n" + CALL), tools=TOOLS,
                                                stream=True):
        state.handle_chunk(chunk)
    snap = state.current_completion_snapshot.choices[0]
    assert snap.finish_reason == "tool_calls" and snap.message.content == "Checking.\n"
    assert [(t.function.name, json.loads(t.function.arguments)) for t in snap.message.tool_calls] == \
        [("get_weather", {"city": "Rome"})]
    # history: the call and its result go back in; tool_choice none leaves a call as text
    history = [*say(CALL), {"role": "assistant", "content": None, "tool_calls": [tc.model_dump()]},
               {"role": "tool", "tool_call_id": tc.id, "content": "sunny"}, *say("It is sunny.")]
    r = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS)
    assert r.choices[0].message.content == "It is sunny." and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model="tiny", messages=say(CALL), tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == CALL and not r.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        client.chat.completions.create(model="tiny", messages=say("x"), tools=TOOLS,
                                       tool_choice={"type": "function", "function": {"name": "nope"}})


def test_reasoning_content(client):
    r = client.chat.completions.create(model="tiny", messages=say("<think>Rome is warm.</think>It is sunny."))
    msg = r.choices[0].message
    assert msg.content == "It is sunny." and msg.model_extra["reasoning_content"] == "Rome is warm."
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(model="tiny", messages=say("<think>ab</think>cd"), stream=True):
        if chunk.choices:
            reasoning += (chunk.choices[0].delta.model_extra or {}).get("reasoning_content") or ""
            content += chunk.choices[0].delta.content or ""
    assert (reasoning, content) == ("ab", "cd")


def test_model_names(srv, client):
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-alias"]
    r = client.chat.completions.create(model="tiny-alias", messages=say("hi"))
    assert r.model == "tiny-alias" and r.choices[0].message.content == "hi"
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4o", prompt="x", max_tokens=2)
    assert e.value.code == "model_not_found" and "gpt-4o" in str(e.value)
    assert httpx.post(srv.url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}},
                      timeout=30).status_code == 200  # /generate has no model field


def test_tokenize_detokenize_and_roles(srv, client):
    tok = httpx.post(srv.url + "/tokenize", json={"model": "tiny", "prompt": "Hello world"}, timeout=30).json()
    assert tok["count"] == len(tok["tokens"]) > 0 and tok["max_model_len"] > 0
    back = httpx.post(srv.url + "/detokenize", json={"tokens": tok["tokens"]}, timeout=30).json()
    assert back == {"prompt": "Hello world"}
    chat = httpx.post(srv.url + "/tokenize", json={"messages": say("hi"), "tools": TOOLS}, timeout=30).json()
    r = client.chat.completions.create(model="tiny", messages=say("hi"), tools=TOOLS, max_tokens=1)
    assert r.usage.prompt_tokens == chat["count"]
    with pytest.raises(openai.BadRequestError, match="role 'wizard'"):
        client.chat.completions.create(model="tiny", messages=[{"role": "wizard", "content": "x"}])


def test_generation_config_defaults_reach_the_workers(srv):
    r = httpx.post(srv.url + "/generate", json={"text": "x", "sampling_params": {"max_new_tokens": 2}}, timeout=30)
    fake = r.json()["meta_info"]["fake_sampling"]
    assert (fake["temperature"], fake["top_k"]) == (0.3, 5)
    r = httpx.post(srv.url + "/generate", json={"text": "x", "sampling_params": {
        "max_new_tokens": 2, "temperature": 0, "sampling_seed": 11}}, timeout=30)
    fake = r.json()["meta_info"]["fake_sampling"]
    assert (fake["temperature"], fake["top_k"], fake["seed"]) == (0.0, 5, 11)


def test_abort_request_ends_the_stream_and_frees_pages(srv):
    body = {"text": "no script here", "rid": "abort-me", "stream": True,
            "sampling_params": {"max_new_tokens": 900, "ignore_eos": True}}
    seen, last = threading.Event(), {}

    def stream():
        with httpx.stream("POST", srv.url + "/generate", json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    last.update(json.loads(line[6:]))
                    seen.set()

    t = threading.Thread(target=stream)
    t.start()
    assert seen.wait(30)
    r = httpx.post(srv.url + "/abort_request", json={"rid": "abort-me"}, timeout=30)
    assert r.status_code == 200 and r.json()["aborted"] == ["abort-me"]
    t.join(30)
    assert not t.is_alive() and last["meta_info"]["finish_reason"]["type"] == "abort"
    assert httpx.post(srv.url + "/abort_request", json={"rid": "abort-me"}, timeout=30).json()["aborted"] == []
    assert httpx.post(srv.url + "/abort_request", json={}, timeout=30).status_code == 400
    srv.wait_idle()


NOW_TOOL = {"type": "function", "function": {"name": "now", "parameters": {
    "type": "object", "properties": {}, "additionalProperties": False}}}


@pytest.fixture(scope="module")
def hermes_dir(tmp_path_factory) -> str:
    d = str(tmp_path_factory.mktemp("tiny-hermes") / "m")
    shutil.copytree(shared_tiny_model(tmp_path_factory), d)  # built once per session
    with open(f"{d}/config.json") as f:
        cfg = json.load(f)
    with open(f"{d}/config.json", "w") as f:  # room for the tools' system prompt (RoPE has no table)
        json.dump({**cfg, "max_position_embeddings": 1024}, f)
    use_template(d)
    return d


@pytest.fixture(scope="module")
def real(hermes_dir, tmp_path_factory):
    s = Server("colocated", hermes_dir, extra=["--served-model-name", "tiny"],
               log_dir=str(tmp_path_factory.mktemp("logs")))
    try:
        yield s.wait_ready()
    finally:
        s.stop()


@pytest.fixture(scope="module")
def real_pd(hermes_dir, real, tmp_path_factory):
    """A prefill, a decode and our router on the same templated tiny model."""
    logs = str(tmp_path_factory.mktemp("pd-logs"))
    servers = [Server(role, hermes_dir, extra=["--served-model-name", "tiny"], log_dir=logs)
               for role in ("prefill", "decode")]
    router = None
    try:
        for s in servers:
            s.wait_ready()
        router = Router(servers[:1], servers[1:], log_dir=logs).wait_healthy()
        yield router, servers
    finally:
        if router:
            router.stop()
        for s in servers:
            s.stop()


def test_forced_tool_choice_is_held_by_the_grammar(real):
    """A random-weight model cannot write a tool call by itself: every call here is the grammar's."""
    client = openai.OpenAI(base_url=real.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    kw = dict(model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER_TOOL, NOW_TOOL],
              temperature=0, max_tokens=120)
    named = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           **kw).choices[0]
    (tc,) = named.message.tool_calls
    assert tc.function.name == "get_weather" and json.loads(tc.function.arguments)["city"] in ("Paris", "Rome")
    assert named.finish_reason == "stop" and not named.message.content
    req = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **kw).choices[0]
    assert req.finish_reason == "tool_calls" and len(req.message.tool_calls or ()) == 1, req.message.content
    call = req.message.tool_calls[0]
    assert call.function.name in ("get_weather", "now")
    if call.function.name == "get_weather":
        assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    state = ChatCompletionStreamState()
    for chunk in client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, stream=True, **kw):
        state.handle_chunk(chunk)
    snap = state.current_completion_snapshot.choices[0]
    assert [(t.function.name, t.function.arguments) for t in snap.message.tool_calls] == \
        [(call.function.name, call.function.arguments)] and snap.finish_reason == "tool_calls"
    real.wait_idle()


def test_tool_calls_through_the_pd_router_equal_colocated(real, real_pd):
    """tool_choice "required" and a named function through prefill + decode: the prefill samples
    the first token under the grammar, the decode continues it; the calls equal colocated's,
    streamed and not."""
    router, servers = real_pd
    kw = dict(model="tiny", messages=[{"role": "user", "content": "weather?"}], tools=[WEATHER_TOOL, NOW_TOOL],
              temperature=0, max_tokens=120)

    def calls(url: str, **extra) -> list:
        c = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        out = []
        for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
            msg = c.chat.completions.create(tool_choice=choice, parallel_tool_calls=False, **kw, **extra).choices[0]
            out.append((msg.finish_reason, [(t.function.name, t.function.arguments) for t in msg.message.tool_calls]))
            state = ChatCompletionStreamState()
            for chunk in c.chat.completions.create(tool_choice=choice, parallel_tool_calls=False, stream=True, **kw):
                state.handle_chunk(chunk)
            snap = state.current_completion_snapshot.choices[0]
            out.append((snap.finish_reason, [(t.function.name, t.function.arguments) for t in snap.message.tool_calls]))
        return out

    colocated, pd = calls(real.url), calls(router.url)
    assert pd == colocated and all(tcs for _, tcs in pd), (pd, colocated)
    for s in servers:
        s.wait_idle()
