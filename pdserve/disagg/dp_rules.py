"""The DP-rank rules of docs/architecture.md as pure functions: which prefill rank takes a PD request,
and how a decode worker finds the prefill rank that holds a room. No I/O, no state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.config import Role
from ..core.errors import BadRequest
from ..core.pd_vocab import FOLLOW, FORCE_ENV, LBMethod, check_rank, check_room

if TYPE_CHECKING:
    from .bootstrap_table import Topology

__all__ = ["check_rank", "check_room", "conflict_message", "decide_prefill_rank", "effective_method",
           "resolve_prefill_rank"]


def effective_method(method: str, role: Role | str) -> str:
    """`method` with `auto` resolved for `role` (LBMethod.resolved); ValueError if unknown."""
    return LBMethod.parse(method).resolved(Role(role) is Role.PREFILL).value


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
    """Apply the prefill table of docs/architecture.md (DP-rank rules) to one PD request (one room).

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

    `rank` is None when it must query the bootstrap service. `path`: hint | single | fast |
    forward (send to the room's home rank, which passes the request on to the holder) | query.
    """

    rank: int | None
    path: str


def resolve_prefill_rank(*, topology: "Topology | None", hint: int | None, room: int,
                         decode_force: bool) -> Resolution:
    """The decode's resolution order of docs/architecture.md (DP-rank rules) (step 1, fetching `topology`, is the
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
    if decode_force:
        return Resolution(None, "query")
    if topology.follow_bootstrap_room and not topology.force_query_dp_rank:
        return Resolution(room % topology.dp_size, "fast")
    if topology.forwards_kv_requests:
        return Resolution(room % topology.dp_size, "forward")
    return Resolution(None, "query")
