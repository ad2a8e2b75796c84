"""Transfer backend contract, run against tcp and fake; then tcp's wire-level checks.

Pools are numpy arrays (pointer from arr.ctypes.data) with a guard area after the layout, so a
stray write anywhere is caught. Everything binds 127.0.0.1 on free ports.
"""

from __future__ import annotations

import dataclasses
import socket
import threading
import time

import numpy as np
import pytest

from pdserve.core.kv_layout import KVLayout
from pdserve.transfer import TransferError, create_backend
from pdserve.transfer.fake import FakeFabric
from pdserve.transfer.tcp import TcpBackend

pytestmark = pytest.mark.timeout(60)

GUARD = 4096


class Pool:
    """A fake KV pool: `regions x pages x page_bytes` bytes plus a guard area that must stay 0."""

    def __init__(self, regions: int, pages: int, page_bytes: int, seed: int | None = None):
        total = regions * pages * page_bytes
        if seed is None:
            self.arr = np.zeros(total + GUARD, dtype=np.uint8)
        else:
            self.arr = np.random.default_rng(seed).integers(1, 256, total + GUARD, dtype=np.uint8)
            self.arr[total:] = 0
        self.layout = KVLayout(base_ptr=self.arr.ctypes.data, num_regions=regions, num_pages=pages,
                               page_bytes=page_bytes, region_stride=pages * page_bytes, page_size=16,
                               dtype="bfloat16")
        self.pages = self.arr[:total].reshape(regions, pages, page_bytes)
        self.guard = self.arr[total:]


class Pair:
    def __init__(self, kind: str, a: Pool, b: Pool):
        self.kind, self.a_pool, self.b_pool = kind, a, b
        opts = {"fabric": FakeFabric()} if kind == "fake" else {"connect_timeout": 2.0}
        self.a = create_backend(kind, **opts)
        self.b = create_backend(kind, **opts)
        self.a_ep = self.a.start(a.layout)
        self.b_ep = self.b.start(b.layout)

    def close(self) -> None:
        self.a.close()
        self.b.close()


def recv_until(backend, count: int, deadline_s: float = 10.0) -> list[tuple[dict, dict]]:
    got: list = []
    end = time.monotonic() + deadline_s
    while len(got) < count and time.monotonic() < end:
        got += backend.recv(0.1)
    return got


def tcp_threads(*endpoints: dict) -> list[str]:
    """Live tcp backend threads of these endpoints (named pdserve-tcp-<role>-<port>)."""
    ports = {f"-{ep['port']}" for ep in endpoints}
    return [t.name for t in threading.enumerate()
            if t.name.startswith("pdserve-tcp-") and any(t.name.endswith(p) for p in ports)]


@pytest.fixture(params=["tcp", "fake"])
def pair(request):
    # the receiver's pool is larger: its regions sit at another stride than the sender's
    p = Pair(request.param, Pool(4, 16, 256, seed=1), Pool(4, 24, 256))
    request.addfinalizer(p.close)
    return p


def test_descriptor_is_jsonable_and_names_backend(pair):
    import json
    assert json.loads(json.dumps(pair.a_ep)) == pair.a_ep
    assert pair.a_ep["backend"] == pair.kind and pair.a_ep["port"] != pair.b_ep["port"]


def test_pages_land_where_asked(pair):
    src, dst = [0, 1, 2, 7, 8, 3], [5, 6, 7, 0, 1, 23]
    res = pair.a.write_pages(pair.b_ep, pair.b_pool.layout, src, dst)
    assert res.bytes == len(src) * 4 * 256
    assert res.num_writes == 3 * 4  # joint runs (0->5 x3), (7->0 x2), (3->15 x1), per region
    assert res.finished_at >= res.started_at
    pair.a.send(pair.b_ep, {"done": 1})
    assert [m for _, m in recv_until(pair.b, 1)] == [{"done": 1}]
    expect = np.zeros_like(pair.b_pool.pages)
    expect[:, dst] = pair.a_pool.pages[:, src]
    assert np.array_equal(pair.b_pool.pages, expect)
    assert not pair.b_pool.guard.any()


def test_message_after_writes_sees_all_pages():
    for kind in ("tcp", "fake"):
        p = Pair(kind, Pool(4, 64, 16384, seed=2), Pool(4, 64, 16384))
        try:
            rng = np.random.default_rng(3)
            for round_ in range(4):
                p.a_pool.pages[:] = rng.integers(0, 256, p.a_pool.pages.shape, dtype=np.uint8)
                dst = rng.permutation(64).tolist()
                p.a.write_pages(p.b_ep, p.b_pool.layout, list(range(64)), dst)
                p.a.send(p.b_ep, {"round": round_})
                got = recv_until(p.b, 1)
                assert [m for _, m in got] == [{"round": round_}]
                assert np.array_equal(p.b_pool.pages[:, dst], p.a_pool.pages), (kind, round_)
        finally:
            p.close()


