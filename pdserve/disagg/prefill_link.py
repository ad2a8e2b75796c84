"""Decode side: one PrefillLink per decode worker owns everything it knows and asks of the
prefill servers it takes KV from.

Its parts, one job each: PrefillPeers (per address: topology, endpoints, instance, liveness,
dead ranks, load), RankResolver with its QueryBatcher (which rank holds a room, and where it
is), Heartbeat (/health of every address with rooms in flight), and a small pool for the
best-effort notices /fail_room and /drop_room. The receiver hands it the machine's Resolve,
CancelResolve, Invalidate and GiveUp effects (`execute`, never blocking) and gets back typed
events in its inbox: RankResolved, PeerGone, PeerAlive.

A prefill the heartbeat gave up fails new rooms at once with the reason it already has (after
one /health retry, GONE_RECHECK_S, in case it came back); one never reached yet is retried until
the topology deadline, since servers may start in any order (PrefillPeers.topology).
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from ..core.errors import PDServeError
from ..core.pd_settings import PDSettings
from .bootstrap_client import BootstrapClient
from .decode_events import CancelResolve, GiveUp, Invalidate, RankResolved, Resolve, Resolved
from .handoff import Event
from .heartbeat import Heartbeat
from .link_api import Inbox, LinkEffect, PeerLink
from .prefill_peers import PrefillPeer, PrefillPeers
from .rank_resolver import RankResolver

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LinkSettings:
    """The link's deadlines and switches (PDSERVE_* envs, some also flags; docs/architecture.md)."""

    topology_timeout: float = 10.0  # fetching a prefill's topology (and each bootstrap call)
    query_timeout: float = 30.0  # the /query_dp_ranks path, per room
    heartbeat_interval: float = 5.0
    heartbeat_max_failures: int = 2
    decode_force: bool = False  # never trust room % dp: always query (FORCE on this decode)
    bootstrap_token: str = ""
    resolve_threads: int = 4
    notice_threads: int = 2

    @classmethod
    def of(cls, pd: PDSettings) -> LinkSettings:
        """A decode worker's settings, from its server's."""
        return cls(topology_timeout=pd.topology_timeout, query_timeout=pd.query_timeout,
                   heartbeat_interval=pd.heartbeat_interval, heartbeat_max_failures=pd.heartbeat_max_failures,
                   decode_force=pd.force_query, bootstrap_token=pd.bootstrap_token)


class PrefillLink(PeerLink):
    """A decode worker's link to its prefill servers (see the module docstring). `client`
    defaults to a BootstrapClient of the settings; the link closes it."""

    def __init__(self, settings: LinkSettings, client: BootstrapClient | None = None):
        super().__init__()
        self.settings = settings
        self.client = client or BootstrapClient(timeout=settings.topology_timeout, token=settings.bootstrap_token)
        self.peers = PrefillPeers(self.client)
        self.resolver = RankResolver(self.peers, decode_force=settings.decode_force,
                                     topology_timeout=settings.topology_timeout,
                                     query_timeout=settings.query_timeout, on_result=self._resolved,
                                     threads=settings.resolve_threads,
                                     revalidate_after=settings.heartbeat_interval)
        self.notices = ThreadPoolExecutor(settings.notice_threads, thread_name_prefix="pd-link-notice")
        self.heartbeat: Heartbeat | None = None  # started by bind(): it posts into the inbox
        self._inbox: Inbox | None = None

    # ---- PeerLink -------------------------------------------------------------------------
    def bind(self, inbox: Inbox) -> None:
        if self._inbox is not None:
            raise RuntimeError("a PrefillLink serves one receiver")
        self._inbox = inbox
        s = self.settings
        self.heartbeat = Heartbeat(self.peers, interval=s.heartbeat_interval,
                                   max_failures=s.heartbeat_max_failures, watched=self.watched, post=self._post)

    def execute(self, effect: LinkEffect) -> None:
        if isinstance(effect, Resolve):
            self.resolver.resolve(effect.addr, effect.room, effect.hint)
        elif isinstance(effect, CancelResolve):
            self.resolver.cancel(effect.addr, effect.room)
        elif isinstance(effect, Invalidate):
            self.peers.invalidate(effect.addr)
        elif isinstance(effect, GiveUp):
            self._notice("tell it that this decode gave the room up", self.client.fail_room,
                         effect.addr, effect.room, effect.reason)
        else:
            raise TypeError(f"not an effect for the prefill link: {effect!r}")

    # ---- what a decode role asks directly ---------------------------------------------------
    def drop_room(self, addr: str, room: int, reason: str) -> None:
        """Tell prefill `addr` that this decode prefilled `room` itself (/drop_room), in the
        background: without it the prefill computes the room and holds it to its deadline."""
        self._notice("tell it to drop the room", self.client.drop_room, addr, room, reason)

    def load_tokens(self, addr: str) -> int | None:
        """Prompt tokens prefill `addr` last reported in flight (None: never heard)."""
        return self.peers.load_tokens(addr)

    def snapshot(self, addr: str) -> PrefillPeer:
        """A copy of what the link knows of `addr`."""
        return self.peers.snapshot(addr)

    def close(self) -> None:
        """Stop the heartbeat, the resolution and notice threads, and the HTTP client."""
        if self.heartbeat is not None:
            self.heartbeat.close()
        self.resolver.close()
        self.notices.shutdown(wait=False, cancel_futures=True)
        self.client.close()

    # ---- inside -------------------------------------------------------------------------------
    def _post(self, ev: Event) -> None:
        if self._inbox is None:
            raise RuntimeError("PrefillLink.bind was never called")
        self._inbox.post(ev)

    def _resolved(self, r: Resolved) -> None:
        self._post(RankResolved(r))

    def _notice(self, what: str, call: Callable[[str, int, str], None], addr: str, room: int,
                reason: str) -> None:
        def send() -> None:
            try:
                call(addr, room, reason)
            except PDServeError as e:
                log.warning("room %d: could not reach prefill %s to %s: %s", room, addr, what, e,
                            extra={"room": room})
        try:
            self.notices.submit(send)
        except RuntimeError:  # closed: the prefill's own deadline ends the room
            pass

