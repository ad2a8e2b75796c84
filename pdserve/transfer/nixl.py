"""The nixl backend: page runs go straight into the peer's registered KV memory as NIXL WRITEs
(UCX underneath: cross-memory attach or shared memory on one host, TCP or RDMA across hosts);
control messages ride a small tcp-wire channel of their own, as with mooncake.

Each endpoint creates one NIXL agent named after its instance, registers its KV pool with it and
publishes the agent's metadata (base64) in its descriptor: the bootstrap registration carries a
prefill rank's to decodes, every kv_req carries a decode's to the prefill that writes to it. A
writer loads a peer's metadata once per peer instance; NIXL then refuses, before any byte moves,
a descriptor outside the memory that peer registered.

Completion is NIXL's notification. Every write is one WRITE transfer whose notification names
its sequence number; a control message names the writes to that peer that completed before it
was sent, and the receiver holds it until those notifications arrived (NIXL sends one only after
its transfer's bytes), so a message issued after a write sees the pages whatever transport moved
them. A notification missing for io_timeout drops that message and every later one from that
sender, with an error in the log naming both endpoints (nixl_gate.py; nixl_agent.py loads NIXL
and builds the agents).
"""

from __future__ import annotations

import base64
import binascii
import logging
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import numpy as np

from ..core.kv_layout import KVLayout
from ..core.pd_vocab import BackendName
from .base import Endpoint, PageCopy, TransferBackend, TransferError, peer_name
from .nixl_agent import import_api, import_problem, new_agent  # noqa: F401 - import_problem is this backend's probe
from .nixl_gate import NotifGate, notif_for
from .tcp import TcpBackend

log = logging.getLogger(__name__)

PLUGINS = ("UCX",)
MEM = "DRAM"
HOLD_POLL_S = 0.0005  # how often recv() looks for notifications while a message waits for one


def _pool_spans(layout: KVLayout) -> list[tuple[int, int]]:
    """(address, bytes) of each region's pages, adjacent regions merged: what gets registered."""
    spans: list[tuple[int, int]] = []
    size = layout.num_pages * layout.page_bytes
    for r in range(layout.num_regions if size else 0):
        addr = layout.base_ptr + r * layout.region_stride
        if spans and spans[-1][0] + spans[-1][1] == addr:
            spans[-1] = (spans[-1][0], spans[-1][1] + size)
        else:
            spans.append((addr, size))
    return spans


