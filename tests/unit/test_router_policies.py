"""Unit tests of the router's pieces, no processes: policies, health states, PD bodies, flags, pool."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass

import msgspec
import pytest

from pdserve.core.config import Role
from pdserve.core.errors import BadRequest, Unavailable
from pdserve.router import build_router_parser, config_from_args
from pdserve.router.config import ServerSpec
from pdserve.router.health import TRANSITIONS, HealthState, HealthTracker, ProbeEvent
from pdserve.router.pd_body import (
    Route,
    inspect_request,
    leg_bodies,
    merge_input_logprobs,
    mint_rooms,
    parse_client_body,
)
from pdserve.router.policies import CacheAwarePolicy, PowerOfTwoPolicy, RandomPolicy, RoundRobinPolicy, make_policy
from pdserve.router.upstream import Upstream, UpstreamPool


@dataclass
class Srv:
    name: str
    load: int = 0


# ---- policies -----------------------------------------------------------------------------
def test_round_robin_cycles_in_order():
    servers = [Srv("a"), Srv("b"), Srv("c")]
    policy = RoundRobinPolicy()
    assert [policy.pick(servers).name for _ in range(7)] == list("abcabca")


def test_random_spreads_uniformly():
    servers = [Srv("a"), Srv("b"), Srv("c")]
    policy = RandomPolicy(random.Random(1))
    counts = Counter(policy.pick(servers).name for _ in range(3000))
    assert set(counts) == {"a", "b", "c"}
    assert all(800 < n < 1200 for n in counts.values()), counts


def test_power_of_two_prefers_less_loaded():
    policy = PowerOfTwoPolicy(random.Random(2))
    assert {policy.pick([Srv("idle", 0), Srv("busy", 100)]).name for _ in range(50)} == {"idle"}
    # With three servers the most loaded one loses every comparison it is drawn into.
    three = [Srv("a", 0), Srv("b", 5), Srv("c", 10)]
    counts = Counter(policy.pick(three).name for _ in range(600))
    assert counts["c"] == 0 and counts["a"] > counts["b"] > 0


def test_power_of_two_equal_loads_spread_and_single_candidate():
    policy = PowerOfTwoPolicy(random.Random(3))
    counts = Counter(policy.pick([Srv("a"), Srv("b")]).name for _ in range(400))
    assert counts["a"] > 100 and counts["b"] > 100
    assert policy.pick([Srv("only")]).name == "only"


def test_make_policy_names():
    assert isinstance(make_policy("power_of_two"), PowerOfTwoPolicy)
    assert isinstance(make_policy("cache_aware"), CacheAwarePolicy)  # a real policy now, not an alias
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("cache_awareness")


def test_simple_policies_ignore_the_routing_key():
    servers = [Srv("a"), Srv("b")]
    policy = RoundRobinPolicy()
    assert [policy.pick(servers, "some text").name for _ in range(3)] == list("aba")
    assert not policy.needs_key and not policy.per_rank


# ---- health state machine -----------------------------------------------------------------
def test_transition_table_is_complete():
    assert set(TRANSITIONS) == {(s, e) for s in HealthState for e in ProbeEvent}


def test_health_unknown_until_first_pass_then_removed_after_threshold():
    t = HealthTracker(failure_threshold=3, success_threshold=2)
    assert t.state is HealthState.UNKNOWN and not t.selectable
    t.record(False, "refused")
    assert t.state is HealthState.UNKNOWN
    assert t.record(True) == (HealthState.UNKNOWN, HealthState.HEALTHY)
    t.record(False, "x"), t.record(False, "x")
    assert t.selectable  # two failures < threshold 3
    assert t.record(False, "boom") == (HealthState.HEALTHY, HealthState.UNHEALTHY)
    assert t.last_error == "boom" and not t.selectable
    t.record(True)
    assert t.state is HealthState.UNHEALTHY  # needs two passes in a row
    t.record(False, "again"), t.record(True)
    assert t.state is HealthState.UNHEALTHY
    assert t.record(True) == (HealthState.UNHEALTHY, HealthState.HEALTHY)


def test_a_confirmed_failure_counts_as_the_whole_threshold():
    t = HealthTracker(failure_threshold=3)
    t.record(True)
    assert t.record(False, "leg refused, then the probe", down=True) == (HealthState.HEALTHY, HealthState.UNHEALTHY)


def test_a_failed_leg_is_probed_once_and_the_probe_decides():
    """HealthLoop.confirm: concurrent leg failures of one server share one probe; a passing probe
    keeps the server in selection however many legs failed, a failed one takes it out at once."""
    import asyncio

    from pdserve.router.health import HealthLoop

    async def scenario():
        up = Upstream("http://d", Role.DECODE, HealthTracker(failure_threshold=3))
        up.health.record(True)
        calls, answer, changes = [], {"ok": True}, []

        async def probe(u):
            calls.append(u.url)
            await asyncio.sleep(0.01)
            if not answer["ok"]:
                raise ConnectionRefusedError("refused")

        loop = HealthLoop([up], probe, 60.0, lambda u, old, new: changes.append(new))
        tasks = [loop.confirm(up, "cut") for _ in range(5)]  # a burst of cut connections
        await asyncio.gather(*tasks)
        assert len(calls) == 1 and up.health.selectable and up.health.failures == 0
        answer["ok"] = False
        await loop.confirm(up, "connection reset")
        assert len(calls) == 2 and not up.health.selectable and changes == [HealthState.UNHEALTHY]
        assert "connection reset; then a probe failed: ConnectionRefusedError" in up.health.last_error
        await loop.close()

    asyncio.run(scenario())


# ---- PD bodies ----------------------------------------------------------------------------
def test_parse_client_body_rejects_bad_json_and_non_objects():
    assert parse_client_body(b'{"text": "x"}') == {"text": "x"}
    for raw in (b"{bad", b"[1, 2]", b'"text"', b""):
        with pytest.raises(BadRequest):
            parse_client_body(raw)


@pytest.mark.parametrize("route,body,count", [
    (Route.GENERATE, {"text": "x"}, None),
    (Route.GENERATE, {"input_ids": [1, 2, 3]}, None),
    (Route.GENERATE, {"text": ["a", "b", "c"]}, 3),
    (Route.GENERATE, {"input_ids": [[1], [2]]}, 2),
    (Route.GENERATE, {"text": "x", "sampling_params": {"n": 4}}, 4),
    (Route.GENERATE, {"text": ["a", "b"], "sampling_params": {"n": 3}}, 6),
    (Route.GENERATE, {"text": ["a", "b"], "sampling_params": [{"n": 2}, {"n": 2}]}, 4),
    (Route.COMPLETIONS, {"prompt": "x", "n": 2}, 2),
    (Route.COMPLETIONS, {"prompt": ["x", "y"]}, 2),
    (Route.COMPLETIONS, {"prompt": [5, 6, 7]}, None),
    (Route.CHAT, {"messages": [], "n": 1}, None),
    (Route.CHAT, {"messages": [], "n": 3}, 3),
])
def test_room_counts(route, body, count):
    assert inspect_request(route, body).room_count == count


@pytest.mark.parametrize("route,body", [
    (Route.GENERATE, {"text": "x", "sampling_params": {"n": 0}}),
    (Route.GENERATE, {"text": "x", "sampling_params": {"n": "2"}}),
    (Route.GENERATE, {"text": "x", "sampling_params": "greedy"}),
    (Route.GENERATE, {"text": []}),
    (Route.CHAT, {"messages": [], "n": True}),
])
def test_bad_fields_are_bad_requests(route, body):
    with pytest.raises(BadRequest):
        inspect_request(route, body)


def test_chat_renames_max_tokens_and_completions_keeps_it():
    chat = {"messages": [], "max_tokens": 8}
    inspect_request(Route.CHAT, chat)
    assert chat == {"messages": [], "max_completion_tokens": 8}
    both = {"messages": [], "max_tokens": 8, "max_completion_tokens": 5}
    inspect_request(Route.CHAT, both)
    assert both == {"messages": [], "max_completion_tokens": 5}
    comp = {"prompt": "x", "max_tokens": 8}
    inspect_request(Route.COMPLETIONS, comp)
    assert comp == {"prompt": "x", "max_tokens": 8}


def test_shape_flags():
    shape = inspect_request(Route.GENERATE, {"text": "x", "stream": True, "return_logprob": [False, True]})
    assert shape.stream and shape.return_logprob


def test_mint_rooms_range_and_freshness():
    rooms = [mint_rooms(None) for _ in range(200)] + mint_rooms(200)
    assert all(isinstance(r, int) and 0 <= r < 2**63 for r in rooms)
    assert len(set(rooms)) == len(rooms)
    assert max(rooms) > 2**61  # uses the high bits


def test_leg_bodies_identical_without_dp_and_pinned_with_dp():
    body = {"text": "x", "data_parallel_rank": 7}
    p, d = leg_bodies(body, "10.0.0.1", None, 42)
    assert p == d
    assert msgspec.json.decode(p) == {**body, "bootstrap_host": "10.0.0.1", "bootstrap_port": None,
                                      "bootstrap_room": 42}
    p, d = leg_bodies(body, "h", 9000, [1, 2], dp_ranks=(1, 3))
    p, d = msgspec.json.decode(p), msgspec.json.decode(d)
    assert p["routed_dp_rank"] == 1 and p["disagg_prefill_dp_rank"] == 1
    assert d["routed_dp_rank"] == 3 and d["disagg_prefill_dp_rank"] == 1
    assert "data_parallel_rank" not in p and "data_parallel_rank" not in d
    assert body == {"text": "x", "data_parallel_rank": 7}  # the client body is not modified


def test_merge_input_logprobs_single_and_batch():
    enc = msgspec.json.encode
    pre = {"meta_info": {"input_token_logprobs": [[-1.0, 1, None], [-2.0, 2, None]]}}
    dec = {"text": "t", "meta_info": {"input_token_logprobs": [[-3.0, 3, None]]}}
    merged = msgspec.json.decode(merge_input_logprobs(enc(pre), enc(dec)))
    assert merged["meta_info"]["input_token_logprobs"] == [[-1.0, 1, None], [-2.0, 2, None], [-3.0, 3, None]]
    assert merged["text"] == "t"
    batch = msgspec.json.decode(merge_input_logprobs(enc([pre, pre]), enc([{"meta_info": {}}] * 2)))
    assert [b["meta_info"]["input_token_logprobs"] for b in batch] == [pre["meta_info"]["input_token_logprobs"]] * 2
    assert merge_input_logprobs(b"not json", b'{"a": 1}') == b'{"a": 1}'


# ---- flags --------------------------------------------------------------------------------
def parse(argv: str):
    return config_from_args(build_router_parser().parse_args(argv.split()))


def test_sglang_router_command_line_parses():
    cfg = parse("--pd-disaggregation --prefill http://a:1 8998 --prefill http://b:2 none --prefill http://c:3/ "
                "--decode http://d:4 --decode http://e:5 --policy cache_aware --decode-policy random "
                "--retry-max-retries 5 --host 127.0.0.1 --port 0 --prometheus-host 127.0.0.1")
    assert cfg.prefill == (ServerSpec("http://a:1", 8998), ServerSpec("http://b:2"), ServerSpec("http://c:3"))
    assert cfg.decode == (ServerSpec("http://d:4"), ServerSpec("http://e:5"))
    assert (cfg.prefill_policy, cfg.decode_policy, cfg.max_tries) == ("cache_aware", "random", 5)


def test_defaults():
    cfg = parse("--prefill http://a:1 --decode http://d:4")
    assert (cfg.host, cfg.port, cfg.request_timeout_secs, cfg.max_tries) == ("127.0.0.1", 30000, 1800.0, 3)
    assert not cfg.dp_aware and cfg.api_key == ""


@pytest.mark.parametrize("argv", [
    "--prefill http://a:1 notaport --decode http://d:4",
    "--prefill http://a:1 1 2 --decode http://d:4",
    "--prefill a:1 --decode http://d:4",
    "--prefill http://a:1 --decode http://d:4 --policy cache_awareness",
])
def test_bad_flags_exit(argv):
    with pytest.raises(SystemExit):
        parse(argv)


def test_config_needs_both_roles():
    with pytest.raises(ValueError, match="at least one"):
        parse("--prefill http://a:1")
    with pytest.raises(ValueError, match="max-retries"):
        parse("--prefill http://a:1 --decode http://d:4 --max-retries 0")


# ---- upstreams and pool -------------------------------------------------------------------
def make_up(url: str, role: Role, healthy: bool = True) -> Upstream:
    tracker = HealthTracker()
    if healthy:
        tracker.record(True)
    return Upstream(url, role, tracker)


def test_upstream_server_info_and_dp_round_robin():
    up = make_up("http://10.1.2.3:30000", Role.DECODE)
    assert up.bootstrap_host == "10.1.2.3"
    up.update_from_server_info({"dp_size": 3, "workers": [
        {"running_requests": 2, "waiting_requests": 1}, {"running_requests": 4, "waiting_requests": 0}]})
    up.inflight = 2
    assert (up.dp_size, up.reported_load, up.load) == (3, 7, 9)
    assert [up.next_dp_rank() for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    up.update_from_server_info({"dp_size": "bad"})
    assert up.dp_size == 3


def test_pool_avoids_failed_servers_while_others_remain():
    a, b = make_up("http://a:1", Role.DECODE), make_up("http://b:1", Role.DECODE)
    down = make_up("http://c:1", Role.DECODE, healthy=False)
    pool = UpstreamPool([make_up("http://p:1", Role.PREFILL)], [a, b, down], RoundRobinPolicy(), RoundRobinPolicy())
    assert {pool.pick(Role.DECODE).url for _ in range(6)} == {"http://a:1", "http://b:1"}
    assert {pool.pick(Role.DECODE, frozenset({"http://a:1"})).url for _ in range(4)} == {"http://b:1"}
    # Nothing else left: the avoided server is still better than no answer.
    assert pool.pick(Role.DECODE, frozenset({"http://a:1", "http://b:1"})).url in ("http://a:1", "http://b:1")
    pool.prefill[0].health.record(False), pool.prefill[0].health.record(False), pool.prefill[0].health.record(False)
    with pytest.raises(Unavailable, match="no healthy prefill server"):
        pool.pick_pair()
