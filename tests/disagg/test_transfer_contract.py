"""The transfer backend contract, run against every backend: tcp, fake, mooncake and nixl, each as
two started backends in this process over numpy pools (tests.harness.transfer_pools).

Pools carry a guard area after their layout that must stay zero, so a stray write is caught.
Each test names the backends it runs on (`@on(...)`); one pair of each kind is shared by the
tests that leave it working (the `pair` and `fresh` fixtures, conftest.py).
mooncake and nixl are skipped (with the reason) only where their engine cannot be imported here.
What one backend alone does (tcp's wire, fake's failure knobs, mooncake's engine codes, nixl's
notifications) is tested in test_transfer_<backend>.py.
"""

from __future__ import annotations

import dataclasses
import json
import re
import threading
import time

import numpy as np
import pytest

from pdserve.transfer import TransferError, create_backend, peer_name
from pdserve.transfer import mooncake as mc
from pdserve.transfer import nixl as nx
from tests.harness.transfer_pools import BackendPair, Pool, native_threads, recv_until, tcp_threads

pytestmark = pytest.mark.timeout(120)

UNAVAILABLE = {"mooncake": mc.import_problem(), "nixl": nx.import_problem()}


def backends(*names: str) -> list:
    return [pytest.param(n, id=n, marks=pytest.mark.skipif(UNAVAILABLE.get(n) is not None,
                                                           reason=f"{n} backend unavailable: {UNAVAILABLE.get(n)}"))
            for n in names]


ALL = backends("tcp", "fake", "mooncake", "nixl")
RECEIVER_CHECKED = backends("tcp", "fake")  # the receiver checks each write against its own layout
ONE_SIDED = backends("mooncake", "nixl")  # the sender's engine writes into the peer's registered memory
LANDS_ON_RETURN = {"mooncake"}  # its write_pages returns once the bytes are in the peer's pool
OUTSIDE_POOL_ERROR = {  # what a one-sided engine says of bytes past the memory the peer registered
    "mooncake": r"batch_transfer_sync_write of 4 runs .* failed with code -\d+",
    "nixl": r"NIXL WRITE #\d+ of 4 runs \(1024 bytes\) to nixl://127\.0\.0\.1:\d+ "
            r"refused: outside the KV pool the peer registered",
}


def on(params: list):
    """The backends a test runs on: the kinds of its `pair` (conftest.py), one shared per kind."""
    return pytest.mark.parametrize("pair", params, indirect=True)


@pytest.fixture
def backend(pair) -> str:
    """The backend of a test that builds pairs of its own (the shared one of that kind stays up)."""
    return pair.backend


@on(ALL)
def test_descriptor_is_jsonable_and_names_backend(pair):
    assert json.loads(json.dumps(pair.a_ep)) == pair.a_ep
    assert pair.a_ep["backend"] == pair.backend and pair.a_ep["port"] != pair.b_ep["port"]


@on(ALL)
def test_pages_land_where_asked(fresh):
    src, dst = [0, 1, 2, 7, 8, 3], [5, 6, 7, 0, 1, 23]
    res = fresh.a.write_pages(fresh.b_ep, fresh.b_layout, src, dst)
    assert res.bytes == len(src) * 4 * 256
    assert res.num_writes == 3 * 4  # joint runs (0->5 x3), (7->0 x2), (3->23 x1), per region
    assert res.finished_at >= res.started_at
    expect = np.zeros_like(fresh.b_pool.pages)
    expect[:, dst] = fresh.a_pool.pages[:, src]
    if fresh.backend in LANDS_ON_RETURN:
        assert np.array_equal(fresh.b_pool.pages, expect)  # landed before write_pages returned
    fresh.a.send(fresh.b_ep, {"done": 1})
    assert recv_until(fresh.b, 1) == [(fresh.a_ep, {"done": 1})]
    assert np.array_equal(fresh.b_pool.pages, expect)
    assert not fresh.b_pool.guard.any()


@on(ALL)
def test_message_after_writes_sees_all_pages(backend):
    p = BackendPair(backend, Pool(4, 64, 16384, seed=2), Pool(4, 64, 16384))
    try:
        rng = np.random.default_rng(3)
        for round_ in range(4):
            p.a_pool.pages[:] = rng.integers(0, 256, p.a_pool.pages.shape, dtype=np.uint8)
            dst = rng.permutation(64).tolist()
            p.a.write_pages(p.b_ep, p.b_layout, list(range(64)), dst)
            p.a.send(p.b_ep, {"round": round_})
            got = recv_until(p.b, 1)
            assert [m for _, m in got] == [{"round": round_}]
            assert np.array_equal(p.b_pool.pages[:, dst], p.a_pool.pages), round_  # all in when it came
    finally:
        p.close()