def test_many_scattered_runs_span_several_frames():
    """More single-page runs than one tcp WRITE frame holds, interleaved with messages."""
    for kind in ("tcp", "fake"):
        p = Pair(kind, Pool(4, 600, 64, seed=7), Pool(4, 600, 64))
        try:
            dst = np.random.default_rng(8).permutation(600).tolist()
            src = list(range(0, 600, 2)) + list(range(1, 600, 2))  # no two consecutive
            p.a.write_pages(p.b_ep, p.b_pool.layout, src[:300], dst[:300])
            p.a.send(p.b_ep, {"half": 1})
            res = p.a.write_pages(p.b_ep, p.b_pool.layout, src[300:], dst[300:])
            assert res.num_writes >= 4 * 290
            p.a.send(p.b_ep, {"half": 2})
            assert [m for _, m in recv_until(p.b, 2)] == [{"half": 1}, {"half": 2}]
            assert np.array_equal(p.b_pool.pages[:, dst], p.a_pool.pages[:, src]), kind
            assert not p.b_pool.guard.any()
        finally:
            p.close()


def test_messages_ordered_with_sender_and_reply(pair):
    for i in range(50):
        pair.a.send(pair.b_ep, {"seq": i, "tup": (1, 2), "nested": {"k": [i]}})
    got = recv_until(pair.b, 50)
    assert [m["seq"] for _, m in got] == list(range(50))
    assert all(sender == pair.a_ep for sender, _ in got)
    assert got[0][1]["tup"] == [1, 2]  # what a wire gives back
    pair.b.send(got[0][0], {"reply": True})
    assert recv_until(pair.a, 1) == [(pair.b_ep, {"reply": True})]


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


def test_sender_side_validation(pair):
    peer_layout = pair.b_pool.layout
    with pytest.raises(TransferError, match="out of range"):
        pair.a.write_pages(pair.b_ep, peer_layout, [0], [24])
    with pytest.raises(TransferError, match="out of range"):
        pair.a.write_pages(pair.b_ep, peer_layout, [16], [0])
    with pytest.raises(TransferError, match="out of range"):
        pair.a.write_pages(pair.b_ep, peer_layout, [-1], [0])
    with pytest.raises(TransferError, match="2 source pages but 1"):
        pair.a.write_pages(pair.b_ep, peer_layout, [0, 1], [0])
    with pytest.raises(TransferError, match="page_bytes=256 but peer page_bytes=512"):
        pair.a.write_pages(pair.b_ep, dataclasses.replace(peer_layout, page_bytes=512), [0], [0])
    with pytest.raises(TransferError, match="dtype=bfloat16 but peer dtype=float32"):
        pair.a.write_pages(pair.b_ep, dataclasses.replace(peer_layout, dtype="float32"), [0], [0])
    with pytest.raises(TransferError, match="must be a dict"):
        pair.a.send(pair.b_ep, ["not", "a", "dict"])
    assert not pair.b_pool.arr.any()


def test_receiver_rejects_out_of_bounds_write(pair):
    """A peer layout that lies (more pages than the receiver has) must not corrupt anything:
    the write is rejected, messages after it are never delivered, the sender gets an error."""
    lie = dataclasses.replace(pair.b_pool.layout, num_pages=48)
    err = None
    try:
        pair.a.write_pages(pair.b_ep, lie, [0], [40])  # region 0 page 40 = inside region 1
        pair.a.send(pair.b_ep, {"after": "bad write"})
        end = time.monotonic() + 10
        while err is None and time.monotonic() < end:  # tcp reports it on a later call
            time.sleep(0.02)
            pair.a.send(pair.b_ep, {"after": "bad write"})
    except TransferError as e:
        err = e
    assert err is not None and "rejected a write" in str(err) and "outside region" in str(err)
    assert not pair.b_pool.arr.any()
    pair.a.send(pair.b_ep, {"after": "recovered"})  # a fresh connection works again
    got = [m for _, m in recv_until(pair.b, 1)]
    assert got == [{"after": "recovered"}]


