"""Decode-side KV reuse, step by step: the decode already holds the first pages of a prompt (its
own prefix cache), says so in its KvReq (count + the page key of the last one), and the prefill
writes only the pages it lacks. A key that does not match the prefill's prompt fails both sides
clearly; a prompt the decode holds whole moves no bytes at all."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from pdserve.core.failures import FailureCause
from pdserve.core.page_keys import prefix_key
from pdserve.disagg import wire
from pdserve.disagg.decode_events import Reservation
from tests.harness.handoff_harness import (
    ADDR,
    AUX,
    PAGE_BYTES,
    PAGE_SIZE,
    PROMPT,
    REGIONS,
    ROOM,
    SRC,
    Link,
    assert_idle,
    make_link,
    pages_of,
)

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("no_stray_threads")]
IDS = list(range(100, 100 + PROMPT))
HELD = 11  # the decode page that holds the cached first page
MARK = 0xAB


@pytest.fixture
def link(request) -> Link:
    lk = make_link()
    request.addfinalizer(lk.close)
    return lk


def reuse(lk: Link, pages: list[int], reused: int, key: str) -> list:
    """The decode reserves `pages` with `reused` of them cached; -> the reservations made."""
    calls = []

    def reserve(rid, n):
        calls.append((rid, n))
        return Reservation(pages, reused, key)
    lk.receiver.reserve = reserve
    return calls


def handoff(lk: Link, prompt_ids=IDS) -> None:
    lk.sender.accept(ROOM, "p-1", PROMPT, prompt_ids)
    lk.deliver_req()
    lk.sender.prefill_done(ROOM, SRC, AUX)


def test_only_the_pages_the_decode_lacks_are_written(link):
    pages_of(link.d_mem)[:, HELD] = MARK  # the cached prefix page, already in place
    reuse(link, [HELD, 3, 4], 1, prefix_key(IDS, PAGE_SIZE, 1))
    handoff(link)
    [pdone] = link.prefill_done()
    assert pdone.ok and pdone.meta["kv_bytes"] == 2 * REGIONS * PAGE_BYTES
    link.to_decode()
    [ddone] = link.decode_done()
    assert ddone.ok and ddone.meta["kv_reused_pages"] == 1 and ddone.meta["kv_transferred_pages"] == 2
    assert ddone.meta["kv_bytes"] == 2 * REGIONS * PAGE_BYTES
    p, d = pages_of(link.p_mem), pages_of(link.d_mem)
    assert (d[:, HELD] == MARK).all(), "a reused page was written"
    for s, t in zip(SRC[1:], [3, 4]):
        assert np.array_equal(d[:, t], p[:, s])
    assert_idle(link)


def test_a_prefix_key_mismatch_fails_both_sides_clearly(link):
    reuse(link, [HELD, 3, 4], 1, prefix_key([7] * PROMPT, PAGE_SIZE, 1))
    handoff(link)
    [pdone] = link.prefill_done()
    assert not pdone.ok and "prefix hash mismatch" in pdone.reason and f"room {ROOM}" in pdone.reason
    [msg] = link.to_decode()
    assert msg["t"] == wire.KV_FAIL and msg["cause"] == FailureCause.INCOMPATIBLE.value
    [ddone] = link.decode_done()
    assert not ddone.ok and "prefix hash mismatch" in ddone.reason
    assert not link.d_mem.any()


def test_a_claim_beyond_the_prompts_full_pages_is_refused(link):
    reuse(link, [HELD, 3, 4], 3, "00")  # a 10-token prompt has only 2 full pages
    handoff(link)
    [pdone] = link.prefill_done()
    assert not pdone.ok and "decode claims 3 reused pages of a 10-token prompt (2 full pages)" in pdone.reason


def test_a_prompt_the_decode_holds_whole_moves_no_bytes(request):
    lk = make_link()
    request.addfinalizer(lk.close)
    ids = IDS[:8]  # two full pages, both cached on the decode
    reuse(lk, [HELD, 12], 2, prefix_key(ids, PAGE_SIZE, 2))
    lk.sender.accept(ROOM, "p-1", 8, ids)
    lk.receiver.accept(ROOM, f"d-{ROOM}", ADDR, 8, None)
    lk.prefills.resolved(lk.resolved(ROOM))
    assert lk.receiver.poll() == []
    [req] = lk.to_prefill()
    assert req["dst_pages"] == [] and req["reused_pages"] == 2
    lk.sender.prefill_done(ROOM, SRC[:2], dataclasses.replace(AUX, prompt_len=8))
    [pdone] = lk.prefill_done()
    assert pdone.ok and pdone.meta["kv_bytes"] == 0
    lk.to_decode()
    [ddone] = lk.decode_done()
    assert ddone.ok and ddone.aux.first_token == AUX.first_token and ddone.meta["kv_transferred_pages"] == 0
    assert not lk.d_mem.any()
