"""The transfer backend contract: move KV pages into a peer's registered pool, send small messages.

Every DP worker owns one backend. Peers are named by the endpoint descriptor `start()` returns
(a json-able dict). Page writes are planned here once (validation + run coalescing) and moved
by each backend's `_copy`; tcp streams them, fake memcpys them, mooncake writes remote memory.
"""

from __future__ import annotations

import ctypes
import operator
import queue
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple

import msgspec

from ..core.errors import HandoffFailed
from ..core.kv_layout import KVLayout
from ..core.pd_vocab import BackendName

PROTOCOL_VERSION = 1
# an endpoint's descriptor as `start()` returns it: backend, version, ip, port, instance, and
# what the backend adds (mooncake's session, nixl's agent); json-able, it crosses the wire as is
Endpoint = dict[str, Any]
MAX_MSG_BYTES = 16 << 20


class TransferError(HandoffFailed):
    """A transfer failed: unreachable or refused peer, lost connection, bad pages. Names the peer."""

    type = "transfer_error"


@dataclass(frozen=True)
class WriteResult:
    """What `write_pages` moved and when (time.time()), measured around the byte movement only."""

    bytes: int
    started_at: float
    finished_at: float
    num_writes: int = 0  # contiguous runs moved (regions x coalesced runs)

    @property
    def seconds(self) -> float:
        return self.finished_at - self.started_at


class PageCopy(NamedTuple):  # a tuple: plans of thousands of runs are built per request
    """One contiguous byte run of one region: local base + src_offset -> peer base + dst_offset."""

    region: int
    src_offset: int
    dst_offset: int
    nbytes: int


def peer_name(peer: Endpoint) -> str:
    """A short human name of an endpoint descriptor for errors and logs."""
    if not isinstance(peer, dict):
        return repr(peer)
    return f"{peer.get('backend', '?')}://{peer.get('ip', '?')}:{peer.get('port', '?')}"


def encode_msg(msg: dict) -> bytes:
    if not isinstance(msg, dict):
        raise TransferError(f"control message must be a dict, got {type(msg).__name__}")
    try:
        return msgspec.msgpack.encode(msg)
    except (TypeError, msgspec.EncodeError) as e:
        raise TransferError(f"control message is not serializable: {e}") from None


def decode_msg(data: bytes | bytearray | memoryview) -> dict:
    msg = msgspec.msgpack.decode(data)
    if not isinstance(msg, dict):
        raise ValueError(f"control message is a {type(msg).__name__}, not a dict")
    return msg


def memory_view(base_ptr: int, nbytes: int) -> memoryview:
    """A writable byte view over raw memory [base_ptr, base_ptr + nbytes); no copy."""
    if nbytes == 0:
        return memoryview(bytearray())
    return memoryview((ctypes.c_char * nbytes).from_address(base_ptr)).cast("B")


def joint_runs(src_pages: list[int], dst_pages: list[int]) -> list[tuple[int, int, int]]:
    """(src_first, dst_first, count) runs where both sides are consecutive, order kept."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_pages, dst_pages):
        if runs:
            s0, d0, n = runs[-1]
            if s0 + n == s and d0 + n == d:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs


def plan_copies(local: KVLayout, peer: KVLayout, src_pages: list[int], dst_pages: list[int],
                who: str) -> list[PageCopy]:
    """Validate a page write and coalesce it into one PageCopy per (region, joint run)."""
    try:
        src_pages = [operator.index(p) for p in src_pages]
        dst_pages = [operator.index(p) for p in dst_pages]
    except TypeError as e:
        raise TransferError(f"write to {who}: page indices must be integers ({e})") from None
    if len(src_pages) != len(dst_pages):
        raise TransferError(f"write to {who}: {len(src_pages)} source pages but {len(dst_pages)} "
                            "destination pages")
    for what, a, b in (("page_bytes", local.page_bytes, peer.page_bytes),
                       ("num_regions", local.num_regions, peer.num_regions),
                       ("dtype", local.dtype, peer.dtype)):
        if a != b:
            raise TransferError(f"write to {who}: KV layout mismatch, local {what}={a} but peer {what}={b}")
    for side, pages, limit in (("source", src_pages, local.num_pages), ("destination", dst_pages, peer.num_pages)):
        if pages and not (0 <= min(pages) and max(pages) < limit):
            bad = [p for p in pages if not 0 <= p < limit]
            raise TransferError(f"write to {who}: {side} pages {bad[:8]} out of range [0, {limit})")
    pb, ls, ps = local.page_bytes, local.region_stride, peer.region_stride
    return [PageCopy(r, r * ls + s * pb, r * ps + d * pb, n * pb)
            for s, d, n in joint_runs(src_pages, dst_pages) for r in range(local.num_regions)]


def out_of_bounds(layout: KVLayout, region: int, offset: int, nbytes: int) -> str | None:
    """Why a write of `nbytes` at byte `offset` (from base_ptr) into `region` of this pool must be
    refused, or None if it stays inside that region's pages."""
    lo = region * layout.region_stride
    if region < layout.num_regions and lo <= offset and offset + nbytes <= lo + layout.num_pages * layout.page_bytes:
        return None
    return (f"{nbytes} bytes at offset {offset} are outside region {region} of {layout.num_regions} "
            f"regions x {layout.num_pages} pages x {layout.page_bytes} bytes")


