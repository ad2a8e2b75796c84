"""DP dispatcher methods, the colocated role, and the shared request path's dispatch step
(Generator.start with a recording pool: nothing is sent unless every item passes)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from pdserve.core.config import Role, ServerConfig
from pdserve.core.errors import BadRequest, Timeout, Unavailable
from pdserve.core.messages import PDParams, TokenOutput
from pdserve.core.pd_vocab import LBMethod
from pdserve.core.sampling import SamplingParams
from pdserve.server import role_table
from pdserve.server.front import Generator, Limits
from pdserve.server.metrics import FrontMetrics
from pdserve.server.protocol import RequestItem
from pdserve.server.role_table import make_role
from pdserve.server.roles import ColocatedRole, Dispatch, DPDispatcher


def test_round_robin_cycles():
    d = DPDispatcher(3, LBMethod.ROUND_ROBIN)
    assert [d.choose(None).dp_rank for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert d.choose(None).reason == "round_robin"


def test_shortest_queue_picks_fewest_in_flight():
    d = DPDispatcher(3, LBMethod.SHORTEST_QUEUE)
    picks = []
    for _ in range(3):
        r = d.choose(None).dp_rank
        d.started(r, 10)
        picks.append(r)
    assert sorted(picks) == [0, 1, 2]  # one each
    d.started(1, 10)  # rank 1 now has two
    d.finished(picks[0], 10)  # the first rank frees one
    assert d.choose(None).dp_rank == picks[0]
    d.started(picks[0], 10)
    loads = [x.requests for x in d.loads]
    nxt = d.choose(None).dp_rank
    assert loads[nxt] == min(loads)


def test_minimum_tokens_picks_fewest_tokens():
    d = DPDispatcher(2, LBMethod.MINIMUM_TOKENS)
    d.started(0, 500)
    for _ in range(4):  # rank 1 stays cheaper even with more requests
        r = d.choose(None).dp_rank
        assert r == 1
        d.started(r, 20)
    assert [x.requests for x in d.loads] == [1, 4]
    d.finished(0, 500)
    assert d.choose(None).dp_rank == 0


def test_follow_bootstrap_room_and_fallback():
    d = DPDispatcher(4, LBMethod.FOLLOW_BOOTSTRAP_ROOM)
    for room in (0, 5, 6, 2**63 - 1, 123456789):
        c = d.choose(room)
        assert (c.dp_rank, c.reason) == (room % 4, "follow_bootstrap_room")
    no_room = [d.choose(None) for _ in range(4)]
    assert [c.dp_rank for c in no_room] == [0, 1, 2, 3]
    assert all("round_robin" in c.reason for c in no_room)


@pytest.mark.parametrize("method", [m for m in LBMethod if m is not LBMethod.AUTO])
def test_routed_dp_rank_overrides_and_is_checked(method):
    d = DPDispatcher(2, method)
    assert d.choose(7, routed_dp_rank=1) == d.choose(8, routed_dp_rank=1)
    assert d.choose(6, routed_dp_rank=1).dp_rank == 1
    assert d.choose(6, routed_dp_rank=1).reason == "routed_dp_rank"
    for bad in (2, -1, 99):
        with pytest.raises(BadRequest, match="out of range"):
            d.choose(None, routed_dp_rank=bad)


def test_colocated_role_ignores_pd_fields_and_resolves_auto():
    cfg = ServerConfig(dp_size=2)
    role = make_role(cfg)
    assert isinstance(role, ColocatedRole) and role.disaggregation_mode is None
    assert role.lb_method() is LBMethod.ROUND_ROBIN
    assert make_role(ServerConfig(load_balance_method="minimum_tokens")).lb_method() is LBMethod.MINIMUM_TOKENS
    d = DPDispatcher(2, role.lb_method())
    it = item(0, pd=PDParams("127.0.0.1", 8998, 11, 1))
    disp = role.dispatch(it, d)
    assert disp.pd is None and disp.dp_rank in (0, 1)


def test_pd_roles_resolve_auto_per_design():
    prefill = make_role(ServerConfig(role=Role.PREFILL, dp_size=2))
    decode = make_role(ServerConfig(role=Role.DECODE, dp_size=2))
    assert (prefill.disaggregation_mode, prefill.lb_method()) == ("prefill", LBMethod.FOLLOW_BOOTSTRAP_ROOM)
    assert (decode.disaggregation_mode, decode.lb_method()) == ("decode", LBMethod.ROUND_ROBIN)


def test_role_without_a_front_fails_clearly(monkeypatch):
    monkeypatch.setattr(role_table, "FRONT_ROLES", {Role.COLOCATED: ColocatedRole})
    with pytest.raises(ValueError, match="no front implementation"):
        make_role(ServerConfig(role=Role.DECODE))


# ---- the dispatch step of the shared request path ------------------------------------------------

class RecordingPool:
    """Stands in for WorkerPool: records what would be sent."""

    def __init__(self):
        self.sent: list[tuple[int, str]] = []
        self.aborted: list[str] = []
        self.busy: set[str] = set()
        self.dead_rank: int | None = None

    def check_free(self, rids):
        for r in rids:
            if r in self.busy:
                raise BadRequest(f"rid {r!r} is already in flight on this server")

    def submit(self, rank, req, sink):
        if rank == self.dead_rank:
            raise Unavailable(f"dp worker rank {rank} is gone")
        self.sent.append((rank, req.rid))
        self.sink = sink

    def abort(self, rid, reason):
        self.aborted.append(rid)


def item(k: int, ids=(5, 6, 7), max_new=8, routed=None, pd=PDParams(), given=True) -> RequestItem:
    return RequestItem(k, f"r{k}", list(ids), SamplingParams(max_new_tokens=max_new), given,
                       routed_dp_rank=routed, pd=pd)


def make_generator(method=LBMethod.ROUND_ROBIN, dp=3, ctx=64, vocab=100):
    pool = RecordingPool()
    disp = DPDispatcher(dp, method)
    gen = Generator(pool, disp, ColocatedRole(ServerConfig(dp_size=dp)), tokenizer=None,  # type: ignore[arg-type]
                    limits=Limits(ctx, vocab), metrics=FrontMetrics("colocated"))
    return gen, pool, disp


def idle(disp: DPDispatcher) -> bool:
    return all(x.requests == 0 and x.tokens == 0 for x in disp.loads)


def test_batch_spreads_with_shortest_queue_and_close_releases():
    gen, pool, disp = make_generator(LBMethod.SHORTEST_QUEUE, dp=3)
    active = gen.start([item(k) for k in range(6)])
    assert Counter(r for r, _ in pool.sent) == {0: 2, 1: 2, 2: 2}
    assert [x.tokens for x in disp.loads] == [22, 22, 22]
    active.close()
    assert sorted(pool.aborted) == [f"r{k}" for k in range(6)]
    assert idle(disp)


@pytest.mark.parametrize("bad, match", [
    (item(5, ids=(5, 100)), "outside the vocabulary"),
    (item(5, ids=(-1,)), "outside the vocabulary"),
    (item(5, ids=()), "empty"),
    (item(5, max_new=62), "exceeds the context length"),
    (item(5, ids=[1] * 64), "no room"),
    (item(5, routed=3), "out of range"),
])
def test_bad_item_sends_nothing(bad, match):
    gen, pool, disp = make_generator()
    with pytest.raises(BadRequest, match=match):
        gen.start([item(0), item(1), bad])
    assert pool.sent == [] and idle(disp)


def test_default_max_new_tokens_is_fitted_to_the_context():
    gen, pool, disp = make_generator(ctx=64)
    active = gen.start([item(0, max_new=1000, given=False)])
    assert active.items[0].sampling.max_new_tokens == 61
    active.close()
    assert idle(disp)


def test_rid_in_flight_and_unreachable_rank():
    gen, pool, disp = make_generator()
    pool.busy.add("r1")
    with pytest.raises(BadRequest, match="already in flight"):
        gen.start([item(0), item(1)])
    assert pool.sent == [] and idle(disp)
    gen, pool, disp = make_generator()
    pool.dead_rank = 1
    with pytest.raises(Unavailable):
        gen.start([item(0), item(1)])  # r0 went to rank 0, r1 to the dead rank 1
    assert pool.aborted == ["r0"] and idle(disp)


def test_pinned_dispatch_bypasses_the_role():
    gen, pool, disp = make_generator()
    active = gen.start([item(0, routed=2)], Dispatch(1, "health_generate"))
    assert pool.sent == [(1, "r0")]
    active.close()


class Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(ord("a") + i % 26) for i in ids)


def test_events_finish_release_and_stop_string_abort():
    gen, pool, disp = make_generator()
    gen.tokenizer = Tok()  # type: ignore[assignment]
    it = RequestItem(0, "s", [1], SamplingParams(max_new_tokens=20, stop=("cd",)), True)
    active = gen.start([it, item(1)])

    async def run():
        pool.sink.put_nowait(TokenOutput("s", [0, 1, 2]))  # "abc"
        pool.sink.put_nowait(TokenOutput("r1", [4], finished=True, finish_reason={"type": "length"}))
        pool.sink.put_nowait(TokenOutput("s", [3, 4]))  # "abcde": stop at "cd"
        return [p.rid async for p in active.events()]

    seen = asyncio.run(run())
    assert seen == ["s", "r1", "s"]
    prog = active.progress["s"]
    assert prog.text == "ab" and prog.output_ids == [0, 1, 2, 3]
    assert prog.finish_reason == {"type": "stop", "matched": "cd"}
    assert pool.aborted == ["s"]
    active.close()
    assert pool.aborted == ["s"] and idle(disp)


def test_minimum_tokens_counts_only_what_the_cache_did_not_hold():
    """A rank whose prefix cache held most of a prompt is less loaded than its raw token count."""
    d = DPDispatcher(2, LBMethod.MINIMUM_TOKENS)
    d.started(0, 1000)
    d.started(1, 600)
    assert d.choose(None).dp_rank == 1
    d.reused(0, 900)  # the worker reported 900 cached prompt tokens
    assert d.loads[0].tokens == 100 and d.choose(None).dp_rank == 0
    d.finished(0, 1000 - 900)
    assert d.loads[0].tokens == 0


def test_dispatcher_refuses_unresolved_auto():
    with pytest.raises(ValueError, match="resolve"):
        DPDispatcher(2, LBMethod.AUTO)


def test_no_output_for_the_timeout_is_a_timeout_naming_the_ranks_and_rids():
    gen, pool, disp = make_generator()
    gen.tokenizer = Tok()  # type: ignore[assignment]
    gen.limits = Limits(64, 100, output_timeout_s=0.2)
    active = gen.start([item(0), item(1)])

    async def run():
        pool.sink.put_nowait(TokenOutput("r0", [4], finished=True, finish_reason={"type": "length"}))
        seen = []
        with pytest.raises(Timeout, match=r"no output for 0s from dp ranks \[1\] for rids \['r1'\]"):
            async for p in active.events():
                seen.append(p.rid)
        return seen

    t0 = time.monotonic()
    assert asyncio.run(run()) == ["r0"]
    assert 0.15 < time.monotonic() - t0 < 5.0
    active.close()
    assert idle(disp)


def test_outputs_that_keep_coming_or_wait_for_a_slow_reader_are_no_stall():
    gen, pool, disp = make_generator()
    gen.tokenizer = Tok()  # type: ignore[assignment]
    gen.limits = Limits(64, 100, output_timeout_s=0.3)
    active = gen.start([item(0)])

    async def run():
        async def feed():  # one output every 0.1 s for 0.6 s: twice the timeout in all
            for k in range(6):
                await asyncio.sleep(0.1)
                last = k == 5
                reason = {"type": "length"} if last else None
                pool.sink.put_nowait(TokenOutput("r0", [k], finished=last, finish_reason=reason))
        feeder = asyncio.ensure_future(feed())
        seen = []
        async for p in active.events():
            seen.append(len(p.output_ids))
            if len(seen) == 2:
                await asyncio.sleep(0.7)  # the reader is slow; the outputs wait in the queue
        await feeder
        return seen

    assert asyncio.run(run())[-1] == 6
    active.close()
    assert idle(disp)
