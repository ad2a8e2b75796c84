"""The mooncake backend: page runs go straight into the peer's registered KV memory through
Mooncake's TransferEngine (TCP on one machine, RDMA on clusters); control messages ride a
small tcp-wire channel of their own.

Each endpoint initializes one TransferEngine with P2PHANDSHAKE metadata (peers are named by a
session id "ip:rpc_port", no metadata server), registers its whole KV pool once, and publishes
its session id and pool base address in its descriptor. `_copy` turns the planned runs into
batch_transfer_sync_write calls, which return once the bytes are in the peer's memory, so a
message sent afterwards on the control channel reaches the peer only after them. The peer's
engine refuses a write outside its registered memory; a stalled peer is bounded by the
engine's own progress timeout (MC_TCP_PROGRESS_TIMEOUT_SEC, 30 s by default on TCP).
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

from ..core.kv_layout import KVLayout
from ..core.netaddr import host_port
from ..core.pd_vocab import BackendName
from .base import Endpoint, PageCopy, TransferBackend, TransferError, peer_name
from .tcp import TcpBackend

PROTOCOLS = ("tcp", "rdma")
METADATA = "P2PHANDSHAKE"
MAX_BATCH = 8192  # runs per batch_transfer_sync_write; bigger plans are split, in order
INSTALL_HINT = "pip install 'pdserve[mooncake]' (mooncake-transfer-engine-non-cuda on CPU machines)"


def import_engine_class() -> type:
    """Mooncake's TransferEngine class; TransferError saying what to install when it is missing."""
    try:
        from mooncake.engine import TransferEngine
    except ImportError as e:
        if "libibverbs" in str(e):
            raise TransferError("the mooncake transfer backend needs the system library libibverbs.so.1: "
                                f"apt-get install libibverbs1 ({e})") from None
        if (e.name or "").split(".")[0] == "mooncake":
            raise TransferError(f"the mooncake transfer backend needs Mooncake's transfer engine: "
                                f"{INSTALL_HINT} ({e})") from None
        raise TransferError(f"the mooncake transfer backend cannot import mooncake.engine: {e}") from None
    return TransferEngine


def import_problem() -> str | None:
    """Why the mooncake backend cannot be used on this machine, or None if it can."""
    try:
        import_engine_class()
    except TransferError as e:
        return e.message
    return None


class _ControlChannel(TcpBackend):
    """The tcp backend's ordered message path under the mooncake name, over a pool of no pages:
    a plain tcp endpoint is refused at its hello, and no page write can land through it."""

    name = BackendName.MOONCAKE

    def publish(self, extra: dict) -> dict:
        """Add the engine's fields to this endpoint's descriptor, which hellos carry to peers
        (so a receiver sees the full mooncake descriptor as the sender); before any connection."""
        self.endpoint = {**self.endpoint, **extra}
        return dict(self.endpoint)

    def ensure_connected(self, peer: Endpoint) -> None:
        """Connect to `peer` now if not yet connected: the hello checks its backend, version and
        instance, and an error it reported on this channel is raised here."""
        self._on_conn(peer, lambda sock: None)


