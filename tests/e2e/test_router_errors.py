"""The router passes a leg's own error on: a 4xx before any token reaches the client with that
server's status, type, code and param as sent (OpenAI clients branch on type and code), its
message inside the router's usual "<role> server <url> failed with status N: ... (rooms)".
Real router process, stub prefill/decode (the fixtures of test_router.py)."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from test_router import base, error_of, procs, wait_for  # noqa: F401  (fixtures, by name)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]

MODEL_404 = {"message": "The model 'nope' does not exist on this server; it serves ['m'] (see /v1/models)",
             "type": "invalid_request_error", "param": "model", "code": "model_not_found"}


@pytest.fixture
def stubs(base):  # noqa: F811
    """The module's stubs, knobs back to plain answers before each test."""
    prefill, decode, router = base
    for s in (prefill, decode):
        s.control(hold=False, fail_status=0, fail_error=None, fail_retry_after=None, stream_gate=False)
        httpx.post(s.url + "/_reset", timeout=10).raise_for_status()
    return prefill, decode, router


def _post(router, path: str, body: dict, bad, other) -> httpx.Response:
    """Send once the failing leg holds and the other waits, then let the failing one answer."""
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(router.post, path, body, 60)
        wait_for(lambda: bad.bodies() and other.bodies(), "both legs sent")
        httpx.post(bad.url + "/_release", timeout=10)
        return future.result()


@pytest.mark.parametrize("failing,stream", [("prefill", True), ("decode", False), ("decode", True)])
def test_a_legs_4xx_reaches_the_client_as_sent(stubs, failing, stream):
    prefill, decode, router = stubs
    bad, other = (prefill, decode) if failing == "prefill" else (decode, prefill)
    bad.control(fail_status=404, fail_error=MODEL_404, hold=True)
    other.control(hold=True)  # never answers: cancelled when the other leg fails
    body = {"model": "nope", "messages": [{"role": "user", "content": "hi"}], "stream": stream}
    resp = _post(router, "/v1/chat/completions", body, bad, other)
    assert resp.status_code == 404
    err = error_of(resp)
    assert {k: err[k] for k in ("type", "param", "code")} == {k: MODEL_404[k] for k in ("type", "param", "code")}
    room = bad.bodies()[0]["bootstrap_room"]
    assert err["message"].startswith(f"{failing} server {bad.url} failed with status 404: {MODEL_404['message']}")
    assert f"bootstrap_room={room}" in err["message"]
    wait_for(lambda: other.received()["cancelled"], "the other leg cancelled")


def test_an_error_without_a_code_gets_the_status_as_code(stubs):
    prefill, decode, router = stubs
    decode.control(fail_status=422, hold=True)  # the stub's own {"message", "type": "stub_error"}
    prefill.control(hold=True)
    resp = _post(router, "/generate", {"text": "x"}, decode, prefill)
    assert resp.status_code == 422
    err = error_of(resp)
    assert (err["type"], err["code"]) == ("stub_error", 422) and set(err) == {"message", "type", "code"}


def test_a_prefill_4xx_after_decode_streamed_ends_the_stream_with_its_fields(stubs):
    prefill, decode, router = stubs
    sent = {"message": "prompt too long", "type": "invalid_request_error", "param": "prompt",
            "code": "context_length_exceeded"}
    prefill.control(fail_status=400, fail_error=sent, hold=True)
    decode.control(stream_gate=True)  # chunk 0, then waits for /_release
    with httpx.stream("POST", router.url + "/generate", content=json.dumps({"text": "x", "stream": True}),
                      timeout=30) as resp:
        assert resp.status_code == 200
        chunks = resp.iter_raw()
        first = next(chunks)
        assert b'"chunk": 0' in first
        httpx.post(prefill.url + "/_release", timeout=10)
        rest = b"".join(chunks)
    events = [e for e in (first + rest).decode().split("\n\n") if e]
    error = json.loads(events[1][6:])["error"]
    assert {k: error[k] for k in ("type", "param", "code")} == {k: sent[k] for k in ("type", "param", "code")}
    assert error["message"].startswith(f"prefill server {prefill.url} failed with status 400: prompt too long")
    assert events[2:] == ["data: [DONE]"]


def test_a_429_that_every_try_got_passes_its_retry_after_on(stubs):
    """Back-pressure from the only decode on every try: the client gets the 429 with the decode's
    Retry-After, so OpenAI clients wait as long as the server asked."""
    prefill, decode, router = stubs
    decode.control(fail_status=429, fail_retry_after="7")
    resp = router.post("/generate", {"text": "x"})
    assert resp.status_code == 429 and resp.headers.get("Retry-After") == "7", (resp.headers, resp.text)
    assert len(decode.bodies()) >= 2  # tried again first: a full server is healthy