def _descs(base: int, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """An Nx3 (address, length, device 0) descriptor array."""
    out = np.zeros((len(sizes), 3), dtype=np.uint64)
    out[:, 0] = offsets + np.uint64(base)
    out[:, 1] = sizes
    return out


class _ControlChannel(TcpBackend):
    """The tcp backend's ordered message path under the nixl name, over a pool of no pages:
    a tcp endpoint is refused at its hello, and no page write can land through it."""

    name = BackendName.NIXL

    def publish(self, extra: dict) -> dict:
        """Add the agent's fields to this endpoint's descriptor, which hellos carry to peers."""
        self.endpoint = {**self.endpoint, **extra}
        return dict(self.endpoint)

    def ensure_connected(self, peer: Endpoint) -> None:
        """Connect to `peer` now if not yet connected: its hello answer checks backend, version
        and instance, and an error it reported on this channel is raised here."""
        self._on_conn(peer, lambda sock: None)


@dataclass
class _PeerOut:
    """What a writer keeps per peer agent: write numbers, and the completed ones no message named."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    next_seq: int = 0
    done: list[int] = field(default_factory=list)


class NixlBackend(TransferBackend):
    """One NIXL agent for page bytes, a _ControlChannel for messages.

    The descriptor is the control channel's (backend, version, ip, port, instance) plus `agent`
    (the NIXL agent's name), `agent_metadata` (its metadata, base64), `base_ptr` (the registered
    pool's address) and `plugins` (NIXL backends in use; both sides must agree). NIXL failures
    raise TransferError naming the peer and NIXL's error.
    """

    name = BackendName.NIXL

    def __init__(self, connect_timeout: float = 5.0, io_timeout: float = 60.0,
                 plugins: tuple[str, ...] = PLUGINS):
        super().__init__()
        self.io_timeout = io_timeout
        self.plugins = tuple(plugins)
        self._api = import_api()
        self._ctl = _ControlChannel(connect_timeout=connect_timeout, io_timeout=io_timeout)
        self._agent = None
        self._reg = None  # the registered descriptor list, for deregistration
        self._lock = threading.Condition()  # guards everything below; notified when _busy drops
        self._busy = 0  # calls using the agent right now; close() waits for them
        self._closed = False
        self._remotes: dict[tuple, str] = {}  # (ip, port) of a peer -> its agent whose metadata is loaded
        self._out: dict[str, _PeerOut] = {}  # by peer agent
        self._gate: NotifGate | None = None  # holds received messages until their writes' notifications
        self._kept_agent = None  # an agent close() could not tear down safely (a call stuck inside NIXL)

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self, layout: KVLayout, host: str = "127.0.0.1", port: int = 0, advertise: str = "") -> Endpoint:
        with self._lock:
            if self.endpoint is not None or self._closed or self._agent is not None:
                raise TransferError("a nixl backend starts once; create a new one")
            ctl_ep = self._ctl.start(replace(layout, num_pages=0, num_regions=0, region_stride=0), host, port,
                                     advertise)
            agent_name = f"pdserve-{ctl_ep['instance']}"
            try:
                agent = new_agent(self._api, agent_name, self.plugins)
                spans = _pool_spans(layout)
                try:
                    reg = agent.register_memory([(a, n, 0, "") for a, n in spans], MEM) if spans else None
                    metadata = agent.get_agent_metadata()
                except Exception as e:
                    raise TransferError(f"NIXL agent {agent_name} could not register the KV pool "
                                        f"({layout.total_bytes} bytes at {layout.base_ptr:#x}, {len(spans)} "
                                        f"span(s)): {type(e).__name__}: {e}") from None
            except BaseException:
                self._ctl.close()
                raise
            self._agent, self._reg, self.layout = agent, reg, layout
            self.endpoint = self._ctl.publish({
                "agent": agent_name, "agent_metadata": base64.b64encode(metadata).decode("ascii"),
                "base_ptr": layout.base_ptr, "plugins": list(self.plugins)})
            self._gate = NotifGate(self.io_timeout, peer_name(self.endpoint), peer_name)
            return dict(self.endpoint)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._ctl.close()  # wakes a write stuck connecting and every recv()
        with self._lock:
            deadline = time.monotonic() + 15.0  # a write notices _closed within one poll
            while self._busy and time.monotonic() < deadline:
                self._lock.wait(deadline - time.monotonic())
            agent, self._agent = self._agent, None
            busy, remotes = self._busy, list(self._remotes.values())
            self._remotes.clear()
            self._out.clear()
        if agent is None:
            return
        if busy:
            # tearing the agent down under a running transfer can crash the process: keep it
            log.error("nixl %s: %d call(s) still inside NIXL after 15s; its agent and registered "
                      "memory stay until the process exits", peer_name(self.endpoint), busy)
            self._kept_agent = agent
            return
        for name in remotes:
            self._quietly(agent.remove_remote_agent, name)
        if self._reg is not None:
            self._quietly(agent.deregister_memory, self._reg)
        self._reg = None
        del agent  # its destructor stops the progress thread and closes UCX

    @staticmethod
    def _quietly(fn, *args) -> None:
        try:
            fn(*args)
        except Exception as e:
            log.warning("nixl clean-up %s failed: %s: %s", getattr(fn, "__name__", fn), type(e).__name__, e)

    @contextmanager
    def _using_agent(self, peer: Endpoint | None):
        """The live agent, kept alive for the block; TransferError (or None when peer is None,
        for recv) once closed."""
        with self._lock:
            agent = self._agent
            if agent is None or self._closed:
                if peer is None:
                    yield None
                    return
                state = "closed" if self._closed else "not started"
                raise TransferError(f"nixl backend is {state}; cannot reach {peer_name(peer)}")
            self._busy += 1
        try:
            yield agent
        finally:
            with self._lock:
                self._busy -= 1
                self._lock.notify_all()

    # -- peers ---------------------------------------------------------------------------------
    def check_peer(self, peer: Endpoint) -> None:
        super().check_peer(peer)
        if (not isinstance(peer.get("agent"), str) or not isinstance(peer.get("agent_metadata"), str)
                or not isinstance(peer.get("base_ptr"), int)):
            raise TransferError(f"bad nixl peer descriptor from {peer_name(peer)}: needs agent (str), "
                                "agent_metadata (str) and base_ptr (int)")
        if list(peer.get("plugins") or []) != list(self.plugins):
            raise TransferError(f"transfer peer {peer_name(peer)} uses NIXL plugins {peer.get('plugins')}, "
                                f"this endpoint uses {list(self.plugins)}")

    def _peer_out(self, agent_name: str) -> _PeerOut:
        with self._lock:
            return self._out.setdefault(agent_name, _PeerOut())

    def _load_remote(self, agent, peer: Endpoint) -> str:
        """The peer's agent name, its metadata loaded into ours (once per peer instance)."""
        key, want = (peer["ip"], peer["port"]), peer["agent"]
        with self._lock:
            if self._remotes.get(key) == want:
                return want
            try:
                metadata = base64.b64decode(peer["agent_metadata"], validate=True)
            except (binascii.Error, ValueError) as e:
                raise TransferError(f"bad nixl peer descriptor from {peer_name(peer)}: agent_metadata "
                                    f"is not base64 ({e})") from None
            try:
                got = agent.add_remote_agent(metadata)
            except Exception as e:
                raise TransferError(f"NIXL could not load the metadata of transfer peer {peer_name(peer)} "
                                    f"(agent {want}): {type(e).__name__}: {e}") from None
            got = got.decode() if isinstance(got, bytes) else str(got)
            if got != want:
                if got not in self._remotes.values():  # not a peer we already write to
                    self._quietly(agent.remove_remote_agent, got)
                raise TransferError(f"transfer peer {peer_name(peer)} names agent {want} but its "
                                    f"metadata is agent {got}'s")
            old = self._remotes.get(key)
            self._remotes[key] = want
            if old is not None:  # the peer restarted on the same address
                self._out.pop(old, None)
                self._quietly(agent.remove_remote_agent, old)
            return want

    # -- data ----------------------------------------------------------------------------------
    def _copy(self, peer: Endpoint, copies: list[PageCopy]) -> tuple[float, float]:
        with self._using_agent(peer) as agent:
            # before any byte moves: the peer answers our hello as the instance we were given
            self._ctl.ensure_connected(peer)
            remote = self._load_remote(agent, peer)
            out = self._peer_out(remote)
            if not copies:
                now = time.time()
                return now, now
            runs = np.array([c[1:] for c in copies], dtype=np.uint64)  # src_offset, dst_offset, nbytes
            with out.lock:
                seq, out.next_seq = out.next_seq, out.next_seq + 1
            what = f"NIXL WRITE #{seq} of {len(copies)} runs ({int(runs[:, 2].sum())} bytes) to {peer_name(peer)}"
            started = time.time()
            try:
                handle = agent.initialize_xfer(
                    "WRITE", agent.get_xfer_descs(_descs(self.layout.base_ptr, runs[:, 0], runs[:, 2]), MEM),
                    agent.get_xfer_descs(_descs(peer["base_ptr"], runs[:, 1], runs[:, 2]), MEM),
                    remote, notif_for(seq))
            except Exception as e:
                if type(e).__name__ == "nixlNotFoundError":
                    raise TransferError(f"{what} refused: outside the KV pool the peer registered with NIXL "
                                        f"({type(e).__name__})") from None
                raise TransferError(f"{what} could not be prepared: {type(e).__name__}: {e}") from None
            try:
                self._wait(agent, handle, what)
            finally:
                self._quietly(agent.release_xfer_handle, handle)
            finished = time.time()
            with out.lock:
                out.done.append(seq)
            return started, finished

    def _wait(self, agent, handle, what: str) -> None:
        """Post the transfer and poll it to DONE; TransferError on ERR, close or io_timeout."""
        deadline = time.monotonic() + self.io_timeout
        try:
            state, polls = agent.transfer(handle), 0
            while state == "PROC":
                if self._closed:
                    raise TransferError(f"{what}: the backend closed during the write")
                if time.monotonic() > deadline:
                    raise TransferError(f"{what} did not complete within {self.io_timeout}s")
                time.sleep(0 if polls < 100 else 0.0002)  # yield first; sleep once it is not quick
                polls += 1
                state = agent.check_xfer_state(handle)
        except TransferError:
            raise
        except Exception as e:  # e.g. nixlRemoteDisconnectError: the peer went away
            raise TransferError(f"{what} failed: {type(e).__name__}: {e}") from None
        if state != "DONE":
            raise TransferError(f"{what} failed (NIXL state {state})")

    # -- messages ------------------------------------------------------------------------------
    def send(self, peer: Endpoint, msg: dict) -> None:
        self.check_peer(peer)
        if not isinstance(msg, dict):
            raise TransferError(f"control message must be a dict, got {type(msg).__name__}")
        with self._using_agent(peer):
            out = self._peer_out(peer["agent"])
            with out.lock:  # the writes it names and its place on the wire are one step
                done, out.done = out.done, []
                try:
                    self._ctl.send(peer, {"w": done, "m": msg})
                except TransferError:
                    out.done = done + out.done
                    raise

    def recv(self, timeout: float) -> list[tuple[dict, dict]]:
        if self._gate is None:
            return []
        deadline, wait = time.monotonic() + max(timeout, 0.0), 0.0  # first take what is queued now
        while True:
            for sender, wrapped in self._ctl.recv(wait):
                self._gate.hold(sender, wrapped, time.monotonic())
            ready, waiting = self._gate.release(self._new_notifs(), time.monotonic())
            if ready:
                return ready
            left = deadline - time.monotonic()
            if left <= 0 or self._closed:
                return []
            wait = min(left, HOLD_POLL_S) if waiting else left

    def _new_notifs(self) -> dict[str, list[bytes]]:
        """NIXL notifications received since the last call ({} once closed)."""
        with self._using_agent(None) as agent:
            if agent is None:
                return {}
            try:
                return agent.get_new_notifs()
            except Exception as e:
                log.warning("nixl %s: reading notifications failed: %s: %s", peer_name(self.endpoint),
                            type(e).__name__, e)
                return {}
