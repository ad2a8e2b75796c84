"""Socket chores of the tcp backend: buffer sizes and send deadlines by where the peer is, a
non-blocking look for a peer's ERROR frame, and a shutdown that never raises."""

from __future__ import annotations

import ipaddress
import select
import socket
import struct

from . import tcp_wire as wire

Frame = wire.Frame


def tune(sock: socket.socket, nbytes: int) -> None:
    """No Nagle delay; send and receive buffers of nbytes where > 0 (else the kernel's)."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if nbytes > 0:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, nbytes)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, nbytes)


def arm_deadline(sock: socket.socket, io_timeout: float, same_host: bool) -> None:
    """Bound every send on an outbound connection by io_timeout without progress.

    To another host the socket is non-blocking and each sendmsg waits in poll: a blocking
    send of a 24 MiB frame keeps the socket owned for the whole copy, so the peer's ACKs wait
    in its backlog and the window opens in bursts; across a veth that moved 0.64-0.79x of a
    raw socket against a median 0.95-0.99x non-blocking (docs/benchmarks.md, "The send mode").
    On one host a blocking socket under SO_SNDTIMEO is faster (one sendmsg per frame into the
    small local buffers, no poll between): 3.6-4.4 GB/s on loopback against 2.2-3.2."""
    if not same_host:
        sock.settimeout(io_timeout)
        return
    sock.settimeout(None)
    tv = struct.pack("ll", int(io_timeout), int(io_timeout % 1 * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)


def is_same_host(peer_ip: str, local_ip: str) -> bool:
    """Whether a connection between these addresses stays inside this machine."""
    try:
        return peer_ip == local_ip or ipaddress.ip_address(peer_ip).is_loopback
    except ValueError:
        return False


def closed_by_peer(sock: socket.socket) -> str | None:
    """None while the connection is open; else the peer's ERROR message, or "" if it just closed.
    (Receivers only ever send on an inbound connection to report an error.)"""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    if not poller.poll(0):
        return None
    try:
        frame = wire.read_frame(sock, eof_ok=True)
        if frame is None:
            return ""
        kind, _, n = frame
        return str(wire.read_dict(sock, n).get("message")) if kind == Frame.ERROR else ""
    except (OSError, ValueError):
        return ""


def shutdown(sock: socket.socket | None) -> None:
    """Shut both directions (wakes a thread blocked on it at once on Linux); never raises."""
    if sock is not None:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