def test_other_backend_or_version_refused(pair):
    other = "fake" if pair.kind == "tcp" else "tcp"
    with pytest.raises(TransferError, match=f"speaks {other} v1, this endpoint speaks {pair.kind} v1"):
        pair.a.send({**pair.b_ep, "backend": other}, {"x": 1})
    with pytest.raises(TransferError, match=f"speaks {pair.kind} v9, this endpoint speaks {pair.kind} v1"):
        pair.a.send({**pair.b_ep, "version": 9}, {"x": 1})
    with pytest.raises(TransferError, match="bad transfer peer descriptor"):
        pair.a.send({"ip": "127.0.0.1"}, {"x": 1})
    with pytest.raises(TransferError, match="bad transfer peer descriptor"):
        pair.a.send({**pair.b_ep, "port": str(pair.b_ep["port"])}, {"x": 1})


def test_peer_gone_fails_fast(pair):
    pair.a.send(pair.b_ep, {"hello": 1})  # a cached connection exists now
    assert recv_until(pair.b, 1)
    pair.b.close()
    with pytest.raises(TransferError, match=pair.b_ep["ip"]):
        pair.a.send(pair.b_ep, {"x": 1})
    with pytest.raises(TransferError):
        pair.a.write_pages(pair.b_ep, pair.b_pool.layout, [0], [0])


def test_close_is_idempotent_and_final(pair):
    pair.a.send(pair.b_ep, {"x": 1})
    recv_until(pair.b, 1)
    pair.a.close()
    pair.a.close()
    with pytest.raises(TransferError, match="closed"):
        pair.a.send(pair.b_ep, {"x": 2})
    assert pair.a.recv(5.0) == []  # returns at once after close
    pair.b.close()
    assert tcp_threads(pair.a_ep, pair.b_ep) == []


# -- tcp only --------------------------------------------------------------------------------
@pytest.fixture
def tcp_pair(request):
    p = Pair("tcp", Pool(2, 8, 128, seed=4), Pool(2, 8, 128))
    request.addfinalizer(p.close)
    return p


def test_tcp_version_mismatch_on_the_wire(tcp_pair):
    class OldTcp(TcpBackend):
        protocol_version = 0

    old = OldTcp(connect_timeout=2.0)
    try:
        old.start(Pool(2, 8, 128).layout)
        peer = {k: v for k, v in tcp_pair.b_ep.items() if k != "version"}  # skip the local check
        with pytest.raises(TransferError, match="refused.*speaks tcp v0, this endpoint speaks tcp v1"):
            old.send(peer, {"x": 1})
    finally:
        old.close()
    tcp_pair.a.send(tcp_pair.b_ep, {"still": "serving"})
    assert [m for _, m in recv_until(tcp_pair.b, 1)] == [{"still": "serving"}]


def test_tcp_restarted_peer_is_refused(tcp_pair):
    port = tcp_pair.b_ep["port"]
    tcp_pair.b.close()
    c = TcpBackend()
    try:
        c.start(tcp_pair.b_pool.layout, port=port)
        with pytest.raises(TransferError, match="restarted"):
            tcp_pair.a.send(tcp_pair.b_ep, {"x": 1})
    finally:
        c.close()


def test_tcp_port_in_use_is_a_clear_error(tcp_pair):
    c = TcpBackend()
    try:
        with pytest.raises(TransferError, match=f"cannot listen on 127.0.0.1:{tcp_pair.b_ep['port']}"):
            c.start(tcp_pair.b_pool.layout, port=tcp_pair.b_ep["port"])
    finally:
        c.close()


