"""What only the tcp transfer backend does: its wire (hello, frames, partial socket I/O, a
rejected write poisoning its connection), restarts, ports, deadlines, socket buffers and send
modes. The contract every backend keeps is test_transfer_contract.py (tcp and fake included).

Pools are numpy arrays with a guard area after the layout (tests.harness.transfer_pools), so a
stray write anywhere is caught. Everything binds 127.0.0.1 on free ports.
"""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from pdserve.transfer import TransferError
from pdserve.transfer.tcp import TcpBackend
from tests.harness.transfer_pools import BackendPair, Pool, recv_until, tcp_threads

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def tcp_pair(request):
    p = BackendPair("tcp", Pool(2, 8, 128, seed=4), Pool(2, 8, 128))
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
    p = BackendPair("tcp", Pool(2, 8, 128, seed=5), Pool(2, 8, 128))
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