class MooncakeBackend(TransferBackend):
    """Mooncake TransferEngine for page bytes, a _ControlChannel for messages.

    The descriptor is the control channel's (backend, version, ip, port, instance) plus
    `session` (the engine's "ip:rpc_port"), `base_ptr` (the registered pool's address) and
    `protocol`. Engine failures (initialize, register_memory, a write's return code < 0)
    raise TransferError carrying the engine's code.
    """

    name = BackendName.MOONCAKE

    def __init__(self, protocol: str = "tcp", device: str = "", connect_timeout: float = 5.0,
                 io_timeout: float = 60.0):
        super().__init__()
        if protocol not in PROTOCOLS:
            raise TransferError(f"mooncake transfer protocol {protocol!r} is not supported; "
                                f"use one of {', '.join(PROTOCOLS)} (PDSERVE_MOONCAKE_PROTOCOL)")
        self.protocol = protocol
        self.device = device  # an RDMA device name such as mlx5_0; "" lets Mooncake choose
        self._engine_class = import_engine_class()
        self._ctl = _ControlChannel(connect_timeout=connect_timeout, io_timeout=io_timeout)
        self._engine = None
        self._lock = threading.Lock()  # guards _engine and _closed
        self._closed = False

    @classmethod
    def env_options(cls, envs) -> dict:
        """Constructor options from the typed env registry (a pdserve.core.envs.Envs)."""
        return {"protocol": envs.mooncake_protocol, "device": envs.mooncake_device}

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, layout: KVLayout, host: str = "127.0.0.1", port: int = 0, advertise: str = "") -> Endpoint:
        with self._lock:
            if self.endpoint is not None or self._closed or self._engine is not None:
                raise TransferError("a mooncake backend starts once; create a new one")
            # no pages behind the control channel: any page write sent to it is refused
            ctl_ep = self._ctl.start(replace(layout, num_pages=0, num_regions=0, region_stride=0), host, port,
                                     advertise)
            try:
                engine = self._init_engine(ctl_ep["ip"], layout)
            except BaseException:
                self._ctl.close()
                raise
            self._engine, self.layout = engine, layout
            self.endpoint = self._ctl.publish({"session": host_port(ctl_ep["ip"], engine.get_rpc_port()),
                                               "base_ptr": layout.base_ptr, "protocol": self.protocol})
            return dict(self.endpoint)

    def _init_engine(self, ip: str, layout: KVLayout):
        engine = self._engine_class()
        rc = engine.initialize(ip, METADATA, self.protocol, self.device)
        if rc != 0:
            raise TransferError(f"mooncake TransferEngine.initialize({ip!r}, {METADATA}, {self.protocol!r}, "
                                f"device {self.device!r}) failed with code {rc}")
        rc = engine.register_memory(layout.base_ptr, layout.total_bytes)
        if rc != 0:
            raise TransferError(f"mooncake TransferEngine.register_memory of the KV pool ({layout.total_bytes} "
                                f"bytes at {layout.base_ptr:#x}, protocol {self.protocol}) failed with code {rc}")
        return engine

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            engine, self._engine = self._engine, None
        self._ctl.close()
        if engine is not None and self.layout is not None:
            engine.unregister_memory(self.layout.base_ptr)
        # the engine's threads stop when its last reference goes: here, or when a write still
        # running on another thread returns
        del engine

    # -- peers ---------------------------------------------------------------------------------
    def check_peer(self, peer: Endpoint) -> None:
        super().check_peer(peer)
        if not isinstance(peer.get("session"), str) or not isinstance(peer.get("base_ptr"), int):
            raise TransferError(f"bad mooncake peer descriptor {peer!r}: needs session (str) and base_ptr (int)")
        if peer.get("protocol") != self.protocol:
            raise TransferError(f"transfer peer {peer_name(peer)} uses mooncake protocol "
                                f"{peer.get('protocol')!r}, this endpoint uses {self.protocol!r} "
                                "(PDSERVE_MOONCAKE_PROTOCOL must match on both sides)")

    def _live_engine(self, peer: Endpoint):
        with self._lock:
            if self._engine is None:
                state = "closed" if self._closed else "not started"
                raise TransferError(f"mooncake backend is {state}; cannot reach {peer_name(peer)}")
            return self._engine

    # -- data and messages ---------------------------------------------------------------------
    def send(self, peer: Endpoint, msg: dict) -> None:
        self.check_peer(peer)
        self._live_engine(peer)
        self._ctl.send(peer, msg)

    def recv(self, timeout: float) -> list[tuple[dict, dict]]:
        return self._ctl.recv(timeout)

    def _copy(self, peer: Endpoint, copies: list[PageCopy]) -> tuple[float, float]:
        engine = self._live_engine(peer)
        # before any byte moves: the peer answers our hello as the instance we were given
        self._ctl.ensure_connected(peer)
        base, peer_base, session = self.layout.base_ptr, peer["base_ptr"], peer["session"]
        started = time.time()
        for i in range(0, len(copies), MAX_BATCH):
            batch = copies[i:i + MAX_BATCH]
            rc = engine.batch_transfer_sync_write(
                session, [base + c.src_offset for c in batch], [peer_base + c.dst_offset for c in batch],
                [c.nbytes for c in batch])
            if rc < 0:
                raise TransferError(
                    f"mooncake batch_transfer_sync_write of {len(batch)} runs "
                    f"({sum(c.nbytes for c in batch)} bytes) to {peer_name(peer)} (session {session}, "
                    f"protocol {self.protocol}) failed with code {rc}")
        return started, time.time()
