"""The prefix cache through real servers (tiny float32 model, page size 4): greedy output equals
a cache-off server's, colocated and in PD with a prefill of dp 2; cached_tokens is exact on
/generate and the OpenAI routes (also from the prefill, on the decode's reply); server_info,
metrics and the timeline show it; /flush_cache empties every rank, idle and busy."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from tests.harness.cluster import Server, pd_body, post_both, run  # noqa: E402
from tests.harness.prefix_tools import expected_cached  # noqa: E402
from tests.harness.shared_servers import DECODE, DECODE_DP2, PREFILL_DP2, borrow  # noqa: E402

pytestmark = pytest.mark.e2e
# servers borrowed from the session's shared ones (shared_servers.py)
LENT = {"p2": PREFILL_DP2, "d1": DECODE, "d2": DECODE_DP2}
PAGE = 4  # cluster.Server's --page-size


@pytest.fixture(scope="module")
def servers(shared_servers, tmp_path_factory):
    """The colocated servers are this module's; the PD ones are lent (their caches empty)."""
    model_dir = shared_servers.model_dir
    logs = str(tmp_path_factory.mktemp("logs"))
    own = {
        "on": Server("colocated", model_dir, dp=2, log_dir=logs, extra=["--load-balance-method", "round_robin"]),
        "off": Server("colocated", model_dir, log_dir=logs, extra=["--disable-prefix-cache"]),
        "off_sglang_name": Server("colocated", model_dir, log_dir=logs, extra=["--disable-radix-cache"]),
    }
    with borrow(shared_servers, LENT, own) as s:
        yield s


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def generate(srv: Server, prompt: list[int], n: int = 10, **extra) -> dict:
    r = httpx.post(srv.url + "/generate", json={"input_ids": prompt, "return_timeline": True,
                                                "sampling_params": {"max_new_tokens": n, "temperature": 0,
                                                                    "ignore_eos": True}, **extra}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def flush(srv: Server) -> dict:
    r = httpx.post(srv.url + "/flush_cache", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def metric(srv: Server, name: str) -> float:
    text = httpx.get(srv.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


@pytest.mark.parametrize("prefix_len", [16, 13])  # the shared part ends on / off a page boundary
def test_colocated_cache_equals_cache_off_and_cached_tokens_exact(servers, prefix_len):
    on, off = servers["on"], servers["off"]
    flush(on)
    hits_before = metric(on, "pdserve_prefix_cache_hit_tokens_total")
    prefix = ids(prefix_len, prefix_len)
    prompts = [prefix + ids(50 + i, 2 + i) for i in range(3)] + [list(prefix)]
    seen: dict[int, list[list[int]]] = {0: [], 1: []}  # per rank (round robin)
    expected_hits = 0
    for prompt in prompts:
        got = generate(on, prompt)
        rank = got["meta_info"]["timeline"]["dp_rank"]
        want = expected_cached(prompt, seen[rank], PAGE)
        assert got["output_ids"] == generate(off, prompt)["output_ids"]
        assert got["meta_info"]["cached_tokens"] == want
        stages = {s["stage"]: s for s in got["meta_info"]["timeline"]["stages"]}
        assert stages["scheduled"]["cached_tokens"] == want == got["meta_info"]["timeline"]["cached_tokens"]
        seen[rank].append(prompt + got["output_ids"][:-1])
        expected_hits += want
    assert expected_hits > 0
    assert metric(on, "pdserve_prefix_cache_hit_tokens_total") - hits_before == expected_hits
    workers = on.wait_idle()
    assert sum(w["cached_pages"] for w in workers) > 0
    assert all(w["extra"]["prefix_cache"]["enabled"] for w in workers)
    assert all(w["cached_pages"] == 0 for w in off.wait_idle())


def test_openai_usage_reports_cached_tokens(servers):
    on, off = servers["on"], servers["off"]
    flush(on)
    prompt = "The quick brown fox jumps over the lazy dog, " * 3
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
    first = httpx.post(on.url + "/v1/completions", json=body, timeout=60).json()
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    # round robin over 2 ranks: the third request lands where the first ran
    httpx.post(on.url + "/v1/completions", json={**body, "prompt": "x"}, timeout=60)
    third = httpx.post(on.url + "/v1/completions", json=body, timeout=60).json()
    n = third["usage"]["prompt_tokens"]
    assert third["usage"]["prompt_tokens_details"]["cached_tokens"] == (n - 1) // PAGE * PAGE > 0
    assert third["choices"][0]["text"] == first["choices"][0]["text"]
    httpx.post(on.url + "/v1/completions", json={**body, "prompt": "x"}, timeout=60)
    stream = httpx.post(on.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 6, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}})
    chunks = [json.loads(line[6:]) for line in stream.text.splitlines()
              if line.startswith("data: {")]
    usage = chunks[-1]["usage"]
    assert usage["prompt_tokens_details"] == {"cached_tokens": 0}  # a chat prompt: not seen yet
    chat = httpx.post(on.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 6, "temperature": 0}).json()
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # the other rank
    again = httpx.post(on.url + "/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": prompt}], "max_tokens": 6, "temperature": 0}).json()
    m = again["usage"]["prompt_tokens"]
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (m - 1) // PAGE * PAGE
    plain = httpx.post(off.url + "/v1/completions", json=body, timeout=60).json()
    assert plain["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert plain["choices"][0]["text"] == first["choices"][0]["text"]


def test_both_disable_flags_turn_the_cache_off(servers):
    for name in ("off", "off_sglang_name"):
        srv = servers[name]
        prompt = ids(7, 20)
        generate(srv, prompt)
        assert generate(srv, prompt)["meta_info"]["cached_tokens"] == 0
        info = srv.info()
        assert info["disable_radix_cache"] is True
        assert all(not w["extra"]["prefix_cache"]["enabled"] and w["cached_pages"] == 0 for w in info["workers"])
    assert servers["on"].info()["disable_radix_cache"] is False


def test_pd_with_prefill_dp2_reuses_on_the_prefill_and_says_so_on_the_decode(servers):
    P, D, off = servers["p2"], servers["d1"], servers["off"]
    flush(P)
    prefix = ids(3, 21)
    rank = 1
    seen: list[list[int]] = []
    reused = 0
    for i in range(4):
        prompt = prefix + ids(90 + i, 1 + i)
        room = random.getrandbits(63)
        room = room - room % 2 + rank  # every room on prefill rank 1 (follow_bootstrap_room)
        body = pd_body({"input_ids": prompt, "sampling_params": {"max_new_tokens": 8, "temperature": 0,
                                                                  "ignore_eos": True}}, P, room)
        rp, rd = run(post_both(P, D, body))
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        out = rd.json()
        assert out["output_ids"] == generate(off, prompt, 8)["output_ids"]
        want = expected_cached(prompt, seen, PAGE)
        assert out["meta_info"]["cached_tokens"] == want
        assert out["meta_info"]["prefill_dp_rank"] == rank
        # the prefill computes only the first token: its pages hold the prompt alone
        seen.append(prompt)
        reused += want
    assert reused > 0
    workers = {w["dp_rank"]: w for w in P.wait_idle()}
    assert workers[rank]["cached_pages"] > 0 and workers[1 - rank]["cached_pages"] == 0
    assert workers[rank]["extra"]["prefix_cache"]["hit_tokens"] >= reused
    D.wait_idle()


KV_PAGE_BYTES = PAGE * 2 * 2 * 2 * 16 * 4  # tokens x layers x (K, V) x kv heads x head dim x float32


@pytest.mark.parametrize("p,d", [("p2", "d1"), ("p2", "d2")])
def test_pd_second_turn_moves_only_the_pages_the_decode_lacks(servers, p, d):
    """Turn 2 of a chat carries turn 1's prompt and answer: the decode rank that served turn 1
    holds their full pages and is sent only the rest; another rank is sent everything. Greedy
    output equals a cache-off server's either way."""
    P, D, off = servers[p], servers[d], servers["off"]
    flush(D)
    turn1 = ids(41, 19)
    greedy = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}

    def pd(prompt, decode_rank):
        room = random.getrandbits(63)
        body = pd_body({"input_ids": prompt, "sampling_params": greedy}, P, room)
        rp, rd = run(post_both(P, D, body, decode_extra={"routed_dp_rank": decode_rank}))
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        out = rd.json()
        assert out["output_ids"] == generate(off, prompt, 8)["output_ids"]
        return out["output_ids"], out["meta_info"]

    answer, meta1 = pd(turn1, 0)
    assert meta1["kv_reused_pages"] == 0
    turn2 = turn1 + answer + ids(42, 6)
    pages2 = -(-len(turn2) // PAGE)
    held = (len(turn1) + len(answer) - 1) // PAGE  # the last answer token's KV was never computed
    _, meta2 = pd(turn2, 0)
    assert meta2["kv_reused_pages"] == held and meta2["kv_transferred_pages"] == pages2 - held
    assert meta2["kv_bytes"] == (pages2 - held) * KV_PAGE_BYTES
    text = httpx.get(D.url + "/metrics", timeout=10).text
    assert 'pdserve_handoff_kv_pages_total{kind="reused",role="decode"}' in text
    if D.dp > 1:  # the other rank holds none of it
        _, meta3 = pd(turn2 + ids(43, 2), 1)
        assert meta3["kv_reused_pages"] == 0 and meta3["kv_bytes"] == -(-(len(turn2) + 2) // PAGE) * KV_PAGE_BYTES
    P.wait_idle()
    D.wait_idle()


def test_flush_cache_while_idle(servers):
    on = servers["on"]
    prompt = ids(11, 30)
    for _ in range(2):
        generate(on, prompt)
    cached = sum(w["cached_pages"] for w in on.wait_idle())
    assert cached > 0
    got = flush(on)
    assert got["flushed_pages"] == cached and len(got["workers"]) == 2
    workers = on.info()["workers"]
    assert all(w["cached_pages"] == 0 and w["free_pages"] == w["total_pages"] for w in workers)
    assert generate(on, prompt)["meta_info"]["cached_tokens"] == 0
    assert httpx.get(on.url + "/flush_cache", timeout=30).status_code == 200  # SGLang also takes GET


def test_flush_cache_while_busy_leaves_running_requests_alone(servers):
    on, off = servers["on"], servers["off"]
    flush(on)
    prompt = ids(12, 24)
    for _ in range(2):  # both ranks hold the prompt
        generate(on, prompt, 4)
    want = generate(off, prompt, 120)["output_ids"]

    async def go():
        async with httpx.AsyncClient(timeout=120) as c:
            long = asyncio.ensure_future(c.post(on.url + "/generate", json={
                "input_ids": prompt, "sampling_params": {"max_new_tokens": 120, "temperature": 0,
                                                         "ignore_eos": True}}))
            while True:  # until it runs
                info = (await c.get(on.url + "/server_info")).json()
                if any(w["running_requests"] for w in info["workers"]):
                    break
                await asyncio.sleep(0.01)
            flushed = (await c.post(on.url + "/flush_cache")).json()
            return flushed, info, await long

    flushed, info, resp = run(go())
    assert resp.status_code == 200, resp.text
    assert resp.json()["output_ids"] == want  # unchanged by the flush
    assert resp.json()["meta_info"]["cached_tokens"] == 20
    assert flushed["success"] is True
    # the idle rank's copy was freed at once; the running one's pages were not touched
    assert flushed["flushed_pages"] >= 1
    workers = on.wait_idle()
    assert sum(w["cached_pages"] for w in workers) > 0  # pages it filled after the flush
    assert generate(on, prompt, 4)["meta_info"]["cached_tokens"] == 0  # the old prefix is gone
