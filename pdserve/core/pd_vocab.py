"""The PD vocabulary every layer shares: rooms and ranks, the bootstrap port, the DP
load-balance methods (with `auto` resolved here, once) and the bootstrap protocol's limits.
No I/O; imports nothing but core.errors, so servers, routers and workers can all use it."""

from __future__ import annotations

import enum

from .errors import BadRequest

ROOM_BITS = 63
MAX_ROOM = 1 << ROOM_BITS  # a bootstrap_room lives in [0, 2^63)
DEFAULT_BOOTSTRAP_PORT = 8998  # SGLang's default
MAX_QUERY_ROOMS = 4096  # rooms per POST /query_dp_ranks
FORCE_ENV = "PDSERVE_FORCE_QUERY_PREFILL_DP_RANK"


class LBMethod(str, enum.Enum):
    """SGLang's --load-balance-method values; AUTO is resolved by `resolved()` before use."""

    AUTO = "auto"
    ROUND_ROBIN = "round_robin"
    SHORTEST_QUEUE = "shortest_queue"
    MINIMUM_TOKENS = "minimum_tokens"
    FOLLOW_BOOTSTRAP_ROOM = "follow_bootstrap_room"

    @classmethod
    def parse(cls, method: str) -> "LBMethod":
        try:
            return cls(method)
        except ValueError:
            raise ValueError(f"unknown load_balance_method {method!r}; expected one of "
                             f"{LB_METHODS}") from None

    def resolved(self, prefill: bool) -> "LBMethod":
        """`auto` means follow_bootstrap_room on a prefill server and round_robin elsewhere."""
        if self is not LBMethod.AUTO:
            return self
        return LBMethod.FOLLOW_BOOTSTRAP_ROOM if prefill else LBMethod.ROUND_ROBIN


LB_METHODS = tuple(m.value for m in LBMethod)
FOLLOW = LBMethod.FOLLOW_BOOTSTRAP_ROOM.value


def check_room(room: object, what: str = "bootstrap_room") -> int:
    """Return `room` if it is an int in [0, 2^63), else raise BadRequest naming the value."""
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < MAX_ROOM:
        raise BadRequest(f"{what} must be an integer in [0, 2^63), got {room!r}")
    return room


def check_rank(rank: object, dp_size: int, what: str) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < dp_size:
        raise BadRequest(f"{what} must be an integer in [0, {dp_size}) (dp_size={dp_size}), got {rank!r}")
    return rank


def bootstrap_addr(host: str, port: int | None) -> str:
    """The address key of a bootstrap service ("host:port", IPv6 bracketed); None = the default port."""
    port = DEFAULT_BOOTSTRAP_PORT if port is None else port
    return f"[{host}]:{port}" if ":" in host and not host.startswith("[") else f"{host}:{port}"
