"""Prefill/decode disaggregation end to end: real server processes on 127.0.0.1, tiny model.

Every case posts the same body (with bootstrap fields) to a prefill and a decode server at
once, as a PD router does, and checks the decode's answer against the colocated server's
greedy output, or that a failure is fast, clear on both legs, and leaves both sides idle.
"""

from __future__ import annotations

import random
import time

import pytest

from tests.harness.cluster import Server, pd_body, post_both, run  # noqa: E402
from tests.harness.pd_answers import PROMPTS, assert_pd_answer, colocated, greedy  # noqa: E402
from tests.harness.shared_servers import COLOCATED, DECODE, DECODE_DP2, PREFILL, PREFILL_DP2, borrow  # noqa: E402

pytestmark = pytest.mark.e2e

CONFLICT = "follow_bootstrap_room conflict: dispatched to dp_rank"
# servers borrowed from the session's shared ones (shared_servers.py)
LENT = {"colo": COLOCATED, "p1": PREFILL, "p2": PREFILL_DP2, "d1": DECODE, "d2": DECODE_DP2}


@pytest.fixture(scope="module")
def model_dir(shared_servers):
    return shared_servers.model_dir


@pytest.fixture(scope="module")
def servers(shared_servers, model_dir, tmp_path_factory):
    """The plain servers are lent (shared_servers.py); the ones with their own flags or env are
    this module's."""
    logs = str(tmp_path_factory.mktemp("logs"))
    own = {
        "p2_force": Server("prefill", model_dir, dp=2, log_dir=logs,  # SGLang's name for FORCE
                           env={"SGLANG_DISAGGREGATION_FORCE_QUERY_PREFILL_DP_RANK": "1"}),
        "p2_rr": Server("prefill", model_dir, dp=2, log_dir=logs,
                        extra=["--load-balance-method", "round_robin"]),
        "d1_force": Server("decode", model_dir, dp=1, log_dir=logs, extra=["--force-query-prefill-dp-rank"]),
        "d1_local": Server("decode", model_dir, dp=1, log_dir=logs, extra=["--disagg-local-prefill-max-tokens", "8"]),
    }
    with borrow(shared_servers, LENT, own) as s:
        yield s


def room_for_rank(rank: int, dp: int) -> int:
    """A random 63-bit room with room % dp == rank."""
    r = random.getrandbits(63)
    return r - (r % dp) + rank


def assert_idle(*servers) -> None:
    for s in servers:
        s.wait_idle()


@pytest.mark.parametrize("p,d", [("p1", "d1"), ("p1", "d2"), ("p2", "d1"), ("p2", "d2")])
def test_pd_output_equals_colocated(servers, p, d):
    P, D = servers[p], servers[d]
    for prompt in PROMPTS:
        meta = assert_pd_answer(P, D, prompt, colocated(servers["colo"], prompt))
        assert meta["dp_rank_path"] == ("single" if P.dp == 1 else "fast")
        assert meta["kv_transfer_s"] >= 0
        if P.dp > 1:
            assert meta["prefill_dp_rank"] == meta["bootstrap_room"] % P.dp
    assert_idle(P, D)


def test_pd_batch_and_stream(servers):
    import httpx

    P, D = servers["p2"], servers["d2"]
    prompts = PROMPTS[:3]
    want = [colocated(servers["colo"], t) for t in prompts]
    rooms = [random.getrandbits(63) for _ in prompts]
    body = pd_body({"text": prompts, "sampling_params": greedy()}, P, rooms)
    rp, rd = run(post_both(P, D, body))
    assert rd.status_code == 200, rd.text
    assert [x["output_ids"] for x in rd.json()] == want
    # streaming: the decode's SSE text concatenates to the non-streamed text
    text = httpx.post(servers["colo"].url + "/generate", json={"text": PROMPTS[0], "sampling_params": greedy()},
                      timeout=60).json()["text"]
    body = pd_body({"text": PROMPTS[0], "sampling_params": greedy(), "stream": True}, P, random.getrandbits(63))
    rp, rd = run(post_both(P, D, body))
    chunks = [line[6:] for line in rd.text.splitlines() if line.startswith("data: ")]
    assert chunks[-1] == "[DONE]"
    import json

    assert json.loads(chunks[-2])["text"] == text
    assert_idle(P, D)


