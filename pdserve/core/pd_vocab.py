"""The PD vocabulary every layer shares: rooms and ranks, the bootstrap port, the DP
load-balance methods (with `auto` resolved here, once), the two names both legs must agree on
(KV dtype, transfer backend: one enum and one parser each) and the bootstrap protocol's limits.
No I/O; imports nothing but core.errors, so servers, routers and workers can all use it."""

from __future__ import annotations

import enum
from typing import TypeVar

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


class WireName(str, enum.Enum):
    """A name of a closed set that reads as its wire spelling: str(), format() and repr() give the
    value, so a message says 'bfloat16' whether the value came typed or as text."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)

    def __repr__(self) -> str:
        return repr(self.value)


N = TypeVar("N", bound=WireName)


def _member(cls: type[N], name: object, what: str) -> N:
    try:
        return cls(name)
    except ValueError:
        raise ValueError(f"unknown {what} {name!r}; known: {', '.join(sorted(m.value for m in cls))}") from None


class KvDtype(WireName):
    """The dtypes of a KV pool (and of the weights): torch's names without "torch."."""

    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"
    FLOAT32 = "float32"

    @classmethod
    def parse(cls, name: object) -> KvDtype:
        """The dtype `name` spells ("bfloat16", or torch's "torch.bfloat16"); ValueError if unknown."""
        return _member(cls, name.removeprefix("torch.") if isinstance(name, str) else name, "KV cache dtype")


class BackendName(WireName):
    """The transfer backends (transfer/registry.py has their classes)."""

    TCP = "tcp"
    MOONCAKE = "mooncake"
    NIXL = "nixl"
    FAKE = "fake"  # in-process, for tests: no server offers it

    @classmethod
    def parse(cls, name: object) -> BackendName:
        """The backend `name` spells; ValueError naming the known ones if it is none of them."""
        return _member(cls, name, "transfer backend")


KV_DTYPES = tuple(d.value for d in KvDtype)
SERVED_BACKENDS = tuple(b.value for b in BackendName if b is not BackendName.FAKE)  # --transfer-backend


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
