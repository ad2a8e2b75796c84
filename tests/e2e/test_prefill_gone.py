"""A prefill server killed while a decode waits on it (real processes, tiny model, 127.0.0.1): once
the decode's heartbeats have marked it gone, a new request naming it fails at once, naming the
prefill as gone, instead of waiting out the topology deadline (issue 27's regression: a 500
after 30 s).

The decode's heartbeat verdict here takes 3 s (1 s x 3 misses), longer than the 2 s bound, and
the new request is sent right after a verdict: only what the decode already knows can fail it in
time (a verdict on the new room itself, or the topology deadline, 5 s, would come too late).
Both servers are the module's own, stopped by process group in the fixture's finalizer.
"""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pdserve.disagg.handoff import HandoffState  # noqa: E402
from tests.harness.cluster import FAST_ENV, Server, pd_body, start_all, stop_all  # noqa: E402
from tests.harness.fault_tools import assert_failed, shared_tiny_model, wait_for  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
HEARTBEAT = {"PDSERVE_HEARTBEAT_INTERVAL": "1.0", "PDSERVE_HEARTBEAT_MAX_FAILURE": "3"}  # a 3 s verdict
GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}
LEG_TIMEOUT = 60.0  # a leg with no answer by then hung (FAST_ENV deadlines are <= 20 s)
GONE_WITHIN_S = 2.0  # the bound for a new request naming a prefill known gone
QUARANTINE_S = float(FAST_ENV["PDSERVE_KV_QUARANTINE_TIMEOUT"])  # the waiting room keeps its pages


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    model = shared_tiny_model(tmp_path_factory)
    logs = str(tmp_path_factory.mktemp("prefill_gone"))
    started = [Server("prefill", model, log_dir=logs), Server("decode", model, env=HEARTBEAT, log_dir=logs)]
    try:
        yield start_all(started)
    finally:
        stop_all(started)


def kv_req_sent(decode: Server) -> bool:
    """The decode's one rank has sent a kv_req and waits for the KV."""
    states = decode.info()["workers"][0]["extra"]["handoff_states"]
    return states.get(HandoffState.WAITING_FOR_INPUT.value, 0) > 0


def test_a_new_request_naming_a_prefill_the_heartbeats_gave_up_fails_at_once(servers):
    P, D = servers
    gone = f"prefill bootstrap 127.0.0.1:{P.bootstrap_port} missed 3 heartbeats"
    with httpx.Client(timeout=LEG_TIMEOUT) as client, ThreadPoolExecutor(1) as pool:
        # only the decode leg: its room waits on P for KV that never comes, so D watches P
        room = random.getrandbits(63)
        waiting = pool.submit(client.post, D.url + "/generate",
                              json=pd_body({"text": "hello", "sampling_params": GREEDY}, P, room))
        wait_for(lambda: kv_req_sent(D), 20, "the decode's kv_req sent to the prefill")
        P.kill()
        P.proc.wait(10)
        assert_failed(waiting.result(), f"room {room}", gone, "prefill server is gone")
        # the heartbeats marked P gone: a new request naming it fails at once, saying so
        late_room = random.getrandbits(63)
        t0 = time.monotonic()
        late = client.post(D.url + "/generate",
                           json=pd_body({"text": "hello again", "sampling_params": GREEDY}, P, late_room))
        took = time.monotonic() - t0
    assert took < GONE_WITHIN_S, (took, late.text)
    assert_failed(late, f"room {late_room}", gone, "prefill server is gone")
    D.wait_idle(timeout=QUARANTINE_S + 15)  # the first room's pages wait out their quarantine
