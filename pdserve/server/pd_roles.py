"""The prefill and decode roles of a server front (docs/architecture.md: life of one PD request, DP-rank rules).

Prefill: runs the bootstrap service and applies the prefill DP-rank rules where the rank is
chosen: every PD room is recorded in the bootstrap table; a follow_bootstrap_room conflict is
rejected at once, recorded as failed, and the worker the room implies is told, so a decode
that contacts it or queries the room fails at once with the same message.
Decode: requires the PD fields and dispatches by its own method.
"""

from __future__ import annotations

import asyncio
import logging

from ..core.config import Role, ServerConfig
from ..core.envs import Envs
from ..core.errors import BadRequest, PDServeError
from ..core.messages import PDParams, RoomDroppedNotice, RoomFailedNotice, RoomRoutedNotice
from ..core.netaddr import check_reachable, host_port, is_loopback
from ..core.pd_settings import PDSettings
from ..core.pd_vocab import MAX_ROOM, LBMethod, check_room
from ..disagg.bootstrap_server import start_bootstrap_server
from ..disagg.bootstrap_table import BootstrapTable
from ..disagg.dp_rules import decide_prefill_rank
from .limits import RETRY_AFTER_S, Refused
from .protocol import RequestItem
from .roles import Dispatch, DPDispatcher, FrontRole, RoleContext

log = logging.getLogger(__name__)


class RoomRefused(BadRequest):
    """A PD item refused because of its room (a conflict or a room already in flight)."""

    def __init__(self, room: int, message: str):
        super().__init__(message)
        self.room = room


class HeldTokensFull(Refused):
    """429: a prefill rank holds too many prompt tokens for slow decodes (--max-held-prefill-tokens)."""

    admission_refused = "held_tokens"

    def __init__(self, room: int, message: str):
        super().__init__(message)
        self.room = room


def _refuse_live_room(claims: dict[int, tuple[str, int]], room: int, role: str) -> None:
    """Two live requests on one room would take each other's KV: refuse the second."""
    owner = claims.get(room)
    if owner is not None:
        raise RoomRefused(room, f"bootstrap_room {room} is already in flight on this {role} server "
                                f"(request {owner[0]}, dp_rank {owner[1]}): every request needs a "
                                "room of its own")


def _release_claim(claims: dict[int, tuple[str, int]], rid: str, dispatch: Dispatch) -> bool:
    """Drop `rid`'s claim on its room; False if it held none."""
    room = dispatch.pd.bootstrap_room if dispatch.pd is not None else None
    if room is None or claims.get(room, ("",))[0] != rid:
        return False
    del claims[room]
    return True


def _pd_params(item: RequestItem, role: str) -> PDParams:
    pd = item.pd
    if pd.bootstrap_room is None or pd.bootstrap_host is None:
        raise BadRequest(f"a {role} server needs bootstrap_host and bootstrap_room "
                         "(send the request through a PD router)")
    room = check_room(pd.bootstrap_room)
    if pd.prefill_dp_rank is not None and pd.prefill_dp_rank < 0:
        raise BadRequest(f"disagg_prefill_dp_rank={pd.prefill_dp_rank} must be >= 0")
    return PDParams(pd.bootstrap_host, pd.bootstrap_port, room, pd.prefill_dp_rank)


