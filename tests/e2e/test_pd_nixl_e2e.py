"""PD disaggregation over the nixl transfer backend, end to end: real servers on 127.0.0.1,
tiny model, `--transfer-backend nixl` (one NIXL agent over UCX per DP worker) on both sides.

A prefill with dp 2 (two agents, each registered with its metadata at the bootstrap service)
and a decode with dp 1: decode answers must equal the colocated server's greedy output, one
request, many at once and a batch; a prefill killed mid-request fails the decode leg clearly
and leaves it idle. (A backend mismatch is refused before any I/O by code no backend owns: the
mooncake e2e test covers it.) Skipped (with the reason) only when NIXL cannot be imported here.
"""

from __future__ import annotations

import asyncio
import base64
import random
import threading
import time

import httpx
import pytest

from pdserve.transfer.nixl import import_problem  # noqa: E402
from tests.harness.cluster import Server, pd_body, post_both, run  # noqa: E402
from tests.harness.shared_servers import COLOCATED, borrow  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]
# servers borrowed from the session's shared ones (shared_servers.py)
LENT = {"colo": COLOCATED}
if (_problem := import_problem()) is not None:
    pytest.skip(f"nixl backend unavailable: {_problem}", allow_module_level=True)

NIXL = ["--transfer-backend", "nixl"]
PROMPTS = ["The capital of France is", "hello world " * 9, "a", "Once upon a time, in a land far away, " * 3]


@pytest.fixture(scope="module")
def servers(shared_servers, tmp_path_factory):
    """The nixl servers are this module's; the colocated reference is lent."""
    logs = str(tmp_path_factory.mktemp("logs"))
    model_dir = shared_servers.model_dir
    own = {
        "p2": Server("prefill", model_dir, dp=2, extra=NIXL, log_dir=logs),
        "d1": Server("decode", model_dir, dp=1, extra=NIXL, log_dir=logs),
    }
    with borrow(shared_servers, LENT, own) as s:
        yield s


def greedy(n: int = 12) -> dict:
    return {"max_new_tokens": n, "temperature": 0}


@pytest.fixture(scope="module")
def want(servers) -> dict[str, list[int]]:
    """The colocated server's greedy answer to each prompt: the reference."""
    out = {}
    for prompt in PROMPTS:
        r = httpx.post(servers["colo"].url + "/generate", json={"text": prompt, "sampling_params": greedy()},
                       timeout=60)
        assert r.status_code == 200, r.text
        out[prompt] = r.json()["output_ids"]
    return out


def pd(servers, body: dict, room) -> tuple[httpx.Response, httpx.Response]:
    P, D = servers["p2"], servers["d1"]
    return run(post_both(P, D, pd_body(body, P, room)))


def test_bootstrap_registration_carries_each_ranks_agent(servers):
    """GET /route of the prefill's bootstrap service names, per DP rank, its nixl endpoint with
    its NIXL agent and that agent's metadata: all a decode needs to reach it."""
    P = servers["p2"]
    agents = set()
    for rank in range(P.dp):
        r = httpx.get(f"http://127.0.0.1:{P.bootstrap_port}/route", params={"prefill_dp_rank": rank}, timeout=10)
        assert r.status_code == 200, r.text
        ep = r.json()["endpoint"]
        assert ep["backend"] == "nixl" and ep["plugins"] == ["UCX"] and isinstance(ep["base_ptr"], int)
        assert ep["agent"] == f"pdserve-{ep['instance']}" and base64.b64decode(ep["agent_metadata"])
        agents.add(ep["agent"])
    assert len(agents) == P.dp
    assert P.info()["transfer_backend"] == servers["d1"].info()["transfer_backend"] == "nixl"


def test_nixl_pd_output_equals_colocated(servers, want):
    """Each prompt through both prefill ranks (the room picks the rank) equals colocated."""
    for prompt in PROMPTS:
        for rank in range(servers["p2"].dp):
            room = random.getrandbits(62) * 2 + rank
            rp, rd = pd(servers, {"text": prompt, "sampling_params": greedy()}, room)
            assert rp.status_code == 200, rp.text
            assert rd.status_code == 200, rd.text
            assert rd.json()["output_ids"] == want[prompt], (prompt, rank)
            meta = rd.json()["meta_info"]
            assert meta["bootstrap_room"] == room and meta["prefill_dp_rank"] == rank and meta["kv_bytes"] > 0
    servers["p2"].wait_idle(timeout=30)
    servers["d1"].wait_idle(timeout=30)


def test_nixl_concurrent_requests_and_batch(servers, want):
    """Rooms on both prefill ranks at once into the one decode agent, plus a batched body."""
    P, D = servers["p2"], servers["d1"]
    prompts = PROMPTS * 2

    async def all_at_once():
        return await asyncio.gather(*(post_both(P, D, pd_body(
            {"text": t, "sampling_params": greedy()}, P, random.getrandbits(63))) for t in prompts))

    for prompt, (rp, rd) in zip(prompts, run(all_at_once())):
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        assert rd.json()["output_ids"] == want[prompt], prompt
    rooms = [random.getrandbits(63) for _ in PROMPTS]
    rp, rd = pd(servers, {"text": PROMPTS, "sampling_params": greedy()}, rooms)
    assert rd.status_code == 200, rd.text
    assert [x["output_ids"] for x in rd.json()] == [want[t] for t in PROMPTS]
    P.wait_idle(timeout=30)
    D.wait_idle(timeout=30)


def test_killing_prefill_mid_request_leaves_decode_idle(servers):
    """Runs last: it kills the prefill. The decode leg alone resolves the room's rank, reserves
    pages and sends its kv_req over nixl's control channel; then the prefill dies (kill -9)
    before writing the KV. The decode fails the leg naming the room and frees its pages."""
    P, D = servers["p2"], servers["d1"]
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
    assert out["r"].status_code >= 400, out["r"].text
    msg = out["r"].json()["error"]["message"]
    assert str(body["bootstrap_room"]) in msg and "prefill" in msg, msg
    D.wait_idle(timeout=30)
    assert httpx.get(D.url + "/health", timeout=10).status_code == 200
