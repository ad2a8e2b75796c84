"""docs/architecture.md, DP-rank rules: the prefill dispatch table row by row, and the decode's resolution order."""

from __future__ import annotations

import pytest

from pdserve.core.config import Role
from pdserve.core.errors import BadRequest
from pdserve.disagg.bootstrap_table import Topology
from pdserve.disagg.dp_rules import (
    PrefillDecision,
    Resolution,
    check_room,
    decide_prefill_rank,
    effective_method,
    resolve_prefill_rank,
)

FOLLOW = "follow_bootstrap_room"
ROOM = 1001  # 1001 % 4 == 1


def decide(**kw) -> PrefillDecision:
    args = dict(dp_size=4, method=FOLLOW, room=ROOM, routed_dp_rank=None, prefill_dp_rank_hint=None,
                force=False, balanced_rank=ROOM % 4)
    args.update(kw)
    return decide_prefill_rank(**args)


# ---- prefill table ----
def test_row_pinned_by_hint():
    d = decide(prefill_dp_rank_hint=3)  # 3 != room % 4, still no conflict
    assert (d.rank, d.failed_reason, d.path) == (3, None, "hint")
    assert d.record


def test_row_pinned_hint_equal_to_routed_is_fine():
    assert decide(prefill_dp_rank_hint=2, routed_dp_rank=2).rank == 2


def test_row_pinned_hint_differs_from_routed_is_400():
    with pytest.raises(BadRequest, match="routed_dp_rank 0 differs from disagg_prefill_dp_rank 2"):
        decide(prefill_dp_rank_hint=2, routed_dp_rank=0)


@pytest.mark.parametrize("method", ["round_robin", "shortest_queue", "minimum_tokens"])
def test_row_other_method_dispatches_by_method_and_records(method):
    d = decide(method=method, balanced_rank=2)
    assert d == PrefillDecision(2, True, None, "method")
    d = decide(method=method, balanced_rank=2, routed_dp_rank=0)  # routed overrides the method
    assert d == PrefillDecision(0, True, None, "method")


def test_row_follow_fast_path_records():
    assert decide() == PrefillDecision(1, True, None, "fast")
    assert decide(routed_dp_rank=1) == PrefillDecision(1, True, None, "fast")


def test_row_follow_conflict_with_force_serves_routed_rank():
    assert decide(routed_dp_rank=3, force=True) == PrefillDecision(3, True, None, "force")


def test_row_follow_conflict_without_force_rejects_with_exact_message():
    d = decide(routed_dp_rank=3)
    assert d.path == "conflict" and not d.record and d.rank == 3
    assert d.failed_reason == (
        "follow_bootstrap_room conflict: dispatched to dp_rank 3 but bootstrap_room 1001 implies "
        "dp_rank 1. Set PDSERVE_FORCE_QUERY_PREFILL_DP_RANK=1 on the prefill server or pass "
        "disagg_prefill_dp_rank to allow mixed routing.")


def test_single_rank_is_always_zero():
    assert decide(dp_size=1, balanced_rank=0) == PrefillDecision(0, False, None, "single")
    assert decide(dp_size=1, balanced_rank=0, routed_dp_rank=0).rank == 0


@pytest.mark.parametrize("field", ["routed_dp_rank", "prefill_dp_rank_hint"])
@pytest.mark.parametrize("bad", [-1, 4, True, "1"])
def test_out_of_range_ranks_are_400(field, bad):
    with pytest.raises(BadRequest, match=r"in \[0, 4\)"):
        decide(**{field: bad})


@pytest.mark.parametrize("bad", [-1, 1 << 63, "5", None, 1.0, False])
def test_bad_rooms_are_400(bad):
    with pytest.raises(BadRequest, match="bootstrap_room"):
        decide(room=bad)
    with pytest.raises(BadRequest):
        check_room(bad)


def test_largest_room_is_fine():
    room = (1 << 63) - 1
    assert decide(room=room, balanced_rank=room % 4).path == "fast"


def test_effective_method():
    assert effective_method("auto", Role.PREFILL) == FOLLOW
    assert effective_method("auto", "decode") == "round_robin"
    assert effective_method("auto", Role.COLOCATED) == "round_robin"
    assert effective_method("shortest_queue", Role.PREFILL) == "shortest_queue"
    with pytest.raises(ValueError, match="unknown load_balance_method 'random'"):
        effective_method("random", Role.PREFILL)


# ---- decode resolution ----
def topo(dp_size=4, follow=True, force=False) -> Topology:
    return Topology(dp_size=dp_size, page_size=16, kv_cache_dtype="bfloat16",
                    follow_bootstrap_room=follow, force_query_dp_rank=force, fingerprint={},
                    instance_id="abc")


def resolve(**kw) -> Resolution:
    args = dict(topology=topo(), hint=None, room=ROOM, decode_force=False)
    args.update(kw)
    return resolve_prefill_rank(**args)


def test_decode_hint_wins_over_everything():
    assert resolve(hint=3) == Resolution(3, "hint")
    assert resolve(hint=3, decode_force=True, topology=topo(force=True)) == Resolution(3, "hint")
    assert resolve(hint=2, topology=None) == Resolution(2, "hint")


def test_decode_hint_out_of_range_names_values():
    with pytest.raises(BadRequest, match=r"disagg_prefill_dp_rank.*1001.*\[0, 4\).*got 4"):
        resolve(hint=4)
    with pytest.raises(BadRequest):
        resolve(hint=-1, topology=None)


def test_decode_single_rank():
    assert resolve(topology=topo(dp_size=1, follow=False)) == Resolution(0, "single")
    assert resolve(topology=topo(dp_size=1), decode_force=True) == Resolution(0, "single")


def test_decode_fast_path():
    assert resolve() == Resolution(1, "fast")


@pytest.mark.parametrize("kw", [
    dict(topology=topo(follow=False)),
    dict(topology=topo(force=True)),
    dict(decode_force=True),
    dict(topology=None),
])
def test_decode_queries_otherwise(kw):
    assert resolve(**kw) == Resolution(None, "query")
