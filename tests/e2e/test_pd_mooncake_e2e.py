"""PD disaggregation over the mooncake transfer backend, end to end: real servers on 127.0.0.1,
tiny model, `--transfer-backend mooncake` (Mooncake's TransferEngine over TCP) on both sides.

Decode answers must equal the colocated server's greedy output; a backend mismatch and a
killed prefill must fail with clear messages and leave every server idle. Skipped (with the
reason) only when Mooncake's engine cannot be imported here.
"""

from __future__ import annotations

import random
import time

import httpx
import pytest

from pdserve.transfer.mooncake import import_problem  # noqa: E402
from tests.harness.cluster import Server, pd_body, post_both, run  # noqa: E402
from tests.harness.pd_answers import (  # noqa: E402
    PROMPTS,
    assert_concurrent_and_batch,
    assert_pd_answer,
    colocated,
    decode_leg_when_prefill_dies,
    greedy,
)
from tests.harness.shared_servers import COLOCATED, DECODE, borrow  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]
# servers borrowed from the session's shared ones (shared_servers.py)
LENT = {"colo": COLOCATED, "d_tcp": DECODE}
if (_problem := import_problem()) is not None:
    pytest.skip(f"mooncake backend unavailable: {_problem}", allow_module_level=True)

MOONCAKE = ["--transfer-backend", "mooncake"]
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
        meta = assert_pd_answer(P, D, prompt, colocated(servers["colo"], prompt))
        if P.dp > 1:
            assert meta["prefill_dp_rank"] == meta["bootstrap_room"] % P.dp
    assert_idle(P, D)


def test_mooncake_concurrent_requests_and_batch(servers):
    """Several rooms at once on both prefill ranks and both decode ranks, plus a batched body."""
    assert_concurrent_and_batch(servers["p2"], servers["d2"], {t: colocated(servers["colo"], t) for t in PROMPTS})


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
    assert_pd_answer(P, servers["d2"], PROMPTS[1], colocated(servers["colo"], PROMPTS[1]))


def test_killing_prefill_mid_request_leaves_decode_idle(servers):
    """Runs last: it kills p1. The decode leg alone resolves p1, reserves pages and sends its
    kv_req over mooncake's control channel; then p1 dies (kill -9) before writing the KV."""
    P, D = servers["p1"], servers["d2"]
    body, resp = decode_leg_when_prefill_dies(P, D, PROMPTS[3])
    msg = error_message(resp)
    assert str(body["bootstrap_room"]) in msg and "prefill" in msg, msg
    assert_idle(D)
    # the decode keeps serving with the other prefill
    assert_pd_answer(servers["p2"], D, PROMPTS[0], colocated(servers["colo"], PROMPTS[0]))