class Inbox:
    """Received (sender descriptor, msg) pairs; `close()` wakes and ends every waiting `take`."""

    def __init__(self) -> None:
        self._q: queue.Queue = queue.Queue()

    def put(self, sender: dict, msg: dict) -> None:
        self._q.put((sender, msg))

    def close(self) -> None:
        self._q.put(None)

    def take(self, timeout: float) -> list[tuple[dict, dict]]:
        """Everything queued now, waiting up to `timeout` seconds for the first item."""
        out: list[tuple[dict, dict]] = []
        try:
            item = self._q.get(timeout=timeout) if timeout > 0 else self._q.get_nowait()
            while item is not None:
                out.append(item)
                item = self._q.get_nowait()
            self._q.put(None)  # keep the closed mark for the next caller
        except queue.Empty:
            pass
        return out


class TransferBackend(ABC):
    """One endpoint of a KV transfer fabric; a DP worker owns exactly one.

    Contract:
    - `start(layout, host, port, advertise)` registers the local KV pool memory (`layout.base_ptr`
      .. `+ layout.total_bytes`, which must stay alive until `close()`) and starts listening on
      `host` (IPv4 or IPv6; 0.0.0.0 or :: for all). It returns this endpoint's descriptor: a
      json-able dict with at least `backend`, `version`, `ip` (what peers connect to: `advertise`
      when given, else `core.netaddr.resolve_advertise_host(host)`), `port` and `instance` (random
      per start; a restarted peer has a new one). Other endpoints name this one by that dict.
    - `send(peer, msg)` delivers a small json-able dict (msgpack on the wire: tuples come back
      as lists) to `peer`. Per peer, messages and page writes are delivered in the order they
      were issued, reliably or not at all; a message issued after `write_pages` to the same peer
      is only delivered once those pages are fully in the peer's memory (a backend whose data
      and control paths differ waits for write completion before sending). Raises
      TransferError (naming the peer) when the peer is unreachable, does not answer the
      connect handshake within its deadline, refuses us (other backend, protocol version or
      instance) or the connection is lost.
    - `write_pages(peer, peer_layout, src_pages, dst_pages)` copies page src_pages[i] of every
      region of the local pool into page dst_pages[i] of the peer's pool (peer_layout is the
      peer's KVLayout, as its KvReq carried it). Runs contiguous on both sides move as one write per region.
      Blocks the calling thread until the bytes have left this process (tcp) or landed
      (memory-to-memory backends); completion at the receiver is signalled by the next message.
      Returns a WriteResult. Raises TransferError on bad pages, incompatible layouts or loss.
      The receiver checks every write against its own pool: one outside it is rejected, fails
      this call or the next call to that peer, and no later message on that path is delivered.
    - `recv(timeout)` returns the (sender descriptor, msg) pairs received since the last call,
      waiting up to `timeout` seconds when there are none; [] on timeout or after close.
    - `close()` is idempotent: stops every thread, closes every socket, forgets every peer;
      later calls raise TransferError.
    All methods but start/close may be called from several threads at once. Subclasses
    implement start/send/recv/close and `_copy`; `write_pages` validates and plans for them.
    """

    name: ClassVar[BackendName]  # each backend's, also its descriptor's "backend"
    protocol_version: int = PROTOCOL_VERSION
    networked: bool = True  # peers connect to the descriptor's ip:port (False: in-process only)

    @classmethod
    def env_options(cls, envs) -> dict:
        """Constructor options this backend takes from the env registry (none by default)."""
        return {}

    def __init__(self) -> None:
        self.layout: KVLayout | None = None
        self.endpoint: Endpoint | None = None

    @abstractmethod
    def start(self, layout: KVLayout, host: str = "127.0.0.1", port: int = 0, advertise: str = "") -> Endpoint:
        ...

    @abstractmethod
    def send(self, peer: Endpoint, msg: dict) -> None:
        ...

    @abstractmethod
    def recv(self, timeout: float) -> list[tuple[dict, dict]]:
        ...

    @abstractmethod
    def close(self) -> None:
        ...

    @abstractmethod
    def _copy(self, peer: Endpoint, copies: list[PageCopy]) -> tuple[float, float]:
        """Move the planned runs to `peer`; return (started_at, finished_at) of the movement."""

    def write_pages(self, peer: Endpoint, peer_layout: KVLayout, src_pages: list[int],
                    dst_pages: list[int]) -> WriteResult:
        if self.layout is None:
            raise TransferError(f"{self.name} backend: write_pages before start()")
        self.check_peer(peer)
        copies = plan_copies(self.layout, peer_layout, src_pages, dst_pages, peer_name(peer))
        started, finished = self._copy(peer, copies)
        return WriteResult(sum(c.nbytes for c in copies), started, finished, len(copies))

    def check_peer(self, peer: Endpoint) -> None:
        """Refuse a descriptor of another backend or protocol version before any I/O."""
        if (not isinstance(peer, dict) or not {"backend", "ip", "port"} <= peer.keys()
                or not isinstance(peer["port"], int) or not isinstance(peer["ip"], str)):
            raise TransferError(f"bad transfer peer descriptor {peer!r}: needs backend, ip (str), port (int)")
        if peer["backend"] != self.name or peer.get("version", self.protocol_version) != self.protocol_version:
            raise TransferError(
                f"transfer peer {peer_name(peer)} speaks {peer['backend']} "
                f"v{peer.get('version', '?')}, this endpoint speaks {self.name} v{self.protocol_version}")