def test_tcp_handshake_deadline():
    """A peer that accepts (kernel backlog) but never answers: TransferError at the deadline."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    a = TcpBackend(connect_timeout=0.3)
    try:
        a.start(Pool(2, 8, 128).layout)
        peer = {"backend": "tcp", "version": 1, "ip": "127.0.0.1", "port": silent.getsockname()[1]}
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="did not complete the handshake within 0.3s"):
            a.send(peer, {"x": 1})
        assert time.monotonic() - t0 < 20 * 0.3  # bounded by the deadline, not hanging
    finally:
        a.close()
        silent.close()


def _raw_hello(port: int) -> socket.socket:
    """A hand-made sender: connect and pass the hello; returns the socket."""
    from pdserve.transfer.tcp_wire import Frame, hello, read_dict, read_frame

    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    ep = {"backend": "tcp", "version": 1, "ip": "127.0.0.1", "port": 1, "instance": "raw"}
    s.sendall(hello("tcp", 1, ep, None))
    kind, _, n = read_frame(s)
    assert kind == Frame.HELLO_ACK and read_dict(s, n)["ok"]
    return s


def test_tcp_rejected_write_poisons_the_connection(tcp_pair):
    """A bad WRITE, then a MSG in the same burst: nothing lands, the MSG is never delivered,
    and the receiver answers with an ERROR frame naming the cause."""
    from pdserve.transfer.tcp_wire import HDR, RUN, Frame, dict_frame, read_dict, read_frame

    good_then_bad = [(0, 0, 128), (1, 0, 128)]  # region 1 at offset 0 lies in region 0
    with _raw_hello(tcp_pair.b_ep["port"]) as s:
        table = b"".join(RUN.pack(*r) for r in good_then_bad)
        s.sendall(HDR.pack(Frame.WRITE, 2, 256) + table + b"\xff" * 256 + dict_frame(Frame.MSG, {"x": 1}))
        kind, _, n = read_frame(s)
        assert kind == Frame.ERROR
        assert "outside region 1" in read_dict(s, n)["message"]
        assert tcp_pair.b.recv(0.3) == []
    assert not tcp_pair.b_pool.arr.any()


class Dribble:
    """A socket that moves at most `step` bytes per call, as a busy kernel may."""

    def __init__(self, sock: socket.socket, step: int):
        self.sock, self.step = sock, step

    def sendmsg(self, bufs):
        return self.sock.send(b"".join(bytes(b) for b in bufs)[:self.step])

    def recvmsg_into(self, views, flags=0, more=0):
        tmp = bytearray(min(self.step, sum(len(v) for v in views)))
        n = self.sock.recv_into(tmp)
        pos = 0
        for v in views:
            k = min(len(v), n - pos)
            v[:k] = tmp[pos:pos + k]
            pos += k
        return n, [], 0, None


def test_gather_scatter_survive_partial_io():
    from pdserve.transfer.tcp_wire import recv_scatter, send_gather

    a, b = socket.socketpair()
    try:
        data = np.random.default_rng(9).integers(0, 256, 1000, dtype=np.uint8)
        bufs = [memoryview(data)[i:j] for i, j in ((0, 3), (3, 3), (3, 500), (500, 1000))]
        t = threading.Thread(target=send_gather, args=(Dribble(a, 7), bufs))
        t.start()
        out = np.zeros(1000, np.uint8)
        views = [memoryview(out)[i:j] for i, j in ((0, 10), (10, 10), (10, 999), (999, 1000))]
        assert recv_scatter(Dribble(b, 5), views)
        t.join(timeout=10)
        assert np.array_equal(out, data)
    finally:
        a.close()
        b.close()


def test_tcp_garbage_connection_is_dropped(tcp_pair):
    with socket.create_connection(("127.0.0.1", tcp_pair.b_ep["port"]), timeout=5) as s:
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + b"\0" * 64)
        s.recv(4096)  # the refusal ack or EOF
    tcp_pair.a.send(tcp_pair.b_ep, {"ok": 1})
    assert [m for _, m in recv_until(tcp_pair.b, 1)] == [{"ok": 1}]
    assert not tcp_pair.b_pool.arr.any()


def test_tcp_close_stops_threads_with_open_connections(request):
    p = Pair("tcp", Pool(2, 8, 128, seed=5), Pool(2, 8, 128))
    request.addfinalizer(p.close)
    p.a.send(p.b_ep, {"x": 1})
    p.b.send(p.a_ep, {"y": 1})
    assert recv_until(p.b, 1) and recv_until(p.a, 1)
    assert len(tcp_threads(p.a_ep, p.b_ep)) == 4  # 2 acceptors, 2 readers
    p.close()
    assert tcp_threads(p.a_ep, p.b_ep) == []


class _AsIfRemoteTcp(TcpBackend):
    """Treats every peer as on another host: its non-blocking send path, over loopback."""

    @staticmethod
    def _same_host(peer_ip: str, local_ip: str) -> bool:
        return False


@pytest.mark.parametrize("cls", [TcpBackend, _AsIfRemoteTcp], ids=["same-host", "other-host"])
def test_tcp_stalled_peer_hits_io_deadline(cls):
    """A peer that completes the hello and then never reads: a big write fails at io_timeout,
    on the blocking (same host) and the poll-bounded (other host) send path alike."""
    from pdserve.transfer.tcp_wire import HDR, Frame, dict_frame

    lst = socket.create_server(("127.0.0.1", 0))
    conns: list[socket.socket] = []

    def fake_peer():
        s, _ = lst.accept()
        conns.append(s)
        _, _, n = HDR.unpack(s.recv(HDR.size, socket.MSG_WAITALL))
        s.recv(n, socket.MSG_WAITALL)
        s.sendall(dict_frame(Frame.HELLO_ACK, {"ok": True, "error": None}))

    t = threading.Thread(target=fake_peer)
    t.start()
    src = Pool(2, 256, 65536, seed=6)  # 32 MiB: far more than the socket buffers hold
    a = cls(connect_timeout=2.0, io_timeout=0.3)
    try:
        a.start(src.layout)
        peer = {"backend": "tcp", "version": 1, "ip": "127.0.0.1", "port": lst.getsockname()[1]}
        t0 = time.monotonic()
        with pytest.raises(TransferError, match="lost connection .* took no bytes for 0.3s"):
            a.write_pages(peer, src.layout, list(range(256)), list(range(256)))
        assert time.monotonic() - t0 < 10.0
        out = next(iter(a._out.values()))
        assert out.sock is None  # the broken connection is dropped, the next call reconnects
    finally:
        a.close()
        t.join(timeout=10)
        for s in conns:
            s.close()
        lst.close()


def test_tcp_read_frame_survives_short_reads_and_reports_eof():
    """recv_exact's fast path (one recv_into) falls back on a short read; EOF is clean or an error."""
    from pdserve.transfer.tcp_wire import HDR, Frame, read_frame

    a, b = socket.socketpair()
    try:
        b.settimeout(5.0)  # non-blocking fd underneath: MSG_WAITALL may return a partial read
        frame = HDR.pack(Frame.MSG, 7, 12345)
        a.sendall(frame[:5])
        t = threading.Timer(0.1, a.sendall, args=(frame[5:],))
        t.start()
        assert read_frame(b) == (Frame.MSG, 7, 12345)
        t.join()
        a.sendall(frame[:3])
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionError, match="middle of a frame"):
            read_frame(b, eof_ok=True)
    finally:
        a.close()
        b.close()
    a, b = socket.socketpair()
    a.close()
    try:
        assert read_frame(b, eof_ok=True) is None
    finally:
        b.close()


