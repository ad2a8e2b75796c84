"""PD disaggregation over the nixl transfer backend, end to end: real servers on 127.0.0.1,
tiny model, `--transfer-backend nixl` (one NIXL agent over UCX per DP worker) on both sides.

A prefill with dp 2 (two agents, each registered with its metadata at the bootstrap service)
and a decode with dp 1: decode answers must equal the colocated server's greedy output, one
request, many at once and a batch; a prefill killed mid-request fails the decode leg clearly
and leaves it idle. (A backend mismatch is refused before any I/O by code no backend owns: the
mooncake e2e test covers it.) Skipped (with the reason) only when NIXL cannot be imported here.
"""

from __future__ import annotations

import base64
import random

import httpx
import pytest

from pdserve.transfer.nixl import import_problem  # noqa: E402
from tests.harness.cluster import Server  # noqa: E402
from tests.harness.pd_answers import (  # noqa: E402
    PROMPTS,
    assert_concurrent_and_batch,
    assert_pd_answer,
    colocated,
    decode_leg_when_prefill_dies,
)
from tests.harness.shared_servers import COLOCATED, borrow  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]
# servers borrowed from the session's shared ones (shared_servers.py)
LENT = {"colo": COLOCATED}
if (_problem := import_problem()) is not None:
    pytest.skip(f"nixl backend unavailable: {_problem}", allow_module_level=True)

NIXL = ["--transfer-backend", "nixl"]


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


@pytest.fixture(scope="module")
def want(servers) -> dict[str, list[int]]:
    """The colocated server's greedy answer to each prompt: the reference."""
    return {prompt: colocated(servers["colo"], prompt) for prompt in PROMPTS}


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
    P, D = servers["p2"], servers["d1"]
    for prompt in PROMPTS:
        for rank in range(P.dp):
            meta = assert_pd_answer(P, D, prompt, want[prompt], room=random.getrandbits(62) * 2 + rank)
            assert meta["prefill_dp_rank"] == rank, (prompt, rank)
    P.wait_idle(timeout=30)
    D.wait_idle(timeout=30)


def test_nixl_concurrent_requests_and_batch(servers, want):
    """Rooms on both prefill ranks at once into the one decode agent, plus a batched body."""
    assert_concurrent_and_batch(servers["p2"], servers["d1"], want)


def test_killing_prefill_mid_request_leaves_decode_idle(servers):
    """Runs last: it kills the prefill. The decode leg alone resolves the room's rank, reserves
    pages and sends its kv_req over nixl's control channel; then the prefill dies (kill -9)
    before writing the KV. The decode fails the leg naming the room and frees its pages."""
    P, D = servers["p2"], servers["d1"]
    body, resp = decode_leg_when_prefill_dies(P, D, PROMPTS[3])
    assert resp.status_code >= 400, resp.text
    msg = resp.json()["error"]["message"]
    assert str(body["bootstrap_room"]) in msg and "prefill" in msg, msg
    D.wait_idle(timeout=30)
    assert httpx.get(D.url + "/health", timeout=10).status_code == 200
