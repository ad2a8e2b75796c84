"""The PD fronts' room bookkeeping, driven through the shared request path (Generator.start with
a recording pool, no processes): one live request per room, refusals that fail only the rooms
they own and name each item's own room, successful rooms forgotten, pinned items leaving the
dispatcher's cursor alone (issue 14 items 1, 2, 7, 8, 9)."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.core.config import Role, ServerConfig
from pdserve.core.errors import BadRequest, Overloaded
from pdserve.core.messages import PDParams, RoomFailedNotice
from pdserve.core.sampling import SamplingParams
from pdserve.server.front import Limits
from pdserve.server.metrics import FrontMetrics
from pdserve.server.pd_roles import DecodeFrontRole, PrefillFrontRole
from pdserve.server.protocol import RequestItem
from pdserve.server.roles import RoleContext
from tests.harness.front_fakes import finish, generator


def prefill(dp=2, method="follow_bootstrap_room", force=False):
    role = PrefillFrontRole(ServerConfig(role=Role.PREFILL, dp_size=dp, load_balance_method=method,
                                         force_query_prefill_dp_rank=force))
    notices: list[tuple[int, RoomFailedNotice]] = []
    asyncio.run(role.start(RoleContext([], lambda rank, msg: notices.append((rank, msg)) or True)))
    gen = generator(role, dp, Limits(64, 100), FrontMetrics("prefill"))
    return gen, role, gen.pool, notices


def item(rid: str, room: int, routed: int | None = None, hint: int | None = None, k: int = 0) -> RequestItem:
    return RequestItem(k, rid, [5, 6, 7], SamplingParams(max_new_tokens=4), True, routed_dp_rank=routed,
                       pd=PDParams("127.0.0.1", 8998, room, hint))


def failed_rooms(notices) -> dict[int, str]:
    return {msg.room: msg.reason for _, msg in notices}


def test_one_batch_with_a_room_twice_is_refused_whole():
    gen, role, pool, notices = prefill()
    with pytest.raises(BadRequest, match="bootstrap_room 7 is already in flight"):
        gen.start([item("a", 7), item("b", 7, k=1)])
    assert pool.sent == [] and role.claims == {}
    assert 7 in failed_rooms(notices)  # nothing was sent: the decode leg must fail at once


def test_a_second_request_on_a_live_room_is_refused_and_the_live_one_kept():
    gen, role, pool, notices = prefill()
    gen.start([item("a", 7)])
    with pytest.raises(BadRequest, match="already in flight on this prefill server \\(request a"):
        gen.start([item("b", 7)])
    assert [rid for _, rid, _ in pool.sent] == ["a"]
    assert notices == []  # the live room was not failed anywhere
    assert role.table.lookup([7]) == ({7: 1}, {})


def test_a_refusal_before_dispatch_leaves_a_live_room_alone():
    gen, role, pool, notices = prefill()
    gen.start([item("a", 7)])
    role.rejected([item("b", 7), item("c", 8)], Overloaded("server busy"))  # e.g. admission 429
    assert set(failed_rooms(notices)) == {8}
    assert role.table.lookup([7, 8]) == ({7: 1}, {8: failed_rooms(notices)[8]})
    assert "bootstrap_room 8" in failed_rooms(notices)[8]


def test_a_conflicting_batch_names_each_items_own_room():
    gen, role, pool, notices = prefill(dp=2)
    with pytest.raises(BadRequest, match="bootstrap_room 5 implies dp_rank 1"):
        gen.start([item("a", 4, routed=0), item("b", 5, routed=0, k=1), item("c", 6, routed=0, k=2)])
    reasons = failed_rooms(notices)
    assert set(reasons) == {4, 5, 6}
    assert "bootstrap_room 5 implies dp_rank 1" in reasons[5]
    for room in (4, 6):
        assert reasons[room].startswith(f"bootstrap_room {room} was refused with another item")
    assert role.claims == {} and pool.sent == []


def test_a_successful_room_is_forgotten_a_failed_one_remembered():
    gen, role, pool, _ = prefill()
    ok, bad = gen.start([item("a", 7)]), gen.start([item("b", 8)])
    assert role.table.lookup([7, 8])[0] == {7: 1, 8: 0}
    finish(ok, pool, "a")
    from pdserve.core.messages import ErrorInfo
    finish(bad, pool, "b", error=ErrorInfo(500, "room 8: kv write failed", "handoff_error"))
    assert role.table.lookup([7, 8])[0] == {8: 0}
    assert role.claims == {}
    gen.start([item("c", 7)])  # the room is free again


@pytest.mark.parametrize("pin", ["routed", "hint"])
def test_a_pinned_item_does_not_move_the_round_robin_cursor(pin):
    gen, role, pool, _ = prefill(dp=3, method="round_robin")
    gen.start([item("a", 100, routed=2 if pin == "routed" else None, hint=2 if pin == "hint" else None)])
    gen.start([item("b", 101)])
    gen.start([item("c", 102)])
    assert [rank for rank, _, _ in pool.sent] == [2, 0, 1]


def test_the_decode_front_refuses_a_live_room_too():
    role = DecodeFrontRole(ServerConfig(role=Role.DECODE, dp_size=2))
    gen = generator(role, 2, Limits(64, 100), FrontMetrics("decode"))
    pool = gen.pool
    a = gen.start([item("a", 7)])
    with pytest.raises(BadRequest, match="already in flight on this decode server"):
        gen.start([item("b", 7)])
    a.close()
    gen.start([item("c", 7)])
    assert [rid for _, rid, _ in pool.sent] == ["a", "c"]
