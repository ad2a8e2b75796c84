"""DP dispatcher: picks which data-parallel worker rank takes a request item.

Methods (docs/architecture.md, DP-rank rules): round_robin, shortest_queue (fewest requests in flight),
minimum_tokens (fewest prompt + max_new tokens in flight, less the prompt tokens the rank's
prefix cache already held once its worker says so), follow_bootstrap_room
(room % dp_size; round_robin without a room). `auto` is resolved by the server role before
the dispatcher is built. In-flight load is what this front sent and has not seen finish.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..core.errors import BadRequest
from ..core.pd_vocab import LBMethod

__all__ = ["Choice", "DPDispatcher", "LBMethod", "RankLoad"]


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
