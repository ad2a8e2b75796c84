"""The tcp backend's wire format and zero-copy socket I/O; tcp.py owns connections and threads.

Every frame starts with HDR (kind, count, nbytes). HELLO, HELLO_ACK, MSG and ERROR carry a
msgpack dict of `nbytes`. WRITE carries a table of `count` RUNs (region, offset from the
receiver's base_ptr, length) then their `nbytes` raw bytes: the sender gathers them from its
pool with sendmsg, the receiver scatters them into its pool with recvmsg_into, no copies.
"""

from __future__ import annotations

import enum
import socket
import struct
from typing import Iterator

from .base import MAX_MSG_BYTES, Endpoint, PageCopy, decode_msg, encode_msg, peer_name

HDR = struct.Struct("!B3xIQ")
RUN = struct.Struct("!IQQ")
MAGIC = "pdserve-transfer"
RUNS_PER_WRITE = 256  # iovecs per sendmsg / recvmsg_into stay well under IOV_MAX (1024)
_DISCARD = 1 << 20


class Frame(enum.IntEnum):
    HELLO = 1
    HELLO_ACK = 2
    MSG = 3
    WRITE = 4
    ERROR = 5


def _advance(bufs: list, i: int, n: int) -> int:
    """Consume n bytes from bufs[i:]; return the index of the first buffer with bytes left."""
    while i < len(bufs) and n >= len(bufs[i]):
        n -= len(bufs[i])
        i += 1
    if n:
        bufs[i] = bufs[i][n:]
    return i


def send_gather(sock: socket.socket, bufs: list) -> None:
    """Send every buffer in order, as few sendmsg calls as the kernel allows."""
    i = _advance(bufs, 0, 0)
    while i < len(bufs):
        i = _advance(bufs, i, sock.sendmsg(bufs[i:]))


def recv_scatter(sock: socket.socket, views: list[memoryview], eof_ok: bool = False) -> bool:
    """Fill every view in order. False on a clean EOF before the first byte when eof_ok."""
    i, first = _advance(views, 0, 0), True
    while i < len(views):
        got = sock.recvmsg_into(views[i:], 0, socket.MSG_WAITALL)[0]
        if got == 0:
            if first and eof_ok:
                return False
            raise ConnectionError("connection closed in the middle of a frame")
        i, first = _advance(views, i, got), False
    return True


def recv_exact(sock: socket.socket, buf: bytearray, eof_ok: bool = False) -> bool:
    """Fill a small buffer: one recv_into in the usual case (a header, a run table, a message),
    recv_scatter for the rest of a short read. False on a clean EOF before the first byte when eof_ok."""
    if not buf:
        return True
    got = sock.recv_into(buf, len(buf), socket.MSG_WAITALL)
    if got == len(buf):
        return True
    if got == 0 and eof_ok:
        return False
    if got == 0:
        raise ConnectionError("connection closed in the middle of a frame")
    return recv_scatter(sock, [memoryview(buf)[got:]])


def read_frame(sock: socket.socket, eof_ok: bool = False) -> tuple[int, int, int] | None:
    """(kind, count, nbytes) of the next frame; None on a clean EOF when eof_ok."""
    hdr = bytearray(HDR.size)
    return HDR.unpack(hdr) if recv_exact(sock, hdr, eof_ok) else None


def read_dict(sock: socket.socket, nbytes: int) -> dict:
    if nbytes > MAX_MSG_BYTES:
        raise ValueError(f"control frame of {nbytes} bytes exceeds {MAX_MSG_BYTES}")
    buf = bytearray(nbytes)
    recv_exact(sock, buf)
    return decode_msg(buf)


def dict_frame(kind: Frame, payload: dict) -> bytes:
    data = encode_msg(payload)
    return HDR.pack(kind, 0, len(data)) + data


def write_frames(copies: list[PageCopy], mem: memoryview) -> Iterator[list]:
    """The buffers of each WRITE frame: header + run table, then views of the local pool."""
    for i in range(0, len(copies), RUNS_PER_WRITE):
        batch = copies[i:i + RUNS_PER_WRITE]
        head = [HDR.pack(Frame.WRITE, len(batch), sum(c.nbytes for c in batch))]
        head += [RUN.pack(c.region, c.dst_offset, c.nbytes) for c in batch]
        yield [b"".join(head), *(mem[c.src_offset:c.src_offset + c.nbytes] for c in batch)]


def read_runs(sock: socket.socket, count: int, nbytes: int) -> list[tuple[int, int, int]]:
    """The (region, offset, length) table of a WRITE frame whose header was just read."""
    if count > RUNS_PER_WRITE:
        raise ValueError(f"write frame with {count} runs (max {RUNS_PER_WRITE})")
    table = bytearray(count * RUN.size)
    recv_exact(sock, table)
    runs = list(RUN.iter_unpack(table))
    if sum(r[2] for r in runs) != nbytes:
        raise ValueError(f"write frame announces {nbytes} bytes but its runs hold {sum(r[2] for r in runs)}")
    return runs


def discard(sock: socket.socket, nbytes: int) -> None:
    scratch = memoryview(bytearray(min(nbytes, _DISCARD)))
    for off in range(0, nbytes, _DISCARD):
        recv_scatter(sock, [scratch[:min(_DISCARD, nbytes - off)]])


def hello(backend: str, version: int, endpoint: Endpoint, expect_instance: str | None) -> bytes:
    return dict_frame(Frame.HELLO, {"magic": MAGIC, "backend": backend, "version": version,
                                    "endpoint": endpoint, "expect_instance": expect_instance})


def hello_refusal(msg: dict, backend: str, version: int, endpoint: Endpoint) -> str | None:
    """Why this endpoint (backend vX at `endpoint`) refuses a received hello, or None."""
    me = f"{peer_name(endpoint)} ({backend} v{version})"
    sender = msg.get("endpoint")
    if msg.get("magic") != MAGIC or not isinstance(sender, dict):
        return f"{me} got a connection that is not a pdserve transfer hello"
    if msg.get("backend") != backend or msg.get("version") != version:
        return (f"{me} refused {peer_name(sender)}: it speaks {msg.get('backend')} "
                f"v{msg.get('version')}, this endpoint speaks {backend} v{version}")
    if msg.get("expect_instance") not in (None, endpoint["instance"]):
        return (f"{me} is instance {endpoint['instance']}, not the expected "
                f"{msg.get('expect_instance')} (the peer restarted)")
    return None
