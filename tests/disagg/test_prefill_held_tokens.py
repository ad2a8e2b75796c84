"""--max-held-prefill-tokens on a prefill front, driven through the shared request path with a
recording pool (no processes): a rank holding too many prompt tokens of PD requests in flight
refuses the next with 429 and Retry-After, fails its room where the decode looks, never refuses
a rank that holds nothing, and takes requests again once the held ones end."""

from __future__ import annotations

import asyncio

import pytest

from pdserve.core.config import Role, ServerConfig
from pdserve.core.messages import PDParams
from pdserve.core.sampling import SamplingParams
from pdserve.server.front import Limits
from pdserve.server.limits import Refused
from pdserve.server.metrics import FrontMetrics
from pdserve.server.pd_roles import PrefillFrontRole
from pdserve.server.protocol import RequestItem
from pdserve.server.roles import RoleContext
from tests.harness.front_fakes import finish, generator


def front(limit: int, dp: int = 2):
    role = PrefillFrontRole(ServerConfig(role=Role.PREFILL, dp_size=dp, max_held_prefill_tokens=limit))
    notices = []
    asyncio.run(role.start(RoleContext([], lambda rank, msg: notices.append(msg) or True)))
    metrics = FrontMetrics("prefill")
    gen = generator(role, dp, Limits(512, 1000), metrics)
    return gen, role, notices, metrics


def item(rid: str, room: int, tokens: int) -> RequestItem:
    return RequestItem(0, rid, [5] * tokens, SamplingParams(max_new_tokens=4), True,
                       pd=PDParams("127.0.0.1", 8998, room, None))


def test_a_rank_over_the_limit_refuses_with_429_and_fails_the_room_where_the_decode_looks():
    gen, role, notices, metrics = front(limit=100)
    first = gen.start([item("a", 0, 60)])  # room 0 -> rank 0 (follow_bootstrap_room)
    assert role.held_tokens(0) == 60
    gen.start([item("b", 1, 90)])  # rank 1 holds nothing yet: any prompt
    with pytest.raises(Refused) as exc:
        gen.start([item("c", 2, 41)])  # rank 0: 60 + 41 > 100
    err = exc.value
    assert err.status == 429 and err.retry_after == 1
    assert "prefill dp_rank 0 holds 60 prompt tokens" in err.message
    assert "bootstrap_room 2 adds 41" in err.message and "--max-held-prefill-tokens 100" in err.message
    assert [n.room for n in notices] == [2, 2] and notices[0].reason == err.message  # both workers told
    assert role.table.lookup([2])[1] == {2: err.message}  # a querying decode fails at once too
    assert 2 not in role.claims and role.held_tokens(0) == 60
    gen.start([item("d", 4, 40)])  # 60 + 40 fits exactly
    assert role.held_tokens(0) == 100
    assert 'pdserve_admission_refused_total{reason="held_tokens",role="prefill"} 1.0' in \
        metrics.render().decode()
    finish(first, gen.pool, "a")
    assert role.held_tokens(0) == 40
    gen.start([item("e", 6, 60)])  # room again once a held request ended


def test_a_rank_holding_nothing_takes_a_prompt_over_the_limit():
    gen, role, _, _ = front(limit=10, dp=1)
    gen.start([item("a", 0, 50)])
    with pytest.raises(Refused):
        gen.start([item("b", 1, 1)])


def test_the_limit_is_a_prefill_flag_and_off_by_default():
    assert ServerConfig(role=Role.PREFILL).max_held_prefill_tokens == 0
    with pytest.raises(ValueError, match="--max-held-prefill-tokens applies to --role prefill only"):
        ServerConfig(role=Role.DECODE, max_held_prefill_tokens=10)
    gen, role, _, _ = front(limit=0, dp=1)
    for i in range(5):
        gen.start([item(f"r{i}", i, 400)])
    assert role.held_tokens(0) == 2000
