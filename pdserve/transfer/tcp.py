"""The built-in tcp backend: page bytes and control messages share one ordered stream per peer.

Each backend listens (an accept thread, one reader thread per inbound connection) and keeps one
cached outbound connection per peer. A peer's frames (tcp_wire.py) share that connection and
are read by one thread, so a MSG reaches `recv()` only after every earlier WRITE is in memory.
A WRITE outside the receiver's pool poisons its connection: the reader discards the rest and
sends an ERROR frame back, which the sender raises on its next call to that peer.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass, field

from ..core.kv_layout import KVLayout
from ..core.netaddr import AddressError, family_of, host_port, resolve_advertise_host, strip_brackets
from ..core.pd_vocab import BackendName
from . import tcp_wire as wire
from .base import Endpoint, Inbox, PageCopy, TransferBackend, TransferError, memory_view, out_of_bounds, peer_name
from .tcp_socket import arm_deadline, closed_by_peer, is_same_host, shutdown, tune

log = logging.getLogger(__name__)
Frame = wire.Frame


@dataclass
class _OutConn:
    """The cached outbound connection to one peer; `lock` serializes everything sent on it."""

    sock: socket.socket | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class TcpBackend(TransferBackend):
    """Sockets over TCP. Outbound: one cached connection per peer, reconnected once when found
    closed at the start of a call; a failure in the middle of a call raises (bytes may be lost).
    Peers are keyed by instance: a peer restarted on the same address replaces (and closes) the
    connection to its old instance."""

    name = BackendName.TCP

    def __init__(self, connect_timeout: float = 5.0, io_timeout: float = 60.0,
                 sockbuf_bytes: int = 0, local_sockbuf_bytes: int = 256 << 10):
        super().__init__()
        self.connect_timeout = connect_timeout
        self.io_timeout = io_timeout
        # SO_SNDBUF/SO_RCVBUF to another host; 0 = the kernel's autotuning, which sizes the window
        # to the path's bandwidth-delay product (up to net.ipv4.tcp_rmem/wmem max). A fixed size
        # turns autotuning off: at 180 MiB across a veth 4 MiB moved a median 0.85x of a default
        # raw socket, autotuning 0.95x (docs/benchmarks.md, "KV transfer backends across network
        # namespaces").
        self.sockbuf_bytes = sockbuf_bytes
        # Same for a peer on this host (loopback or our own address); 0 = no explicit size (an
        # accepted socket keeps the listener's). Within one host there is no bandwidth-delay
        # product to cover, and a small window keeps the bytes in flight cache-resident: 1.5-1.8x
        # the loopback throughput of 4 MiB buffers (docs/benchmarks.md).
        self.local_sockbuf_bytes = local_sockbuf_bytes
        self._inbox = Inbox()
        self._lock = threading.Lock()  # guards _out, _inbound, _closed
        self._out: dict[tuple, _OutConn] = {}
        self._inbound: dict[socket.socket, threading.Thread] = {}
        # every reader thread not yet known dead: close() joins them all, including one that
        # already left _inbound but is still finishing (else "closed" would not be final)
        self._readers: set[threading.Thread] = set()
        self._closed = False
        self._stop = threading.Event()
        self._listener: socket.socket | None = None
        self._acceptor: threading.Thread | None = None
        self._mem = memoryview(bytearray())

    _same_host = staticmethod(is_same_host)  # a seam: tests take other hosts' send path on loopback

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, layout: KVLayout, host: str = "127.0.0.1", port: int = 0, advertise: str = "") -> Endpoint:
        if self.endpoint is not None or self._closed:
            raise TransferError("a tcp backend starts once; create a new one")
        try:
            ip = resolve_advertise_host(host, advertise)
        except AddressError as e:
            raise TransferError(f"tcp transfer backend: {e}") from None
        self.layout = layout
        self._mem = memory_view(layout.base_ptr, layout.total_bytes)
        host = strip_brackets(host)
        lst = socket.socket(family_of(host), socket.SOCK_STREAM)
        try:
            lst.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tune(lst, self.sockbuf_bytes)  # accepted sockets inherit the buffer sizes (window scale is set at SYN)
            lst.bind((host, port))
            lst.listen(128)
        except OSError as e:
            lst.close()
            raise TransferError(f"tcp transfer backend cannot listen on {host_port(host, port)}: {e}") from None
        lst.settimeout(0.2)  # the accept loop polls _stop
        self._listener = lst
        self.endpoint = {"backend": self.name, "version": self.protocol_version,
                         "ip": ip, "port": lst.getsockname()[1],
                         "instance": secrets.token_hex(8)}
        self._acceptor = threading.Thread(target=self._accept_loop, daemon=True,
                                          name=f"pdserve-tcp-accept-{self.endpoint['port']}")
        self._acceptor.start()
        return dict(self.endpoint)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            outs, inbound, readers = list(self._out.values()), dict(self._inbound), set(self._readers)
            self._out.clear()
        self._stop.set()
        self._inbox.close()  # wakes a blocked recv()
        for conn in outs:
            shutdown(conn.sock)  # without the lock: a blocked sendall fails at once
        for sock in [self._listener, *inbound]:
            shutdown(sock)  # wakes accept() and recv_into() at once on Linux
        for t in [self._acceptor, *readers]:
            if t is not None and t is not threading.current_thread():
                t.join(timeout=5.0)
                if t.is_alive():
                    log.error("tcp transfer thread %s did not stop within 5s", t.name)
        if self._listener is not None:
            self._listener.close()
        for conn in outs:
            sock = conn.sock
            if sock is not None:
                sock.close()

    # -- outbound ------------------------------------------------------------------------------
    def send(self, peer: Endpoint, msg: dict) -> None:
        self.check_peer(peer)
        frame = wire.dict_frame(Frame.MSG, msg)
        self._on_conn(peer, lambda sock: sock.sendall(frame))

    def _copy(self, peer: Endpoint, copies: list[PageCopy]) -> tuple[float, float]:
        mem = self._mem

        def move(sock: socket.socket) -> tuple[float, float]:
            started = time.time()
            for bufs in wire.write_frames(copies, mem):
                wire.send_gather(sock, bufs)
            return started, time.time()

        return self._on_conn(peer, move)

    def _on_conn(self, peer: Endpoint, op):
        name = peer_name(peer)
        key = (peer["ip"], int(peer["port"]), peer.get("instance"))
        with self._lock:
            if self._closed or self.endpoint is None:
                raise TransferError(f"tcp backend is {'closed' if self._closed else 'not started'}; "
                                    f"cannot reach {name}")
            conn = self._out.get(key)
            if conn is None:
                conn = self._out[key] = _OutConn()
                stale = [k for k in self._out if k[:2] == key[:2] and k != key]
                old = [self._out.pop(k) for k in stale]  # a restarted peer: its old instance is gone
            else:
                old = []
        for dead in old:
            self._drop_conn(dead)
        with conn.lock:
            closed = closed_by_peer(conn.sock) if conn.sock is not None else None
            if closed is not None:
                conn.sock.close()
                conn.sock = None
                if closed:
                    raise TransferError(f"transfer peer {name} rejected an earlier write: {closed}")
            if conn.sock is None:
                conn.sock = self._connect(peer, name)
                if self._closed:  # close() ran while we connected: it cannot see this socket
                    conn.sock.close()
                    raise TransferError(f"tcp backend is closed; cannot reach {name}")
            try:
                return op(conn.sock)
            except OSError as e:
                conn.sock.close()
                conn.sock = None
                if isinstance(e, (BlockingIOError, TimeoutError)):  # SO_SNDTIMEO or the poll deadline expired
                    e = f"the peer took no bytes for {self.io_timeout}s"
                raise TransferError(f"lost connection to transfer peer {name}: {e}") from None

    def _drop_conn(self, conn: _OutConn) -> None:
        """Close a cached connection no longer in the table; one busy in another thread is shut
        down, and that thread closes it when its call fails."""
        if conn.lock.acquire(blocking=False):
            try:
                if conn.sock is not None:
                    conn.sock.close()
                    conn.sock = None
            finally:
                conn.lock.release()
        else:
            shutdown(conn.sock)

    def _connect(self, peer: Endpoint, name: str) -> socket.socket:
        deadline = time.monotonic() + self.connect_timeout
        sock = socket.socket(family_of(peer["ip"]), socket.SOCK_STREAM)
        same_host = self._same_host(peer["ip"], self.endpoint["ip"])
        try:
            tune(sock, self.local_sockbuf_bytes if same_host else self.sockbuf_bytes)
            sock.settimeout(self.connect_timeout)
            sock.connect((peer["ip"], int(peer["port"])))
            sock.settimeout(max(deadline - time.monotonic(), 1e-3))
            sock.sendall(wire.hello(self.name, self.protocol_version, self.endpoint, peer.get("instance")))
            kind, _, n = wire.read_frame(sock)
            ack = wire.read_dict(sock, n)
            if kind != Frame.HELLO_ACK or not ack.get("ok"):
                raise TransferError(f"transfer peer {name} refused the connection: {ack.get('error')}")
            arm_deadline(sock, self.io_timeout, same_host)
            return sock
        except TransferError:
            sock.close()
            raise
        except socket.timeout:
            sock.close()
            raise TransferError(f"transfer peer {name} did not complete the handshake within "
                                f"{self.connect_timeout}s") from None
        except (OSError, ValueError) as e:
            sock.close()
            raise TransferError(f"cannot connect to transfer peer {name}: {e}") from None

    # -- inbound -------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._stop.is_set():
            try:
                sock, _ = self._listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            t = threading.Thread(target=self._serve, args=(sock,), daemon=True,
                                 name=f"pdserve-tcp-reader-{self.endpoint['port']}")
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._inbound[sock] = t
                self._readers = {r for r in self._readers if r.is_alive()}
                self._readers.add(t)
                t.start()  # under the lock: close() never sees (and joins) an unstarted thread

    def _serve(self, sock: socket.socket) -> None:
        sender = None
        try:
            # The listener's buffers (autotuned or sockbuf_bytes) set the window scale at SYN;
            # a same-host peer shrinks them.
            tune(sock, self.local_sockbuf_bytes if self._same_host(sock.getpeername()[0], sock.getsockname()[0])
                 else self.sockbuf_bytes)
            sender = self._handshake(sock)
            if sender is not None:
                self._read_frames(sock, sender)
        except (OSError, ValueError) as e:
            if not self._stop.is_set():
                log.warning("tcp transfer %s: connection from %s dropped: %s", peer_name(self.endpoint),
                            peer_name(sender) if sender else "unknown peer", e)
        finally:
            with self._lock:
                self._inbound.pop(sock, None)
            sock.close()

    def _handshake(self, sock: socket.socket) -> dict | None:
        """Read the peer's hello and answer it; the sender's descriptor, or None if refused."""
        sock.settimeout(self.connect_timeout)
        frame = wire.read_frame(sock, eof_ok=True)
        if frame is None:  # closed before a hello: a reachability probe (core.netaddr)
            return None
        kind, _, n = frame
        msg = wire.read_dict(sock, n) if kind == Frame.HELLO else {}
        error = wire.hello_refusal(msg, self.name, self.protocol_version, self.endpoint)
        sock.sendall(wire.dict_frame(Frame.HELLO_ACK, {"ok": error is None, "error": error,
                                                       "instance": self.endpoint["instance"]}))
        if error is not None:
            log.warning("tcp transfer: %s", error)
            return None
        sock.settimeout(None)
        return msg["endpoint"]

    def _read_frames(self, sock: socket.socket, sender: dict) -> None:
        mem, lay = self._mem, self.layout
        poisoned = False  # after a rejected write: read and drop everything that follows
        while (frame := wire.read_frame(sock, eof_ok=True)) is not None:
            kind, count, nbytes = frame
            if kind == Frame.MSG:
                msg = wire.read_dict(sock, nbytes)
                if not poisoned:
                    self._inbox.put(sender, msg)
                continue
            if kind != Frame.WRITE:
                raise ValueError(f"unexpected frame kind {kind}")
            runs = wire.read_runs(sock, count, nbytes)
            bad = None if poisoned else next(filter(None, (out_of_bounds(lay, *r) for r in runs)), None)
            if bad:
                reason = f"{peer_name(self.endpoint)} rejected a write from {peer_name(sender)}: {bad}"
                log.warning("tcp transfer: %s; dropping the connection", reason)
                sock.sendall(wire.dict_frame(Frame.ERROR, {"message": reason}))
                poisoned = True
            if poisoned:
                wire.discard(sock, nbytes)
            else:
                wire.recv_scatter(sock, [mem[off:off + n] for _, off, n in runs])

    def recv(self, timeout: float) -> list[tuple[dict, dict]]:
        return self._inbox.take(timeout)

    # -- helpers -------------------------------------------------------------------------------