@on(ALL)
def test_many_scattered_runs_span_several_frames(backend):
    """More single-page runs than one tcp WRITE frame holds, interleaved with messages."""
    p = BackendPair(backend, Pool(4, 600, 64, seed=7), Pool(4, 600, 64))
    try:
        dst = np.random.default_rng(8).permutation(600).tolist()
        src = list(range(0, 600, 2)) + list(range(1, 600, 2))  # no two consecutive
        p.a.write_pages(p.b_ep, p.b_layout, src[:300], dst[:300])
        p.a.send(p.b_ep, {"half": 1})
        res = p.a.write_pages(p.b_ep, p.b_layout, src[300:], dst[300:])
        assert res.num_writes >= 4 * 290
        p.a.send(p.b_ep, {"half": 2})
        assert [m for _, m in recv_until(p.b, 2)] == [{"half": 1}, {"half": 2}]
        assert np.array_equal(p.b_pool.pages[:, dst], p.a_pool.pages[:, src])
        assert not p.b_pool.guard.any()
    finally:
        p.close()


@on(ALL)
def test_messages_ordered_with_sender_and_reply(pair):
    for i in range(50):
        pair.a.send(pair.b_ep, {"seq": i, "tup": (1, 2), "nested": {"k": [i]}})
    got = recv_until(pair.b, 50)
    assert [m["seq"] for _, m in got] == list(range(50))
    assert all(sender == pair.a_ep for sender, _ in got)
    assert got[0][1]["tup"] == [1, 2] and got[7][1]["nested"] == {"k": [7]}  # what a wire gives back
    pair.b.send(got[0][0], {"reply": True})
    assert recv_until(pair.a, 1) == [(pair.b_ep, {"reply": True})]


@on(ALL)
def test_concurrent_senders_keep_per_thread_order(pair):
    def worker(t):
        for i in range(30):
            pair.a.send(pair.b_ep, {"t": t, "i": i})
    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    got = [m for _, m in recv_until(pair.b, 120)]
    assert len(got) == 120
    for t in range(4):
        assert [m["i"] for m in got if m["t"] == t] == list(range(30))


@on(ALL)
def test_concurrent_writers_each_followed_by_its_message(fresh):
    """Four threads write disjoint page sets and announce them; every announced set is in place."""

    def worker(t: int) -> None:
        src, dst = [t * 4 + i for i in range(4)], [20 - t * 5 + i for i in range(4)]
        fresh.a.write_pages(fresh.b_ep, fresh.b_layout, src, dst)
        fresh.a.send(fresh.b_ep, {"t": t, "src": src, "dst": dst})

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    got = recv_until(fresh.b, 4)
    assert sorted(m["t"] for _, m in got) == [0, 1, 2, 3]
    ok = [np.array_equal(fresh.b_pool.pages[:, m["dst"]], fresh.a_pool.pages[:, m["src"]]) for _, m in got]
    assert ok == [True] * 4
    assert not fresh.b_pool.guard.any()


@on(ALL)
def test_sender_side_validation(fresh):
    a, b_ep, peer_layout = fresh.a, fresh.b_ep, fresh.b_layout
    with pytest.raises(TransferError, match="out of range"):
        a.write_pages(b_ep, peer_layout, [0], [24])
    with pytest.raises(TransferError, match="out of range"):
        a.write_pages(b_ep, peer_layout, [16], [0])
    with pytest.raises(TransferError, match="out of range"):
        a.write_pages(b_ep, peer_layout, [-1], [0])
    with pytest.raises(TransferError, match="2 source pages but 1"):
        a.write_pages(b_ep, peer_layout, [0, 1], [0])
    with pytest.raises(TransferError, match="page_bytes=256 but peer page_bytes=512"):
        a.write_pages(b_ep, dataclasses.replace(peer_layout, page_bytes=512), [0], [0])
    with pytest.raises(TransferError, match="dtype=bfloat16 but peer dtype=float32"):
        a.write_pages(b_ep, dataclasses.replace(peer_layout, dtype="float32"), [0], [0])
    with pytest.raises(TransferError, match="control message must be a dict"):
        a.send(b_ep, ["not", "a", "dict"])
    assert not fresh.b_pool.arr.any()


@on(ALL)
def test_other_backend_or_version_refused(pair):
    other = "fake" if pair.backend == "tcp" else "tcp"
    with pytest.raises(TransferError, match=f"speaks {other} v1, this endpoint speaks {pair.backend} v1"):
        pair.a.send({**pair.b_ep, "backend": other}, {"x": 1})
    with pytest.raises(TransferError, match=f"speaks {pair.backend} v9, this endpoint speaks {pair.backend} v1"):
        pair.a.send({**pair.b_ep, "version": 9}, {"x": 1})
    with pytest.raises(TransferError, match="bad transfer peer descriptor"):
        pair.a.send({"ip": "127.0.0.1"}, {"x": 1})
    with pytest.raises(TransferError, match="bad transfer peer descriptor"):
        pair.a.send({**pair.b_ep, "port": str(pair.b_ep["port"])}, {"x": 1})


