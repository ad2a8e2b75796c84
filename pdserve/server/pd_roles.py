"""The prefill and decode roles of a server front (DESIGN sections 2-4).

Prefill: runs the bootstrap service and applies the prefill DP-rank rules where the rank is
chosen: every PD room is recorded in the bootstrap table; a follow_bootstrap_room conflict is
rejected at once, recorded as failed, and the worker the room implies is told, so a decode
that contacts it or queries the room fails at once with the same message.
Decode: requires the PD fields and dispatches by its own method.
"""

from __future__ import annotations

import logging

from ..core.config import Role, ServerConfig
from ..core.envs import Envs
from ..core.errors import BadRequest
from ..core.messages import PDParams, RoomFailedNotice
from ..disagg.bootstrap_server import start_bootstrap_server
from ..disagg.bootstrap_table import BootstrapTable
from ..core.pd_vocab import check_room
from ..disagg.dp_rules import decide_prefill_rank
from .dispatcher import DPDispatcher, LBMethod
from .protocol import RequestItem
from .roles import Dispatch, FrontRole, RoleContext

log = logging.getLogger(__name__)


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
        envs = envs or Envs.read()
        self.force = cfg.force_query_prefill_dp_rank or envs.force_query_prefill_dp_rank
        self.token = cfg.bootstrap_token or envs.bootstrap_token  # guards PUT /route, /register_dp_rank
        self.table = BootstrapTable(dp_size=cfg.dp_size, force_query_dp_rank=self.force,
                                    ttl=envs.room_ttl)
        self.bootstrap = None
        self.notify = lambda rank, msg: False

    async def start(self, ctx: RoleContext) -> None:
        self.notify = ctx.send_to_worker  # RoomFailedNotice to the rank a rejected room implies

    async def before_workers(self) -> None:
        self.bootstrap = await start_bootstrap_server(self.table, self.cfg.host, self.cfg.bootstrap_port,
                                                      token=self.token, on_room_failed=self.fail_room)
        log.info("bootstrap service on %s:%d", self.cfg.host, self.bootstrap.port)
        if not self.token and self.cfg.host not in ("127.0.0.1", "localhost", "::1"):
            log.warning("bootstrap service on %s without --bootstrap-token: anyone who reaches it can "
                        "register a prefill rank or record rooms", self.cfg.host)

    def dispatch(self, item: RequestItem, dispatcher: DPDispatcher) -> Dispatch:
        pd = _pd_params(item, "prefill")
        dp = self.cfg.dp_size
        if pd.prefill_dp_rank is not None:
            dispatcher.check_rank(pd.prefill_dp_rank, "disagg_prefill_dp_rank")
        if item.routed_dp_rank is not None:
            dispatcher.check_rank(item.routed_dp_rank)
        balanced = pd.bootstrap_room % dp if dispatcher.method is LBMethod.FOLLOW_BOOTSTRAP_ROOM \
            else dispatcher.choose(pd.bootstrap_room).dp_rank
        d = decide_prefill_rank(dp_size=dp, method=dispatcher.method.value, room=pd.bootstrap_room,
                                routed_dp_rank=item.routed_dp_rank,
                                prefill_dp_rank_hint=pd.prefill_dp_rank, force=self.force,
                                balanced_rank=balanced)
        if d.failed_reason is not None:  # rejected(): recorded as failed, workers told
            log.warning("room %d rejected: %s", pd.bootstrap_room, d.failed_reason)
            raise BadRequest(d.failed_reason)
        if d.record:
            self.table.record(pd.bootstrap_room, d.rank)
        return Dispatch(d.rank, d.path, pd)

    def rejected(self, items: list[RequestItem], error: BaseException) -> None:
        """A refused PD item fails its room everywhere a decode may look, so the decode leg
        ends at once with the same reason instead of waiting for a deadline."""
        reason = getattr(error, "message", None) or str(error)
        for it in items:
            room = it.pd.bootstrap_room
            if not isinstance(room, int) or isinstance(room, bool) or not 0 <= room < 1 << 63:
                continue
            self._fail_everywhere(room, reason)  # dispatch() logged it

    def fail_room(self, room: int, reason: str) -> None:
        """POST /fail_room: a decode gave `room` up."""
        log.warning("room %d failed: %s", room, reason)
        self._fail_everywhere(room, reason)

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
        envs = envs or Envs.read()
        self.force = cfg.force_query_prefill_dp_rank or envs.force_query_prefill_dp_rank

    def dispatch(self, item: RequestItem, dispatcher: DPDispatcher) -> Dispatch:
        pd = _pd_params(item, "decode")
        choice = dispatcher.choose(pd.bootstrap_room, item.routed_dp_rank)
        return Dispatch(choice.dp_rank, choice.reason, pd)

    def server_info(self) -> dict:
        return {"force_query_prefill_dp_rank": self.force}