def test_conflict_fails_fast_on_both_legs(servers):
    P, D = servers["p2"], servers["d2"]
    room = room_for_rank(0, 2)
    body = pd_body({"text": PROMPTS[0], "sampling_params": greedy(), "routed_dp_rank": 1}, P, room)
    t0 = time.monotonic()
    rp, rd = run(post_both(P, D, body))
    elapsed = time.monotonic() - t0
    assert rp.status_code == 400
    msg = rp.json()["error"]["message"]
    assert msg == (f"follow_bootstrap_room conflict: dispatched to dp_rank 1 but bootstrap_room {room} implies "
                   "dp_rank 0. Set PDSERVE_FORCE_QUERY_PREFILL_DP_RANK=1 on the prefill server or pass "
                   "disagg_prefill_dp_rank to allow mixed routing.")
    assert rd.status_code >= 400
    assert CONFLICT in rd.json()["error"]["message"]
    assert str(room) in rd.json()["error"]["message"]
    assert elapsed < 15, "the decode learned the reason instead of waiting for a deadline"
    assert_idle(P, D)


def test_force_on_prefill_only_turns_conflict_into_success(servers):
    P, D = servers["p2_force"], servers["d1"]
    room = room_for_rank(0, 2)
    body = pd_body({"text": PROMPTS[0], "sampling_params": greedy(), "routed_dp_rank": 1}, P, room)
    # routed_dp_rank names a rank of the server it is sent to: the decode (dp 1) gets its own
    rp, rd = run(post_both(P, D, body, decode_extra={"routed_dp_rank": 0}))
    assert rp.status_code == 200, rp.text
    assert rd.status_code == 200, rd.text
    assert rd.json()["output_ids"] == colocated(servers["colo"], PROMPTS[0])
    meta = rd.json()["meta_info"]
    # the decode sent its KV request to the room's home rank 0, which forwarded it to rank 1
    assert meta["dp_rank_path"] == "forward" and meta["prefill_dp_rank"] == 1
    assert P.info()["force_query_prefill_dp_rank"] is True
    assert_idle(P, D)


def test_disagg_prefill_dp_rank_hint_turns_conflict_into_success(servers):
    P, D = servers["p2"], servers["d1"]
    room = room_for_rank(0, 2)
    body = pd_body({"text": PROMPTS[1], "sampling_params": greedy(), "routed_dp_rank": 1,
                    "disagg_prefill_dp_rank": 1}, P, room)
    rp, rd = run(post_both(P, D, body, decode_extra={"routed_dp_rank": 0}))
    assert rp.status_code == 200, rp.text
    assert rd.status_code == 200, rd.text
    assert rd.json()["output_ids"] == colocated(servers["colo"], PROMPTS[1])
    assert rd.json()["meta_info"]["dp_rank_path"] == "hint"
    assert rd.json()["meta_info"]["prefill_dp_rank"] == 1
    # a hint that contradicts routed_dp_rank is bad input on the prefill
    body = pd_body({"text": "x", "sampling_params": greedy(), "routed_dp_rank": 0, "disagg_prefill_dp_rank": 1},
                   P, room)
    rp, _ = run(post_both(P, D, body))
    assert rp.status_code == 400
    assert_idle(P, D)


def test_force_on_decode_only_uses_query_path_and_conflict_still_rejected(servers):
    P, D = servers["p2"], servers["d1_force"]
    body = pd_body({"text": PROMPTS[2], "sampling_params": greedy()}, P, random.getrandbits(63))
    rp, rd = run(post_both(P, D, body))
    assert rd.status_code == 200, rd.text
    assert rd.json()["output_ids"] == colocated(servers["colo"], PROMPTS[2])
    assert rd.json()["meta_info"]["dp_rank_path"] == "query"
    room = room_for_rank(1, 2)
    body = pd_body({"text": PROMPTS[2], "sampling_params": greedy(), "routed_dp_rank": 0}, P, room)
    t0 = time.monotonic()
    rp, rd = run(post_both(P, D, body))
    assert rp.status_code == 400 and rd.status_code >= 400
    assert CONFLICT in rd.json()["error"]["message"]
    assert time.monotonic() - t0 < 15
    assert_idle(P, D)


@pytest.mark.parametrize("p", ["p2_rr"])
def test_round_robin_prefill_is_reached_without_a_query(servers, p):
    """Zero-round-trip rendezvous for a load-aware prefill method: the KV request goes to the
    room's home rank, which forwards it to the rank round_robin chose."""
    P, D = servers[p], servers["d2"]
    ranks = set()
    for prompt in PROMPTS:
        body = pd_body({"text": prompt, "sampling_params": greedy()}, P, random.getrandbits(63))
        rp, rd = run(post_both(P, D, body))
        assert rd.status_code == 200, rd.text
        assert rd.json()["output_ids"] == colocated(servers["colo"], prompt)
        assert rd.json()["meta_info"]["dp_rank_path"] == "forward"
        ranks.add(rd.json()["meta_info"]["prefill_dp_rank"])
    assert ranks == {0, 1}
    assert_idle(P, D)


