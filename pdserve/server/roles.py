"""What a server front does differently per role (colocated, prefill, decode), behind one ABC.

The request path (generation.py) is the same for every role: it asks the role where each
item goes and what PD parameters the worker gets, and never looks at the role itself.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

from ..core.config import Role, ServerConfig
from ..core.messages import PDParams, WorkerReady
from .dispatcher import DPDispatcher, LBMethod
from .protocol import RequestItem


@dataclass(frozen=True)
class Dispatch:
    """Where one item goes: the DP rank, why (for logs and timelines), and its PD parameters;
    `health_check`: the front's own /health_generate probe (each role's worker runs it alone)."""

    dp_rank: int
    reason: str
    pd: PDParams | None = None
    health_check: bool = False


@dataclass(frozen=True)
class RoleContext:
    """What a role gets at start: every rank's WorkerReady (rank order) and a way to send a
    core.messages object to one rank (False if it could not be queued)."""

    workers: list[WorkerReady]
    send_to_worker: Callable[[int, object], bool]


class FrontRole(ABC):
    """A server role as seen by the HTTP front.

    Contract:
    - `--load-balance-method auto` means follow_bootstrap_room on a prefill and round_robin
      elsewhere (LBMethod.resolved).
    - `dispatch(item, dispatcher)` runs once per request item, before anything is sent to a
      worker, on the event loop (no blocking). It returns a `Dispatch` or raises a PDServeError
      (BadRequest for bad or conflicting PD fields); on error nothing of the request is sent.
      It may record state (e.g. a prefill's bootstrap table) but must not start work.
    - `server_info()` returns extra fields merged into /server_info.
    - `before_workers()` runs before any worker process starts (e.g. the bootstrap service the
      workers register with); `start(ctx)` after every worker is ready and before the first
      request; `stop()` once at shutdown if `before_workers` ran, before the workers are
      stopped, and must not raise. Each has its own deadlines.
    """

    role: Role

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg

    @property
    def disaggregation_mode(self) -> str | None:
        return None if self.role is Role.COLOCATED else self.role.value

    def lb_method(self) -> LBMethod:
        m = self.cfg.load_balance_method
        return LBMethod.parse(m).resolved(self.role is Role.PREFILL)

    @abstractmethod
    def dispatch(self, item: RequestItem, dispatcher: DPDispatcher) -> Dispatch:
        ...

    def server_info(self) -> dict:
        return {}

    def worker_gone(self, rank: int, reason: str) -> None:
        """A DP worker process of this server died (the front keeps serving the others)."""

    def rejected(self, items: list[RequestItem], error: BaseException) -> None:
        """The request was refused before reaching any worker (bad input, conflict)."""

    def released(self, rid: str, dispatch: Dispatch, ok: bool) -> None:
        """An item that `dispatch` accepted ended (`ok`: it finished without an error)."""

    async def before_workers(self) -> None:
        pass

    async def start(self, ctx: RoleContext) -> None:
        pass

    async def stop(self) -> None:
        pass


class ColocatedRole(FrontRole):
    """Each worker prefills and decodes itself; PD fields are accepted and ignored."""

    role = Role.COLOCATED

    def dispatch(self, item: RequestItem, dispatcher: DPDispatcher) -> Dispatch:
        choice = dispatcher.choose(item.pd.bootstrap_room, item.routed_dp_rank)
        return Dispatch(choice.dp_rank, choice.reason, None)
