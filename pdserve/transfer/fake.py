"""An in-process transfer backend for unit tests: a shared FakeFabric instead of sockets.

Same semantics as tcp (descriptors, ordering, refusals, bounds checks), but page writes are a
ctypes memmove into the peer's registered memory and messages go straight to its inbox.
`Faults` on each backend and `FakeFabric.drop()` inject the failures the handoff state
machines must survive: a failing write or send, a slow peer, a peer that vanished.
"""

from __future__ import annotations

import ctypes
import secrets
import threading
import time
from dataclasses import dataclass

from ..core.kv_layout import KVLayout
from ..core.pd_vocab import BackendName
from .base import (
    Endpoint,
    Inbox,
    PageCopy,
    TransferBackend,
    TransferError,
    decode_msg,
    encode_msg,
    out_of_bounds,
    peer_name,
)


@dataclass
class Faults:
    """Failure knobs of one fake backend, applied to what it sends; tests set them directly."""

    fail_writes: int = 0  # the next N write_pages calls raise TransferError before moving bytes
    fail_sends: int = 0  # the next N send calls raise TransferError
    lose_sends: int = 0  # the next N send calls return but their message is never delivered
    delay_s: float = 0.0  # sleep before every write_pages and send (a slow link)

    def take(self, knob: str) -> bool:
        """Consume one unit of a counting knob; True if it fired."""
        left = getattr(self, knob)
        if left > 0:
            setattr(self, knob, left - 1)
            return True
        return False


class FakeFabric:
    """The 'network' that fake backends of one test share: endpoints by port, dropped ports."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._endpoints: dict[int, FakeBackend] = {}
        self._dropped: set[int] = set()
        self._next_port = 1

    def attach(self, backend: "FakeBackend") -> int:
        with self._lock:
            port = self._next_port
            self._next_port += 1
            self._endpoints[port] = backend
            return port

    def detach(self, port: int) -> None:
        with self._lock:
            self._endpoints.pop(port, None)

    def drop(self, endpoint: Endpoint) -> None:
        """Make an endpoint vanish: everything to or from it fails from now on."""
        with self._lock:
            self._dropped.add(endpoint["port"])

    def resolve(self, src: "FakeBackend", peer: Endpoint) -> "FakeBackend":
        name = peer_name(peer)
        with self._lock:
            if src.endpoint["port"] in self._dropped:
                raise TransferError(f"fake endpoint {peer_name(src.endpoint)} was dropped; cannot reach {name}")
            target = self._endpoints.get(peer["port"])
            if target is None or peer["port"] in self._dropped:
                raise TransferError(f"cannot connect to transfer peer {name}: no such endpoint (gone)")
        if peer.get("instance") not in (None, target.endpoint["instance"]):
            raise TransferError(f"transfer peer {name} refused the connection: it is instance "
                                f"{target.endpoint['instance']}, not {peer.get('instance')} (the peer restarted)")
        return target


class FakeBackend(TransferBackend):
    """Fake endpoint on a FakeFabric (a private one if none is given)."""

    name = BackendName.FAKE
    networked = False

    def __init__(self, fabric: FakeFabric | None = None):
        super().__init__()
        self.fabric = fabric if fabric is not None else FakeFabric()
        self.faults = Faults()
        self._inbox = Inbox()
        self._lock = threading.Lock()  # serializes sends/writes, like tcp's per-peer stream
        self._closed = False

    def start(self, layout: KVLayout, host: str = "127.0.0.1", port: int = 0, advertise: str = "") -> Endpoint:
        if self.endpoint is not None or self._closed:
            raise TransferError("a fake backend starts once; create a new one")
        self.layout = layout
        self.endpoint = {"backend": self.name, "version": self.protocol_version, "ip": "fake",
                         "port": 0, "instance": secrets.token_hex(8)}
        self.endpoint["port"] = self.fabric.attach(self)
        return dict(self.endpoint)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.endpoint is not None:
            self.fabric.detach(self.endpoint["port"])
        self._inbox.close()

    def _target(self, peer: Endpoint) -> "FakeBackend":
        if self._closed or self.endpoint is None:
            raise TransferError(f"fake backend is {'closed' if self._closed else 'not started'}; "
                                f"cannot reach {peer_name(peer)}")
        self.check_peer(peer)
        if self.faults.delay_s > 0:
            time.sleep(self.faults.delay_s)
        return self.fabric.resolve(self, peer)

    def send(self, peer: Endpoint, msg: dict) -> None:
        data = encode_msg(msg)  # round trip: the receiver gets what the wire would give it
        with self._lock:
            target = self._target(peer)
            if self.faults.take("fail_sends"):
                raise TransferError(f"lost connection to transfer peer {peer_name(peer)}: injected send failure")
            if self.faults.take("lose_sends"):
                return
            target._inbox.put(dict(self.endpoint), decode_msg(data))

    def _copy(self, peer: Endpoint, copies: list[PageCopy]) -> tuple[float, float]:
        with self._lock:
            target = self._target(peer)
            if self.faults.take("fail_writes"):
                raise TransferError(f"lost connection to transfer peer {peer_name(peer)}: injected write failure")
            lay = target.layout
            for c in copies:
                bad = out_of_bounds(lay, c.region, c.dst_offset, c.nbytes)
                if bad:
                    raise TransferError(f"{peer_name(peer)} rejected a write from {peer_name(self.endpoint)}: {bad}")
            started = time.time()
            for c in copies:
                ctypes.memmove(lay.base_ptr + c.dst_offset, self.layout.base_ptr + c.src_offset, c.nbytes)
            return started, time.time()

    def recv(self, timeout: float) -> list[tuple[dict, dict]]:
        return self._inbox.take(timeout)