@pytest.mark.parametrize("p", ["p2", "p2_rr"])
def test_rooms_at_the_top_of_the_range_and_n_samples_wrapping_to_zero(servers, p):
    """Rooms near 2^63 end to end; with n=2 one room is spread over the samples (room + j) mod
    2^63, so 2^63 - 1 is followed by room 0."""
    P, D = servers[p], servers["d2"]
    top = (1 << 63) - 1
    body = pd_body({"text": PROMPTS[0], "sampling_params": {**greedy(), "n": 2}}, P, top)
    rp, rd = run(post_both(P, D, body))
    assert rp.status_code == 200, rp.text
    assert rd.status_code == 200, rd.text
    want = colocated(servers["colo"], PROMPTS[0])
    answers = rd.json()
    assert [a["output_ids"] for a in answers] == [want, want]
    assert sorted(a["meta_info"]["bootstrap_room"] for a in answers) == [0, top]
    assert_idle(P, D)


def test_a_batch_with_one_conflicting_item_fails_every_item_fast_naming_its_room(servers):
    P, D = servers["p2"], servers["d1"]
    good, bad = room_for_rank(1, 2), room_for_rank(0, 2)
    body = pd_body({"text": PROMPTS[:2], "sampling_params": greedy(), "routed_dp_rank": 1}, P, [good, bad])
    t0 = time.monotonic()
    rp, rd = run(post_both(P, D, body, decode_extra={"routed_dp_rank": 0}))
    assert rp.status_code == 400 and f"bootstrap_room {bad} implies dp_rank 0" in rp.json()["error"]["message"]
    assert rd.status_code >= 400
    msg = rd.json()["error"]["message"]
    assert str(good) in msg or str(bad) in msg
    assert time.monotonic() - t0 < 15, "the decode learned the reason instead of waiting for a deadline"
    assert_idle(P, D)
    # the same rooms, now valid, are not poisoned for a later request of their own
    body = pd_body({"text": PROMPTS[0], "sampling_params": greedy()}, P, room_for_rank(1, 2))
    rp, rd = run(post_both(P, D, body))
    assert rd.status_code == 200, rd.text


def test_a_second_request_on_a_live_room_is_refused_and_the_first_one_served(servers):
    """Issue 14 items 1-2: the duplicate must neither take the first one's KV nor fail it."""
    import asyncio

    import httpx

    P, D = servers["p2_rr"], servers["d2"]
    room = random.getrandbits(63)
    first = pd_body({"text": PROMPTS[3], "sampling_params": greedy()}, P, room)
    second = pd_body({"text": PROMPTS[1], "sampling_params": greedy()}, P, room)

    async def scenario():
        async with httpx.AsyncClient(timeout=60) as c:
            p1 = asyncio.ensure_future(c.post(P.url + "/generate", json=first))  # holds the room
            await asyncio.sleep(0.5)
            p2 = await c.post(P.url + "/generate", json=second)
            d1 = await c.post(D.url + "/generate", json=first)
            return await p1, p2, d1
    rp1, rp2, rd1 = run(scenario())
    assert rp2.status_code == 400 and f"bootstrap_room {room} is already in flight" in rp2.text
    assert rp1.status_code == 200, rp1.text
    assert rd1.status_code == 200, rd1.text
    assert rd1.json()["output_ids"] == colocated(servers["colo"], PROMPTS[3])
    assert_idle(P, D)


def test_decode_only_request_times_out_cleanly_when_prefill_never_gets_it(servers):
    """A decode leg whose prefill leg never arrives fails by the prefill's bootstrap deadline
    (or the decode's waiting deadline), never hangs, and frees its pages."""
    import httpx

    P, D = servers["p1"], servers["d1"]
    body = pd_body({"text": PROMPTS[0], "sampling_params": greedy()}, P, random.getrandbits(63))
    t0 = time.monotonic()
    r = httpx.post(D.url + "/generate", json=body, timeout=60)
    assert r.status_code >= 400
    assert str(body["bootstrap_room"]) in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 45
    assert_idle(P, D)


def test_page_size_mismatch_fails_both_legs_naming_both_values(model_dir, servers, tmp_path):
    P = servers["p1"]
    D = Server("decode", model_dir, dp=1, extra=["--page-size", "8"], log_dir=str(tmp_path)).wait_ready()
    try:
        body = pd_body({"text": PROMPTS[0], "sampling_params": greedy()}, P, random.getrandbits(63))
        rp, rd = run(post_both(P, D, body))
        assert rd.status_code >= 400
        msg = rd.json()["error"]["message"]
        assert "page_size" in msg and "4" in msg and "8" in msg, msg
        assert rp.status_code >= 400
        assert_idle(P, D)
    finally:
        D.stop()