def test_tcp_socket_buffers_follow_the_peer_host():
    """Same-host connections get local_sockbuf_bytes on both ends, others sockbuf_bytes."""
    same = TcpBackend._same_host
    assert same("127.0.0.1", "10.1.2.3") and same("::1", "10.1.2.3") and same("10.1.2.3", "10.1.2.3")
    assert not same("10.1.2.4", "10.1.2.3") and not same("somehost", "10.1.2.3")
    a, b = TcpBackend(local_sockbuf_bytes=192 << 10), TcpBackend(local_sockbuf_bytes=192 << 10)
    try:
        a.start(Pool(2, 8, 128, seed=7).layout)
        b_ep = b.start(Pool(2, 8, 128).layout)
        a.send(b_ep, {"x": 1})
        assert recv_until(b, 1)
        out = next(iter(a._out.values())).sock
        inbound = next(iter(b._inbound))
        for s in (out, inbound):  # Linux reports twice the size set (bookkeeping overhead)
            assert s.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == 2 * (192 << 10)
            assert s.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) == 2 * (192 << 10)
        # the listener is left to autotuning (sockbuf_bytes=0): the window scale set at SYN then
        # covers what the kernel may grow to for a remote peer
        with socket.socket() as untouched:
            default = untouched.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF)
        assert b._listener.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == default
    finally:
        a.close()
        b.close()
    fixed = TcpBackend(sockbuf_bytes=1 << 20)  # a fixed size for other hosts reaches the listener
    try:
        fixed.start(Pool(2, 8, 128).layout)
        assert fixed._listener.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF) == 2 * (1 << 20)
    finally:
        fixed.close()


@pytest.mark.parametrize("cls,blocking", [(TcpBackend, True), (_AsIfRemoteTcp, False)],
                         ids=["same-host", "other-host"])
def test_tcp_outbound_send_mode_follows_the_peer_host(cls, blocking):
    """Same host: a blocking socket under SO_SNDTIMEO. Other hosts: non-blocking, each send
    bounded by io_timeout in poll. Pages and messages arrive either way."""
    a, b = cls(io_timeout=7.0), TcpBackend()
    try:
        src = Pool(2, 8, 128, seed=8)
        a.start(src.layout)
        dst = Pool(2, 8, 128)
        b_ep = b.start(dst.layout)
        a.write_pages(b_ep, dst.layout, [0, 1, 2], [5, 3, 4])
        a.send(b_ep, {"x": 1})
        assert recv_until(b, 1)
        assert np.array_equal(dst.pages[0, 5], src.pages[0, 0]) and np.array_equal(dst.pages[1, 4], src.pages[1, 2])
        out = next(iter(a._out.values())).sock
        assert out.gettimeout() == (None if blocking else 7.0)
        sndtimeo = out.getsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, 16)
        assert (sndtimeo != bytes(16)) == blocking
    finally:
        a.close()
        b.close()
