"""What the PD end-to-end modules (test_pd_e2e, test_pd_mooncake_e2e, test_pd_nixl_e2e) share:
their prompts, the colocated server's greedy answer as the reference, one PD answer checked
against it, and two scenarios every transfer backend must pass end to end: many rooms at once
plus a batch, and a prefill killed while the decode leg waits for its KV."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import httpx

from .cluster import Server, pd_body, post_both, run

PROMPTS = ["The capital of France is", "hello world " * 9, "a", "Once upon a time, in a land far away, " * 3]


def greedy(n: int = 12) -> dict:
    return {"max_new_tokens": n, "temperature": 0}


def colocated(colo: Server, prompt: str, n: int = 12) -> list[int]:
    """The colocated server's greedy output ids for `prompt`: what a PD pair must answer."""
    r = httpx.post(colo.url + "/generate", json={"text": prompt, "sampling_params": greedy(n)}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def assert_pd_answer(P: Server, D: Server, prompt: str, want: list[int], room: int | None = None) -> dict:
    """Both legs of `prompt` at once (a random room unless given): both succeed, the decode
    answers `want` and its KV came through the room. -> the decode's meta_info."""
    body = pd_body({"text": prompt, "sampling_params": greedy()}, P,
                   random.getrandbits(63) if room is None else room)
    rp, rd = run(post_both(P, D, body))
    assert rp.status_code == 200, rp.text
    assert rd.status_code == 200, rd.text
    assert rd.json()["output_ids"] == want, prompt
    meta = rd.json()["meta_info"]
    assert meta["bootstrap_room"] == body["bootstrap_room"] and meta["kv_bytes"] > 0
    return meta


def assert_concurrent_and_batch(P: Server, D: Server, want: dict[str, list[int]]) -> None:
    """Each prompt of `want` twice, all at once (rooms on every prefill and decode rank), then
    all of them in one batched body: every answer is `want`'s, and both servers end idle."""
    prompts = list(want) * 2

    async def all_at_once():
        return await asyncio.gather(*(post_both(P, D, pd_body(
            {"text": t, "sampling_params": greedy()}, P, random.getrandbits(63))) for t in prompts))

    for prompt, (rp, rd) in zip(prompts, run(all_at_once())):
        assert rp.status_code == 200 and rd.status_code == 200, (rp.text, rd.text)
        assert rd.json()["output_ids"] == want[prompt], prompt
    rooms = [random.getrandbits(63) for _ in want]
    rp, rd = run(post_both(P, D, pd_body({"text": list(want), "sampling_params": greedy()}, P, rooms)))
    assert rd.status_code == 200, rd.text
    assert [x["output_ids"] for x in rd.json()] == list(want.values())
    P.wait_idle(timeout=30)
    D.wait_idle(timeout=30)


def decode_leg_when_prefill_dies(P: Server, D: Server, prompt: str) -> tuple[dict, httpx.Response]:
    """The decode leg alone (it resolves the room's rank, reserves pages and sends its kv_req);
    once its KV transfer is in flight, the prefill is killed (kill -9) before writing the KV.
    The leg must not hang. -> (the body, the decode's answer)."""
    body = pd_body({"text": prompt, "sampling_params": greedy()}, P, random.getrandbits(63))
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
    return body, out["r"]