class PrefillFrontRole(FrontRole):
    role = Role.PREFILL

    def __init__(self, cfg: ServerConfig, envs: Envs | None = None):
        super().__init__(cfg)
        self.pd = PDSettings.of(cfg, envs or Envs.read())
        self.force = self.pd.force_query
        self.token = self.pd.bootstrap_token  # guards PUT /route, /register_dp_rank
        self.table = BootstrapTable(dp_size=cfg.dp_size, force_query_dp_rank=self.force,
                                    ttl=self.pd.room_ttl, forwards_kv_requests=True)
        self.bootstrap = None
        self.notify = lambda rank, msg: False
        self.claims: dict[int, tuple[str, int]] = {}  # room -> (rid, dp_rank) of items in flight
        self.claim_tokens: dict[int, int] = {}  # room -> its prompt tokens

    async def start(self, ctx: RoleContext) -> None:
        self.notify = ctx.send_to_worker  # RoomFailedNotice to the rank a rejected room implies

    async def before_workers(self) -> None:
        self.bootstrap = await start_bootstrap_server(self.table, self.cfg.host, self.cfg.bootstrap_port,
                                                      token=self.token, on_room_failed=self.fail_room,
                                                      on_room_dropped=self.drop_room,
                                                      load_tokens=self.load_tokens)
        adv = self.cfg.advertise_host or self.cfg.host
        log.info("bootstrap service on %s, advertised as %s", host_port(self.cfg.host, self.bootstrap.port),
                 host_port(adv, self.bootstrap.port))
        await asyncio.to_thread(check_reachable, adv, self.bootstrap.port, "the bootstrap service")
        if not self.token and not is_loopback(self.cfg.host):
            log.warning("bootstrap service on %s without --bootstrap-token: anyone who reaches it can "
                        "register a prefill rank or record rooms", self.cfg.host)

    def dispatch(self, item: RequestItem, dispatcher: DPDispatcher) -> Dispatch:
        pd = _pd_params(item, "prefill")
        room, dp = pd.bootstrap_room, self.cfg.dp_size
        _refuse_live_room(self.claims, room, "prefill")
        if pd.prefill_dp_rank is not None:
            dispatcher.check_rank(pd.prefill_dp_rank, "disagg_prefill_dp_rank")
        if item.routed_dp_rank is not None:
            dispatcher.check_rank(item.routed_dp_rank)
        balanced = room % dp  # what follow_bootstrap_room picks; other methods ask the dispatcher,
        pinned = item.routed_dp_rank is not None or pd.prefill_dp_rank is not None  # unless pinned
        if dp > 1 and not pinned and dispatcher.method is not LBMethod.FOLLOW_BOOTSTRAP_ROOM:
            balanced = dispatcher.choose(room).dp_rank
        d = decide_prefill_rank(dp_size=dp, method=dispatcher.method.value, room=room,
                                routed_dp_rank=item.routed_dp_rank,
                                prefill_dp_rank_hint=pd.prefill_dp_rank, force=self.force,
                                balanced_rank=balanced)
        if d.failed_reason is not None:  # rejected(): recorded as failed, workers told
            log.warning("room %d rejected: %s", room, d.failed_reason)
            raise RoomRefused(room, d.failed_reason)
        self._check_held(room, d.rank, len(item.input_ids))
        if d.record:
            self.table.record(room, d.rank)
        if d.rank != room % dp:  # a decode that cannot know the rank sends its KV request there
            self._tell_home(room, d.rank)
        self.claims[room] = (item.rid, d.rank)
        self.claim_tokens[room] = len(item.input_ids)
        return Dispatch(d.rank, d.path, pd)

    def held_tokens(self, rank: int) -> int:
        """Prompt tokens of the PD requests in flight on `rank` (their KV is or will be held there)."""
        return sum(self.claim_tokens.get(room, 0) for room, (_, r) in self.claims.items() if r == rank)

    def _check_held(self, room: int, rank: int, tokens: int) -> None:
        """--max-held-prefill-tokens: back-pressure (429) before a rank's pool fills with KV
        waiting for slow decodes; a rank holding nothing takes any prompt, so none starves."""
        limit = self.cfg.max_held_prefill_tokens
        held = self.held_tokens(rank) if limit else 0
        if held and held + tokens > limit:
            raise HeldTokensFull(room, f"prefill dp_rank {rank} holds {held} prompt tokens of PD requests "
                                       f"in flight; bootstrap_room {room} adds {tokens}, over "
                                       f"--max-held-prefill-tokens {limit}: retry after "
                                       f"{RETRY_AFTER_S}s or on another prefill")

    def load_tokens(self) -> int:
        """Prompt tokens of the PD requests in flight here (bootstrap /health reports it)."""
        return sum(self.claim_tokens.values())

    def _tell_home(self, room: int, rank: int) -> None:
        try:
            endpoint = self.table.rank(rank).peer()
        except PDServeError as e:  # not registered or gone: the request to it fails on its own
            log.warning("room %d: cannot tell dp_rank %d where it went: %s", room, room % self.cfg.dp_size,
                        e.message)
            return
        self.notify(room % self.cfg.dp_size, RoomRoutedNotice(room, rank, endpoint))

    def rejected(self, items: list[RequestItem], error: BaseException) -> None:
        """A refused request fails the rooms of its items everywhere a decode may look, so their
        decode legs end at once instead of at a deadline; each item's reason names its own room.
        A room that belongs to another request in flight is left alone."""
        reason = getattr(error, "message", None) or str(error)
        culprit = getattr(error, "room", None)
        for it in items:
            room = it.pd.bootstrap_room
            if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room < MAX_ROOM:
                continue
            owner = self.claims.get(room)
            if owner is not None and owner[0] != it.rid:
                continue  # a duplicate of a live room: refusing this item must not fail that one
            self.claims.pop(room, None)
            self.claim_tokens.pop(room, None)
            if room == culprit or (culprit is None and f"room {room}" in reason):
                why = reason
            elif culprit is None:
                why = f"bootstrap_room {room}: its request was refused: {reason}"
            else:
                why = f"bootstrap_room {room} was refused with another item of its request: {reason}"
            self._fail_everywhere(room, why)  # dispatch() logged it

    def released(self, rid: str, dispatch: Dispatch, ok: bool) -> None:
        """A finished room is no longer in flight here; a successful one is forgotten by the
        bootstrap table now (its decode has its KV), a failed one stays until its TTL so that a
        late query or kv_req for it fails at once."""
        if not _release_claim(self.claims, rid, dispatch):
            return
        self.claim_tokens.pop(dispatch.pd.bootstrap_room, None)  # type: ignore[union-attr]
        if ok:
            self.table.forget(dispatch.pd.bootstrap_room)  # type: ignore[union-attr]

    def fail_room(self, room: int, reason: str) -> None:
        """POST /fail_room: a decode gave `room` up."""
        log.warning("room %d failed: %s", room, reason)
        self._fail_everywhere(room, reason)

    def drop_room(self, room: int, reason: str) -> None:
        """POST /drop_room: the decode prefilled `room` itself. Every worker is told (the request
        may not have arrived yet): the one holding it ends it with a success, moving nothing."""
        log.info("room %d dropped: %s", room, reason)
        self.table.forget(room)
        for rank in range(self.cfg.dp_size):
            self.notify(rank, RoomDroppedNotice(room, reason))

    def _fail_everywhere(self, room: int, reason: str) -> None:
        """Record `room` failed and tell every worker: one holding it ends it (frees its pages),
        the others refuse a later kv_req for it with `reason`."""
        self.table.record_failed(room, reason)
        for rank in range(self.cfg.dp_size):
            self.notify(rank, RoomFailedNotice(room, reason))

    def worker_gone(self, rank: int, reason: str) -> None:
        """A prefill worker died: its bootstrap /health and route say so, and a decode waiting for
        its KV fails at the next heartbeat instead of at its waiting deadline."""
        self.table.mark_rank_gone(rank, reason)

    def server_info(self) -> dict:
        return {"bootstrap_port": self.cfg.bootstrap_port, "force_query_prefill_dp_rank": self.force,
                "bootstrap_rooms": len(self.table), "bootstrap_instance_id": self.table.instance_id}

    async def stop(self) -> None:
        if self.bootstrap is not None:
            await self.bootstrap.stop()
            self.bootstrap = None


