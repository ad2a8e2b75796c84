"""The router's cache_aware policy end to end: two prefill and two decode servers (tiny model),
multi-turn chats through `pdserve router --policy cache_aware`. From the second turn on, each
chat lands on the prefill that has its prompt cached and on the decode that holds its KV (so the
decode is sent only the new pages); greedy answers equal a colocated server's; everything idle."""

from __future__ import annotations

import random
from dataclasses import replace

import httpx
import pytest
from fault_tools import Router
from shared_servers import COLOCATED, DECODE, PREFILL, borrow

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
# servers borrowed from the session's shared ones (shared_servers.py)
LENT = {"colo": COLOCATED, "p1": PREFILL, "p2": replace(PREFILL, instance=1),
        "d1": DECODE, "d2": replace(DECODE, instance=1)}


@pytest.fixture(scope="module")
def cluster(shared_servers, tmp_path_factory):
    work = str(tmp_path_factory.mktemp("cache_aware"))
    with borrow(shared_servers, LENT) as lent:
        servers = [lent[k] for k in LENT]
        router = Router(servers[1:3], servers[3:5], "--policy", "cache_aware", log_dir=work).wait_healthy()
        try:
            yield servers, router
        finally:
            router.stop()


def generate(url: str, ids: list[int]) -> dict:
    r = httpx.post(url + "/generate", json={"input_ids": ids, "sampling_params": GREEDY}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_each_chat_keeps_its_prefill_and_decode(cluster):
    (colo, p1, p2, d1, d2), router = cluster
    rng = random.Random(3)
    chats = [[rng.randrange(3, 250) for _ in range(40)] for _ in range(3)]  # odd: round_robin would move them
    last_prompt = [[] for _ in chats]
    for turn in range(3):
        for c, conv in enumerate(chats):
            prompt = conv + [rng.randrange(3, 250) for _ in range(8)]
            out = generate(router.url, prompt)
            assert out["output_ids"] == generate(colo.url, prompt)["output_ids"]
            meta = out["meta_info"]
            if turn:  # the servers that served this chat before hold its prefix: the prefill its
                # last prompt (page size 4), the decode that prompt and its answer too
                assert meta["cached_tokens"] == len(last_prompt[c]) // 4 * 4, meta
                assert meta["kv_reused_pages"] == (len(conv) - 1) // 4, meta
            last_prompt[c] = prompt
            chats[c] = prompt + out["output_ids"]
    text = httpx.get(router.url + "/metrics", timeout=10).text
    matched = [ln for ln in text.splitlines()
               if ln.startswith("pdserve_router_cache_aware_decisions_total") and 'outcome="matched"' in ln]
    assert len(matched) == 2 and all(float(ln.split()[-1]) >= 6 for ln in matched), matched
    for s in (p1, p2, d1, d2):
        s.wait_idle()
    # both servers of each role got work: the first turns spread by smallest tree
    assert all(s.info()["workers"][0]["cached_pages"] > 0 for s in (p1, p2, d1, d2))