def test_killing_prefill_mid_request_fails_decode_within_heartbeat(model_dir, servers, tmp_path):
    import httpx

    D = servers["d1"]
    P = Server("prefill", model_dir, dp=1, log_dir=str(tmp_path)).wait_ready()
    try:
        # only the decode leg: it resolves, reserves pages and waits for KV that never comes
        body = pd_body({"text": PROMPTS[3], "sampling_params": greedy()}, P, random.getrandbits(63))
        with httpx.Client(timeout=60) as c:
            import threading

            out = {}
            t = threading.Thread(target=lambda: out.update(r=c.post(D.url + "/generate", json=body)))
            t.start()
            deadline = time.monotonic() + 10
            while D.info()["workers"][0]["inflight_transfers"] == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            t0 = time.monotonic()
            P.kill()
            t.join(30)
        assert not t.is_alive()
        r = out["r"]
        assert r.status_code >= 400
        msg = r.json()["error"]["message"]
        assert str(body["bootstrap_room"]) in msg and "prefill" in msg, msg
        assert time.monotonic() - t0 < 10  # heartbeat 0.5 s x 2 misses, plus slack
        assert_idle(D)
    finally:
        P.stop()
    # the decode keeps serving
    body = pd_body({"text": PROMPTS[0], "sampling_params": greedy()}, servers["p1"], random.getrandbits(63))
    rp, rd = run(post_both(servers["p1"], D, body))
    assert rd.status_code == 200, rd.text


def _post_with_client_timeout(url: str, body: dict, seconds: float):
    import httpx

    try:
        return httpx.post(url, json=body, timeout=seconds)
    except httpx.TimeoutException:
        return None  # the client gave up and closed the connection


def test_client_disconnect_on_prefill_leg_fails_decode_leg_at_once(servers):
    import httpx

    P, D = servers["p2"], servers["d2"]
    body = pd_body({"text": PROMPTS[0], "sampling_params": greedy()}, P, random.getrandbits(63))
    assert _post_with_client_timeout(P.url + "/generate", body, 1.0) is None
    P.wait_idle()
    t0 = time.monotonic()
    r = httpx.post(D.url + "/generate", json=body, timeout=30)
    assert r.status_code >= 400
    assert "abort" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 5
    assert_idle(P, D)


def test_client_disconnect_on_decode_leg_frees_both_sides(servers):
    import httpx

    P, D = servers["p2"], servers["d2"]
    body = pd_body({"text": PROMPTS[0], "sampling_params": greedy()}, P, random.getrandbits(63))
    assert _post_with_client_timeout(D.url + "/generate", body, 1.0) is None
    D.wait_idle(timeout=10)  # well before any handoff deadline
    t0 = time.monotonic()
    r = httpx.post(P.url + "/generate", json=body, timeout=30)
    assert r.status_code >= 400, r.text
    assert time.monotonic() - t0 < 5
    assert_idle(P, D)


def test_conditional_disaggregation_prefills_short_uncached_prompts_on_the_decode(servers):
    """--disagg-local-prefill-max-tokens 8: a prompt with at most 8 tokens missing from the
    decode's prefix cache is prefilled there and its prefill leg ends at once with no transfer;
    a longer one goes through the prefill; the second turn of a chat, mostly cached on the
    decode, is local again. Greedy output equals colocated every time."""
    import httpx

    P, D = servers["p2"], servers["d1_local"]
    rng = random.Random(5)

    def colo(ids):
        r = httpx.post(servers["colo"].url + "/generate", json={"input_ids": ids, "sampling_params": greedy()},
                       timeout=60)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]

    def pd(ids):
        body = pd_body({"input_ids": ids, "sampling_params": greedy()}, P, random.getrandbits(63))
        rp, rd = run(post_both(P, D, body))
        assert rp.status_code == 200, rp.text
        assert rd.status_code == 200, rd.text
        assert rd.json()["output_ids"] == colo(ids)
        return rp.json()["meta_info"], rd.json()

    short = [rng.randrange(3, 250) for _ in range(5)]
    pmeta, out = pd(short)
    assert out["meta_info"]["disaggregation"] == "local" and pmeta["disaggregation"] == "dropped"
    assert "kv_bytes" not in out["meta_info"]
    long = [rng.randrange(3, 250) for _ in range(40)]
    pmeta, out = pd(long)
    assert "disaggregation" not in out["meta_info"] and out["meta_info"]["kv_bytes"] > 0
    turn2 = long + out["output_ids"] + [rng.randrange(3, 250) for _ in range(3)]
    pmeta, out2 = pd(turn2)
    assert out2["meta_info"]["disaggregation"] == "local" and out2["meta_info"]["local_prefill_tokens"] <= 8
    text = httpx.get(D.url + "/metrics", timeout=10).text
    assert 'pdserve_disagg_decisions_total{decision="local",role="decode"} 2.0' in text
    assert_idle(P, D)