class DecodeFrontRole(FrontRole):
    role = Role.DECODE

    def __init__(self, cfg: ServerConfig, envs: Envs | None = None):
        super().__init__(cfg)
        self.pd = PDSettings.of(cfg, envs or Envs.read())
        self.force = self.pd.force_query
        self.claims: dict[int, tuple[str, int]] = {}  # room -> (rid, dp_rank) of items in flight

    def dispatch(self, item: RequestItem, dispatcher: DPDispatcher) -> Dispatch:
        pd = _pd_params(item, "decode")
        _refuse_live_room(self.claims, pd.bootstrap_room, "decode")
        choice = dispatcher.choose(pd.bootstrap_room, item.routed_dp_rank)
        self.claims[pd.bootstrap_room] = (item.rid, choice.dp_rank)
        return Dispatch(choice.dp_rank, choice.reason, pd)

    def rejected(self, items: list[RequestItem], error: BaseException) -> None:
        for it in items:  # claims of this request only: a duplicate's owner stays in flight
            room = it.pd.bootstrap_room
            if room is not None and self.claims.get(room, ("",))[0] == it.rid:
                del self.claims[room]

    def released(self, rid: str, dispatch: Dispatch, ok: bool) -> None:
        _release_claim(self.claims, rid, dispatch)

    def server_info(self) -> dict:
        return {"force_query_prefill_dp_rank": self.force}