@on(ONE_SIDED)
def test_live_tcp_peer_is_refused(pair):
    """A real tcp endpoint and a mooncake/nixl one refuse each other's writes and messages, even
    a tcp descriptor that reaches the other's control port."""
    name = pair.backend
    tcp = create_backend("tcp", connect_timeout=5.0)
    tcp_pool = Pool(4, 24, 256)
    tcp_ep = tcp.start(tcp_pool.layout)
    try:
        with pytest.raises(TransferError, match=rf"speaks tcp v1, this endpoint speaks {name} v1"):
            pair.a.write_pages(tcp_ep, tcp_pool.layout, [0], [0])
        with pytest.raises(TransferError, match=rf"speaks tcp v1, this endpoint speaks {name} v1"):
            pair.a.send(tcp_ep, {"x": 1})
        with pytest.raises(TransferError, match=rf"speaks {name} v1, this endpoint speaks tcp v1"):
            tcp.send(pair.b_ep, {"x": 1})
        disguised = {**pair.b_ep, "backend": "tcp"}
        with pytest.raises(TransferError, match=rf"refused the connection: .*it speaks tcp v1, "
                                                rf"this endpoint speaks {name} v1"):
            tcp.send(disguised, {"x": 1})
        assert recv_until(pair.b, 1, deadline_s=0.5) == []
        assert not tcp_pool.arr.any() and not pair.b_pool.guard.any()
    finally:
        tcp.close()


@on(RECEIVER_CHECKED)
def test_receiver_rejects_out_of_bounds_write(fresh):
    """A peer layout that lies (more pages than the receiver has) must not corrupt anything:
    the write is rejected, messages after it are never delivered, the sender gets an error."""
    lie = dataclasses.replace(fresh.b_layout, num_pages=48)
    err = None
    try:
        fresh.a.write_pages(fresh.b_ep, lie, [0], [40])  # region 0 page 40 = inside region 1
        fresh.a.send(fresh.b_ep, {"after": "bad write"})
        end = time.monotonic() + 10
        while err is None and time.monotonic() < end:  # tcp reports it on a later call
            time.sleep(0.02)
            fresh.a.send(fresh.b_ep, {"after": "bad write"})
    except TransferError as e:
        err = e
    assert err is not None and "rejected a write" in str(err) and "outside region" in str(err)
    assert not fresh.b_pool.arr.any()
    fresh.a.send(fresh.b_ep, {"after": "recovered"})  # a fresh connection works again
    got = [m for _, m in recv_until(fresh.b, 1)]
    assert got == [{"after": "recovered"}]


@on(ONE_SIDED)
def test_write_outside_registered_pool_is_refused(fresh):
    """A peer layout that lies (more pages than the peer has): the engine refuses the bytes
    beyond the memory the peer registered, the sender gets its error, nothing lands, and the
    pair keeps working."""
    lie = dataclasses.replace(fresh.b_layout, num_pages=200)
    with pytest.raises(TransferError, match=OUTSIDE_POOL_ERROR[fresh.backend]):
        fresh.a.write_pages(fresh.b_ep, lie, [0], [100])  # even region 0's page 100 is past the pool
    assert not fresh.b_pool.arr.any()
    fresh.a.write_pages(fresh.b_ep, fresh.b_layout, [1], [2])
    fresh.a.send(fresh.b_ep, {"ok": 1})
    assert [m for _, m in recv_until(fresh.b, 1)] == [{"ok": 1}]
    assert np.array_equal(fresh.b_pool.pages[:, 2], fresh.a_pool.pages[:, 1])


@on(ALL)
def test_closed_peer_fails_fast_and_close_is_final(backend, no_stray_threads):
    """b closes (twice: idempotent): a's calls to it fail at once naming it, b's own calls fail as
    closed. Then a closes: its calls fail as closed, its recv returns at once, and neither leaves
    a thread behind (nor, once they wind down, an engine thread)."""
    before = native_threads()
    p = BackendPair(backend, Pool(2, 8, 128, seed=4), Pool(2, 8, 128))
    try:
        p.a.write_pages(p.b_ep, p.b_layout, [0, 1], [3, 4])
        p.a.send(p.b_ep, {"hi": 1})
        assert [m for _, m in recv_until(p.b, 1)] == [{"hi": 1}]
        p.b.close()
        p.b.close()
        started = time.monotonic()
        with pytest.raises(TransferError, match=re.escape(peer_name(p.b_ep))):
            p.a.write_pages(p.b_ep, p.b_layout, [0], [0])
        with pytest.raises(TransferError, match=re.escape(peer_name(p.b_ep))):
            p.a.send(p.b_ep, {"x": 1})
        assert time.monotonic() - started < 5.0  # refused at connect, not at the connect deadline
        with pytest.raises(TransferError, match=f"{backend} backend is closed"):
            p.b.send(p.a_ep, {"x": 1})
        assert p.b.recv(0.05) == []
        p.a.close()
        p.a.close()
        with pytest.raises(TransferError, match=f"{backend} backend is closed"):
            p.a.write_pages(p.b_ep, p.b_layout, [0], [0])
        with pytest.raises(TransferError, match=f"{backend} backend is closed"):
            p.a.send(p.b_ep, {"x": 2})
        assert p.a.recv(5.0) == []  # returns at once after close
        assert tcp_threads(p.a_ep, p.b_ep) == []
    finally:
        p.close()
    end = time.monotonic() + 30
    while native_threads() > before and time.monotonic() < end:  # engine threads wind down
        time.sleep(0.1)
    assert native_threads() <= before
