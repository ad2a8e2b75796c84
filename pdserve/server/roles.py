"""What a server front does differently per role (colocated, prefill, decode), behind one ABC,
and the DP dispatcher every role picks a worker rank with.

The request path (front.py's Generator) is the same for every role: it asks the role where each
item goes and what PD parameters the worker gets, and never looks at the role itself.

`DPDispatcher` methods (docs/architecture.md, DP-rank rules): round_robin, shortest_queue
(fewest requests in flight), minimum_tokens (fewest prompt + max_new tokens in flight, less the
prompt tokens the rank's prefix cache already held once its worker says so),
follow_bootstrap_room (room % dp_size; round_robin without a room). `auto` is resolved by the
server role before the dispatcher is built. In-flight load is what this front sent and has not
seen finish.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

from ..core.config import Role, ServerConfig
from ..core.errors import BadRequest
from ..core.messages import PDParams, WorkerReady
from ..core.pd_vocab import LBMethod
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


# ---- the DP dispatcher: which worker rank takes an item


@dataclass
class RankLoad:
    requests: int = 0
    tokens: int = 0


@dataclass(frozen=True)
class Choice:
    dp_rank: int
    reason: str  # e.g. "routed_dp_rank", "round_robin", "follow_bootstrap_room"


class DPDispatcher:
    def __init__(self, dp_size: int, method: LBMethod):
        if dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {dp_size}")
        self.dp_size = dp_size
        self.method = LBMethod(method)
        if self.method is LBMethod.AUTO:
            raise ValueError("resolve load_balance_method 'auto' (LBMethod.resolved) before dispatching")
        self.loads = [RankLoad() for _ in range(dp_size)]
        self._next = 0

    def check_rank(self, rank: int, field: str = "routed_dp_rank") -> int:
        if not 0 <= rank < self.dp_size:
            raise BadRequest(f"{field}={rank} is out of range: this server has dp_size={self.dp_size} "
                             f"(valid ranks 0..{self.dp_size - 1})")
        return rank

    def choose(self, room: int | None, routed_dp_rank: int | None = None) -> Choice:
        """The rank for one item; `routed_dp_rank` overrides the method (out of range -> 400)."""
        if routed_dp_rank is not None:
            return Choice(self.check_rank(routed_dp_rank), "routed_dp_rank")
        if self.method is LBMethod.FOLLOW_BOOTSTRAP_ROOM and room is not None:
            return Choice(room % self.dp_size, "follow_bootstrap_room")
        if self.method is LBMethod.SHORTEST_QUEUE:
            return Choice(self._least(lambda r: (self.loads[r].requests, self.loads[r].tokens)),
                          "shortest_queue")
        if self.method is LBMethod.MINIMUM_TOKENS:
            return Choice(self._least(lambda r: (self.loads[r].tokens, self.loads[r].requests)),
                          "minimum_tokens")
        rank = self._next
        self._next = (self._next + 1) % self.dp_size
        reason = "round_robin" if self.method is LBMethod.ROUND_ROBIN else "round_robin (no bootstrap_room)"
        return Choice(rank, reason)

    def _least(self, key) -> int:
        # ties go to the rank after the last pick, so equal loads still spread
        order = [(self._next + k) % self.dp_size for k in range(self.dp_size)]
        rank = min(order, key=key)
        self._next = (rank + 1) % self.dp_size
        return rank

    def started(self, rank: int, tokens: int) -> None:
        self.loads[rank].requests += 1
        self.loads[rank].tokens += tokens

    def reused(self, rank: int, tokens: int) -> None:
        """Tokens of an item in flight on `rank` that its prefix cache held: they cost nothing."""
        self.loads[rank].tokens = max(0, self.loads[rank].tokens - tokens)

    def finished(self, rank: int, tokens: int) -> None:
        load = self.loads[rank]
        load.requests = max(0, load.requests - 1)
        load.tokens = max(0, load.tokens - tokens)
