"""Decode admission control end to end (issue 17): a decode whose KV pool holds two requests,
eight arriving at once. Each one finishes its whole answer or is refused with 429 and
Retry-After (queue full, or no pages within --handoff-queue-timeout); none stalls, the refusals
show in server_info and /metrics, the router tries a refused request again instead of failing
it, and both servers' pools are idle afterwards."""

from __future__ import annotations

import random

import httpx
import pytest
from cluster import Server, pd_body
from fault_tools import KnobServer, Legs, Router, error_of
from shared_servers import PREFILL, borrow

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]
# servers borrowed from the session's shared ones (shared_servers.py)
LENT = {"prefill": PREFILL}
PROMPT, NEW = 40, 16  # 10 pages of 4 + 4 pages of reserve: 14 of the decode's 32 pages each
DECODE_FLAGS = ["--max-total-tokens", "128", "--max-queued-handoffs", "2", "--handoff-queue-timeout", "2",
                "--num-reserved-decode-tokens", str(NEW)]
LEG_TIMEOUT = 60.0  # a hang detector, far beyond any answer here


@pytest.fixture(scope="module")
def servers(shared_servers, tmp_path_factory):
    """The small-pool decode is this module's; the prefill is lent."""
    log_dir = str(tmp_path_factory.mktemp("admission"))
    own = {"decode": KnobServer("decode", shared_servers.model_dir, extra=DECODE_FLAGS, log_dir=log_dir)}
    with borrow(shared_servers, LENT, own) as s:
        prefill, decode = s["prefill"], s["decode"]
        router = Router([prefill], [decode], log_dir=log_dir).wait_healthy()
        try:
            yield prefill, decode, router
        finally:
            router.stop()


@pytest.fixture
def legs():
    pool = Legs(workers=16)
    yield pool
    pool.close()


def body(rng: random.Random) -> dict:
    ids = [rng.randrange(3, 200) for _ in range(PROMPT)]  # no shared prefix: nothing reused
    return {"input_ids": ids,
            "sampling_params": {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}}


def refusals(decode: Server) -> dict:
    [w] = decode.info()["workers"]
    return w["extra"]["admission"]


def test_eight_handoffs_on_a_pool_for_two_finish_or_get_429(servers, legs):
    prefill, decode, _ = servers
    before = refusals(decode)["refused_handoffs"]
    decode.slow(step_s=0.05)  # the two admitted decode for ~0.75 s: the others arrive meanwhile
    try:
        rng = random.Random(17)
        pairs = [legs.both(prefill, decode, pd_body(body(rng), prefill, rng.getrandbits(63)),
                           timeout=LEG_TIMEOUT) for _ in range(8)]
        answers = [(fp.result(), fd.result()) for fp, fd in pairs]
    finally:
        decode.slow()
    ok, refused = [], []
    for p, d in answers:
        assert isinstance(d, httpx.Response), f"decode leg: {error_of(d)}"
        assert isinstance(p, httpx.Response), f"prefill leg: {error_of(p)}"  # it ended, one way or another
        if d.status_code == 200:
            assert d.json()["meta_info"]["completion_tokens"] == NEW, d.text  # the whole answer
            ok.append(d)
        else:
            assert d.status_code == 429, d.text
            assert d.headers.get("retry-after") == "1", d.headers
            assert "cannot take it now" in error_of(d) and "room " in error_of(d), error_of(d)
            refused.append(d)
    assert len(ok) >= 2 and refused, (len(ok), [error_of(d) for d in refused])
    after = refusals(decode)
    assert sum(after["refused_handoffs"].values()) - sum(before.values()) == len(refused)
    assert after["queued_handoffs"] == 0
    metrics = httpx.get(decode.url + "/metrics", timeout=10).text
    assert 'pdserve_admission_refused_total{reason="queue_full",role="decode"}' in metrics or \
        'pdserve_admission_refused_total{reason="timeout",role="decode"}' in metrics, metrics[-2000:]
    decode.wait_idle()
    prefill.wait_idle()


def router_retries(router: Router, reason: str) -> float:
    for line in httpx.get(router.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f'pdserve_router_retries_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_a_handoff_queued_past_the_timeout_is_refused_and_the_router_tries_again(servers, legs):
    prefill, decode, router = servers
    before, retried = refusals(decode)["refused_handoffs"]["timeout"], router_retries(router, "overloaded")
    decode.slow(step_s=0.2)  # the admitted two decode for ~3 s, longer than the queue's 2 s
    try:
        rng = random.Random(71)
        futures = [legs.post(router.url + "/generate", body(rng), timeout=LEG_TIMEOUT) for _ in range(4)]
        replies = [f.result() for f in futures]
    finally:
        decode.slow()
    for r in replies:
        assert isinstance(r, httpx.Response), error_of(r)
        assert r.status_code == 200 or (r.status_code == 429 and "cannot take it now" in error_of(r)), \
            (r.status_code, error_of(r))
        if r.status_code == 200:
            assert r.json()["meta_info"]["completion_tokens"] == NEW
    refused = refusals(decode)["refused_handoffs"]["timeout"] - before
    assert refused >= 1  # the two queued behind the slow pair waited out --handoff-queue-timeout
    assert router_retries(router, "overloaded") - retried >= refused  # each 429 tried again, not failed
    decode.wait_idle()
    prefill.wait_idle()
