"""The DP-rank rules of DESIGN section 4 as pure functions: which prefill rank takes a PD request,
and how a decode worker finds the prefill rank that holds a room. No I/O, no state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.config import LB_METHODS, Role
from ..core.errors import BadRequest

if TYPE_CHECKING:
    from .bootstrap_table import Topology

FOLLOW = "follow_bootstrap_room"
MAX_ROOM = 1 << 63  # rooms live in [0, 2^63)
FORCE_ENV = "PDSERVE_FORCE_QUERY_PREFILL_DP_RANK"


def check_room(room: object, what: str = "bootstrap_room") -> int:
    """Return `room` if it is an int in [0, 2^63), else raise BadRequest naming the value."""
    if isinstance(room, bool) or not isinstance(room, int) or not 0 <= room < MAX_ROOM:
        raise BadRequest(f"{what} must be an integer in [0, 2^63), got {room!r}")
    return room


def check_rank(rank: object, dp_size: int, what: str) -> int:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < dp_size:
        raise BadRequest(f"{what} must be an integer in [0, {dp_size}) (dp_size={dp_size}), got {rank!r}")
    return rank


def effective_method(method: str, role: Role | str) -> str:
    """Resolve `auto`: follow_bootstrap_room on a prefill server, round_robin elsewhere."""
    if method not in LB_METHODS:
        raise ValueError(f"unknown load_balance_method {method!r}; expected one of {LB_METHODS}")
    if method != "auto":
        return method
    return FOLLOW if Role(role) is Role.PREFILL else "round_robin"


def conflict_message(routed: int, room: int, dp_size: int) -> str:
    return (f"follow_bootstrap_room conflict: dispatched to dp_rank {routed} but bootstrap_room "
            f"{room} implies dp_rank {room % dp_size}. Set {FORCE_ENV}=1 on the prefill server "
            f"or pass disagg_prefill_dp_rank to allow mixed routing.")


@dataclass(frozen=True)
class PrefillDecision:
    """Where a prefill front sends a PD request.

    `record`: store (room, rank) in the bootstrap table. `failed_reason`: reject the request
    with this message and record the room as failed. `path` names the rule that decided:
    hint | single | method | fast | force | conflict.
    """

    rank: int
    record: bool
    failed_reason: str | None
    path: str


def decide_prefill_rank(*, dp_size: int, method: str, room: int, routed_dp_rank: int | None,
                        prefill_dp_rank_hint: int | None, force: bool,
                        balanced_rank: int) -> PrefillDecision:
    """Apply the prefill table of DESIGN section 4 to one PD request (one room).

    `method` is already effective (no `auto`); `balanced_rank` is what the method would pick
    (room % dp_size for follow_bootstrap_room). Bad ranks or a routed/hint mismatch raise BadRequest.
    A pinned request is recorded too (unlike the seed): it costs a dict insert and lets a decode
    that did not get the hint find the room by query.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    check_room(room)
    if routed_dp_rank is not None:
        check_rank(routed_dp_rank, dp_size, "routed_dp_rank")
    if prefill_dp_rank_hint is not None:
        check_rank(prefill_dp_rank_hint, dp_size, "disagg_prefill_dp_rank")
        if routed_dp_rank is not None and routed_dp_rank != prefill_dp_rank_hint:
            raise BadRequest(
                f"routed_dp_rank {routed_dp_rank} differs from disagg_prefill_dp_rank "
                f"{prefill_dp_rank_hint} for bootstrap_room {room}: on a prefill server both name "
                f"the rank that holds the KV")
        return PrefillDecision(prefill_dp_rank_hint, True, None, "hint")
    if dp_size == 1:
        return PrefillDecision(0, False, None, "single")
    if not 0 <= balanced_rank < dp_size:
        raise ValueError(f"balanced_rank {balanced_rank} out of range for dp_size {dp_size}")
    rank = routed_dp_rank if routed_dp_rank is not None else balanced_rank
    if method != FOLLOW:
        return PrefillDecision(rank, True, None, "method")
    if rank == room % dp_size:
        return PrefillDecision(rank, True, None, "fast")
    if force:
        return PrefillDecision(rank, True, None, "force")
    return PrefillDecision(rank, False, conflict_message(rank, room, dp_size), "conflict")


@dataclass(frozen=True)
class Resolution:
    """How a decode worker finds a room's prefill rank.

    `rank` is None when it must query the bootstrap service. `path`: hint | single | fast | query.
    """

    rank: int | None
    path: str


def resolve_prefill_rank(*, topology: "Topology | None", hint: int | None, room: int,
                         decode_force: bool) -> Resolution:
    """Steps 2-5 of DESIGN section 4's decode resolution (step 1, fetching `topology`, is the
    caller's; None means it is not known, which leaves only the hint or a query)."""
    check_room(room)
    if hint is not None:
        if topology is not None:
            check_rank(hint, topology.dp_size, f"disagg_prefill_dp_rank (bootstrap_room {room})")
        elif isinstance(hint, bool) or not isinstance(hint, int) or hint < 0:
            raise BadRequest(f"disagg_prefill_dp_rank must be a non-negative integer, got {hint!r}")
        return Resolution(hint, "hint")
    if topology is None:
        return Resolution(None, "query")
    if topology.dp_size == 1:
        return Resolution(0, "single")
    if topology.follow_bootstrap_room and not topology.force_query_dp_rank and not decode_force:
        return Resolution(room % topology.dp_size, "fast")
    return Resolution(None, "query")
