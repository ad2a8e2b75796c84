"""PD disaggregation over the mooncake transfer backend, end to end: real servers on 127.0.0.1,
tiny model, `--transfer-backend mooncake` (Mooncake's TransferEngine over TCP) on both sides.

Decode answers must equal the colocated server's greedy output; a backend mismatch and a
killed prefill must fail with clear messages and leave every server idle. Skipped (with the
reason) only when Mooncake's engine cannot be imported here.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time

import httpx
import pytest

from pdserve.transfer.mooncake import import_problem  # noqa: E402
from tests.harness.cluster import Server, pd_body, post_both, run  # noqa: E402
from tests.harness.shared_servers import COLOCATED, DECODE, borrow  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]
# servers borrowed from the session's shared ones (shared_servers.py)
LENT = {"colo": COLOCATED, "d_tcp": DECODE}
if (_problem := import_problem()) is not None:
    pytest.skip(f"mooncake backend unavailable: {_problem}", allow_module_level=True)

MOONCAKE = ["--transfer-backend", "mooncake"]
PROMPTS = ["The capital of France is", "hello world " * 9, "a", "Once upon a time, in a land far away, " * 3]
P1_BOOTSTRAP_TIMEOUT = 120  # p1's wait for a kv_req: a mismatched decode must not make it wait that long


@pytest.fixture(scope="module")
def servers(shared_servers, tmp_path_factory):
    """The mooncake servers are this module's (p1 is killed); the colocated reference and the
    tcp decode are lent."""
    logs = str(tmp_path_factory.mktemp("logs"))
    model_dir = shared_servers.model_dir
    own = {
        "p1": Server("prefill", model_dir, dp=1, extra=MOONCAKE, log_dir=logs,
                     env={"PDSERVE_BOOTSTRAP_TIMEOUT": str(P1_BOOTSTRAP_TIMEOUT)}),
        "p2": Server("prefill", model_dir, dp=2, extra=MOONCAKE, log_dir=logs),
        "d2": Server("decode", model_dir, dp=2, extra=MOONCAKE, log_dir=logs),
    }
    with borrow(shared_servers, LENT, own) as s:
        yield s


def greedy(n: int = 12) -> dict:
    return {"max_new_tokens": n, "temperature": 0}


def colocated(servers, prompt: str) -> list[int]:
    r = httpx.post(servers["colo"].url + "/generate", json={"text": prompt, "sampling_params": greedy()},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def assert_idle(*servers) -> None:
    for s in servers:
        s.wait_idle(timeout=30)


def error_message(resp: httpx.Response) -> str:
    assert resp.status_code >= 400, resp.text
    return resp.json()["error"]["message"]


@pytest.mark.parametrize("p", ["p1", "p2"])
def test_mooncake_pd_output_equals_colocated(servers, p):
    P, D = servers[p], servers["d2"]
    assert P.info()["transfer_backend"] == D.info()["transfer_backend"] == "mooncake"
    for prompt in PROMPTS:
        want = colocated(servers, prompt)
        body = pd_body({"text": prompt, "sampling_params": greedy()}, P, random.getrandbits(63))
        rp, rd = run(post_both(P, D, body))
        assert rp.status_code == 200, rp.text
        assert rd.status_code == 200, rd.text
        assert rd.json()["output_ids"] == want, prompt
        meta = rd.json()["meta_info"]
        assert meta["bootstrap_room"] == body["bootstrap_room"] and meta["kv_bytes"] > 0
        if P.dp > 1:
            assert meta["prefill_dp_rank"] == body["bootstrap_room"] % P.dp
    assert_idle(P, D)


def test_mooncake_concurrent_requests_and_batch(servers):
    """Several rooms at once on both prefill ranks and both decode ranks, plus a batched body."""
    P, D = servers["p2"], servers["d2"]
    prompts = PROMPTS * 2
    want = {t: colocated(servers, t) for t in PROMPTS}

    async def all_at_once():
        return await asyncio.gather(*(post_both(P, D, pd_body(
            {"text": t, "sampling_params": greedy()}, P, random.getrandbits(63))) for t in prompts))

    for prompt, (rp, rd) in zip(prompts, run(all_at_once())):
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        assert rd.json()["output_ids"] == want[prompt], prompt
    rooms = [random.getrandbits(63) for _ in PROMPTS]
    rp, rd = run(post_both(P, D, pd_body({"text": PROMPTS, "sampling_params": greedy()}, P, rooms)))
    assert rd.status_code == 200, rd.text
    assert [x["output_ids"] for x in rd.json()] == [want[t] for t in PROMPTS]
    assert_idle(P, D)


def test_backend_mismatch_fails_both_legs_clearly(servers):
    """Prefill on mooncake, decode on tcp: the decode refuses the prefill's endpoint before any
    I/O and says why; no kv_req can reach the prefill, so the decode gives the room up through
    the bootstrap service and the prefill frees it long before its bootstrap deadline."""
    P, D = servers["p1"], servers["d_tcp"]
    body = pd_body({"text": PROMPTS[0], "sampling_params": greedy()}, P, random.getrandbits(63))
    room = str(body["bootstrap_room"])
    started = time.monotonic()
    rp, rd = run(post_both(P, D, body, timeout=P1_BOOTSTRAP_TIMEOUT + 60))
    assert time.monotonic() - started < P1_BOOTSTRAP_TIMEOUT / 2
    msg = error_message(rd)
    assert room in msg and "transfer backend 'mooncake'" in msg and "'tcp'" in msg, msg
    msg = error_message(rp)
    assert room in msg and "decode side gave up" in msg and "'tcp'" in msg, msg
    assert_idle(P, D)
    # both keep serving their own kind
    body = pd_body({"text": PROMPTS[1], "sampling_params": greedy()}, P, random.getrandbits(63))
    rp, rd = run(post_both(P, servers["d2"], body))
    assert rd.status_code == 200 and rd.json()["output_ids"] == colocated(servers, PROMPTS[1])


def test_killing_prefill_mid_request_leaves_decode_idle(servers):
    """Runs last: it kills p1. The decode leg alone resolves p1, reserves pages and sends its
    kv_req over mooncake's control channel; then p1 dies (kill -9) before writing the KV."""
    P, D = servers["p1"], servers["d2"]
    body = pd_body({"text": PROMPTS[3], "sampling_params": greedy()}, P, random.getrandbits(63))
    out: dict = {}
    with httpx.Client(timeout=90) as c:
        t = threading.Thread(target=lambda: out.update(r=c.post(D.url + "/generate", json=body)))
        t.start()
        deadline = time.monotonic() + 30
        while (not any(w["inflight_transfers"] for w in D.info()["workers"])
               and time.monotonic() < deadline):
            time.sleep(0.05)
        P.kill()
        t.join(60)
    assert not t.is_alive(), "the decode leg hung after its prefill died"
    msg = error_message(out["r"])
    assert str(body["bootstrap_room"]) in msg and "prefill" in msg, msg
    assert_idle(D)
    # the decode keeps serving with the other prefill
    body = pd_body({"text": PROMPTS[0], "sampling_params": greedy()}, servers["p2"], random.getrandbits(63))
    rp, rd = run(post_both(servers["p2"], D, body))
    assert rd.status_code == 200 and rd.json()["output_ids"] == colocated(servers, PROMPTS[0])
