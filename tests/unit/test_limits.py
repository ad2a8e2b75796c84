"""Step by step, no processes: admission control (slots, FIFO queue, deadline, cancellation),
the body-size middleware (Content-Length and chunked), and strict JSON bodies."""

from __future__ import annotations

import asyncio

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from pdserve.core.errors import BadRequest, PDServeError
from pdserve.core.strict_json import loads_object
from pdserve.server.http_utils import error_response
from pdserve.server.limits import Admission, AdmissionLimits, BodyLimit, Refused

pytestmark = pytest.mark.timeout(30)


def run(coro):
    return asyncio.run(coro)


# ---- admission ------------------------------------------------------------------------------
def test_no_limit_admits_everything():
    async def go():
        adm = Admission(AdmissionLimits(0, 0, 1.0))
        slots = [await adm.acquire() for _ in range(100)]
        for s in slots:
            s.release()
        assert adm.running == 0
    run(go())


def test_slots_pass_to_waiters_in_arrival_order():
    async def go():
        adm = Admission(AdmissionLimits(1, 2, 5.0))
        first = await adm.acquire()
        order = []

        async def wait(name):
            slot = await adm.acquire()
            order.append(name)
            return slot
        b = asyncio.create_task(wait("b"))
        c = asyncio.create_task(wait("c"))
        await asyncio.sleep(0.01)
        assert (adm.running, adm.queued) == (1, 2)
        first.release()
        first.release()  # idempotent: does not free a second slot
        sb = await b
        await asyncio.sleep(0.01)
        assert order == ["b"] and not c.done() and adm.running == 1
        sb.release()
        (await c).release()
        assert order == ["b", "c"] and (adm.running, adm.queued) == (0, 0)
    run(go())


def test_full_queue_is_refused_at_once_with_retry_after():
    async def go():
        adm = Admission(AdmissionLimits(1, 0, 5.0))
        slot = await adm.acquire()
        with pytest.raises(Refused) as e:
            await adm.acquire()
        assert e.value.status == 429 and e.value.retry_after == 1 and "full" in e.value.message
        assert adm.refused == 1
        slot.release()
        (await adm.acquire()).release()
    run(go())


def test_queue_deadline_refuses_and_leaves_no_trace():
    async def go():
        adm = Admission(AdmissionLimits(1, 4, 0.05))
        slot = await adm.acquire()
        with pytest.raises(Refused, match="no free slot within 0.05s"):
            await adm.acquire()
        assert (adm.running, adm.queued) == (1, 0)
        slot.release()
        assert adm.running == 0
    run(go())


def test_cancelled_waiter_is_skipped():
    async def go():
        adm = Admission(AdmissionLimits(1, 4, 5.0))
        slot = await adm.acquire()
        gone = asyncio.create_task(adm.acquire())
        stays = asyncio.create_task(adm.acquire())
        await asyncio.sleep(0.01)
        gone.cancel()
        await asyncio.gather(gone, return_exceptions=True)
        assert adm.queued == 1
        slot.release()
        (await stays).release()
        assert (adm.running, adm.queued) == (0, 0)
    run(go())


# ---- body size ------------------------------------------------------------------------------
def body_app(limit: int) -> TestClient:
    async def echo(request: Request):
        try:
            return JSONResponse({"n": len(await request.body())})
        except PDServeError as e:
            return error_response(e)
    app = Starlette(routes=[Route("/", echo, methods=["POST"])])
    return TestClient(BodyLimit(app, limit, error_response))


def test_body_limit_by_content_length_and_chunked():
    client = body_app(1000)
    assert client.post("/", content=b"x" * 1000).json() == {"n": 1000}
    r = client.post("/", content=b"x" * 1001)
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    assert "1001 bytes" in r.json()["error"]["message"]
    r = client.post("/", content=(b"x" * 300 for _ in range(4)))  # chunked: no Content-Length
    assert r.status_code == 413 and "over the limit of 1000 bytes" in r.json()["error"]["message"]
    assert body_app(0).post("/", content=b"x" * 5000).json() == {"n": 5000}  # 0 = no limit


# ---- strict JSON ----------------------------------------------------------------------------
@pytest.mark.parametrize("raw,why", [
    (b"", "not valid JSON"), (b"[1]", "must be a JSON object"), (b'{"a": NaN}', "NaN is not JSON"),
    (b'{"a": -Infinity}', "-Infinity is not JSON"), (b"[" * 100000 + b"]" * 100000, "nested too deeply"),
    (b'{"a": "\\ud800"}', "unpaired UTF-16 surrogate"), (b'{"a": ["x\\uDFFF"]}', "unpaired UTF-16 surrogate"),
    (b"\xff{}", "not valid JSON"),
])
def test_strict_json_refuses(raw, why):
    with pytest.raises(BadRequest, match=why):
        loads_object(raw)


def test_strict_json_accepts_surrogate_pairs_and_plain_text():
    assert loads_object(b'{"a": "\\ud83d\\ude00", "b": "\\u00e9"}') == {"a": "\U0001F600", "b": "\u00e9"}
