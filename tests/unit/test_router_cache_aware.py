"""Unit tests of the router's cache_aware policy, no processes: the approximate prefix tree, each
decision rule, eviction, per-role and per-(server, DP rank) affinity, forgetting servers whose cache
is gone, routing keys, flags and metrics."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass

import pytest

from pdserve.core.config import Role
from pdserve.router import build_router_parser, config_from_args
from pdserve.router.app import RouterApp
from pdserve.router.health import HealthTracker
from pdserve.router.pd_body import Route, leg_bodies, routing_key
from pdserve.router.policies import (
    BALANCED,
    MATCHED,
    SMALLEST_TREE,
    CacheAwareConfig,
    CacheAwarePolicy,
    RoundRobinPolicy,
)
from pdserve.router.prefix_tree import PrefixTree
from pdserve.router.upstream import Upstream, UpstreamPool


@dataclass
class W:
    """A candidate: a tenant and a load."""

    tenant: str
    load: int = 0


def computed_sizes(tree: PrefixTree) -> dict:
    """Per-tenant sizes recomputed from the nodes (the maintained counts must agree)."""
    out: dict = {}
    for node in tree._walk():
        for t in node.tenants:
            out[t] = out.get(t, 0) + len(node.label)
    return out


def check_invariants(tree: PrefixTree) -> None:
    assert {t: s for t, s in tree.sizes().items() if s} == computed_sizes(tree)
    for node in tree._walk():
        assert node.tenants, "a node nobody holds must be pruned"
        if node.parent is not tree._root:
            assert set(node.tenants) <= set(node.parent.tenants), "a tenant holds every ancestor"
        for first, child in node.children.items():
            assert child.label[0] == first and child.parent is node


# ---- the tree -----------------------------------------------------------------------------
def test_tree_insert_and_longest_match():
    tree = PrefixTree()
    assert tree.longest_match("hello") == (None, 0)
    tree.insert("hello world", "a")
    tree.insert("help me", "b")  # splits "hello world" at "hel"
    tree.insert("hello there", "b")
    assert tree.longest_match("hello world, again") == ("a", 11)
    assert tree.longest_match("hello wo") == ("a", 8)  # ends inside a node
    assert tree.longest_match("help") == ("b", 4)
    assert tree.longest_match("hello t") == ("b", 7)
    assert tree.longest_match("xyz") == (None, 0)
    # Both hold "hello ": the one that used that node last wins the tie.
    assert tree.longest_match("hello ") == ("b", 6)
    tree.insert("hello world", "a")
    assert tree.longest_match("hello ") == ("a", 6)
    # Restricted to some tenants: the match stops where none of them holds the path.
    assert tree.longest_match("hello world", tenants={"b"}) == ("b", 6)
    assert tree.longest_match("hello world", tenants={"c"}) == (None, 0)
    check_invariants(tree)


def test_tree_counts_characters_not_bytes_and_takes_token_ids():
    tree = PrefixTree()
    tree.insert("héllo wörld", "a")
    assert tree.size("a") == 11 and tree.longest_match("héllo") == ("a", 5)
    ids = PrefixTree()
    ids.insert((1, 2, 3, 4), "a")
    ids.insert((1, 2, 9), "b")
    assert ids.longest_match((1, 2, 3, 7)) == ("a", 3)
    assert ids.longest_match((1, 2, 9, 9)) == ("b", 3)
    assert (ids.size("a"), ids.size("b")) == (4, 3)
    check_invariants(ids)


def test_tree_sizes_per_tenant():
    tree = PrefixTree()
    for text, tenant in (("apple", "t1"), ("apricot", "t1"), ("banana", "t1"), ("amplify", "t2"),
                         ("application", "t2"), ("apple", "t2"), ("apple", "t2")):
        tree.insert(text, tenant)
    # t1: ap + ple + ricot + banana; t2: a + mplify + p + plication... the shared nodes count once each
    assert tree.size("t1") == len("apple") + len("ricot") + len("banana")
    assert tree.size("t2") == len("amplify") + len("pplication") + len("e")  # "appl" shared with "apple"
    assert tree.size("nobody") == 0 and "nobody" not in tree
    check_invariants(tree)


def test_tree_eviction_drops_least_recently_used_leaves_down_to_the_bound():
    sys_, old, newer, newest, other = ("system: be brief. ", "system: be brief. old question",
                                       "system: be brief. newer question", "system: be brief. newest question",
                                       "completely different")
    tree = PrefixTree()
    tree.insert(old, "a")
    tree.insert(newer, "a")
    tree.insert(other, "a")
    tree.insert(old, "b")  # b's use of the path does not refresh a's
    tree.insert(newest, "a")
    assert tree.size("a") == len(sys_) + len("old question") + len("newe") + len("r question") + \
        len("st question") + len(other)
    # One element over: a's least recently used leaf goes, "old question" (b keeps its own).
    assert tree.evict(max_size=tree.size("a") - 1) == len("old question")
    assert tree.longest_match(old, {"a"}) == ("a", len(sys_))
    assert tree.longest_match(old, {"b"}) == ("b", len(old))
    assert tree.longest_match(other, {"a"}) == ("a", len(other))
    # Next in LRU order: the rest of "newer" (its "newe" is shared with "newest", used later).
    tree.evict(max_size=tree.size("a") - 1)
    assert tree.longest_match(newer, {"a"}) == ("a", len("system: be brief. newe"))
    # A bound of the newest path: "completely different" goes, the most recent path stays whole.
    tree.evict(max_size=len(newest))
    assert tree.size("a") == len(newest)
    assert tree.longest_match(other, {"a"}) == (None, 0)
    assert tree.longest_match(newest, {"a"}) == ("a", len(newest))
    assert tree.size("b") == len(old)  # never over the bound: untouched
    check_invariants(tree)
    tree.evict(max_size=0)
    assert tree.size("a") == 0 and tree.size("b") == 0 and tree.node_count() == 0


def test_tree_eviction_of_one_tenant_only():
    tree = PrefixTree()
    tree.insert("x" * 50, "a")
    tree.insert("y" * 50, "b")
    assert tree.evict(10, tenant="a") == 50
    assert (tree.size("a"), tree.size("b")) == (0, 50)
    assert tree.evict(100) == 0  # nobody over the bound: no walk, nothing dropped


def test_tree_remove_tenant():
    tree = PrefixTree()
    tree.insert("shared prefix then a", "a")
    tree.insert("shared prefix then b", "b")
    tree.insert("only a", "a")
    tree.remove_tenant("a")
    assert "a" not in tree and tree.size("a") == 0
    assert tree.longest_match("only a") == (None, 0)
    assert tree.longest_match("shared prefix then b") == ("b", 20)
    assert tree.longest_match("shared prefix then a")[0] == "b"
    check_invariants(tree)
    tree.remove_tenant("nobody")  # harmless
    tree.remove_tenant("b")
    assert tree.node_count() == 0 and tree.tenants() == []


def test_tree_stays_consistent_under_random_operations():
    rng = random.Random(7)
    tree = PrefixTree()
    sent: dict[str, list[str]] = {}
    for step in range(600):
        tenant = rng.choice("abcd")
        text = "".join(rng.choice("xyz") for _ in range(rng.randint(1, 12)))
        tree.insert(text, tenant)
        sent.setdefault(tenant, []).append(text)
        if step < 300:  # no eviction yet: the match is exactly the best common prefix sent anywhere
            probe = "".join(rng.choice("xyz") for _ in range(rng.randint(1, 12)))
            best = max(len(_common(probe, s)) for texts in sent.values() for s in texts)
            assert tree.longest_match(probe)[1] == best
        elif step % 50 == 0:
            tree.evict(rng.randint(0, 40))
        elif step % 77 == 0:
            tree.remove_tenant(rng.choice("abcd"))
        check_invariants(tree)


def _common(a: str, b: str) -> str:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]


# ---- decision rules -----------------------------------------------------------------------
def policy(**kw) -> CacheAwarePolicy:
    cfg = {"cache_threshold": 0.5, "balance_abs_threshold": 4, "balance_rel_threshold": 1.5} | kw
    return CacheAwarePolicy(config=CacheAwareConfig(**cfg))


def test_match_above_threshold_follows_the_match():
    p = policy()
    a, b = W("a"), W("b")
    assert p.pick([a, b], "the long shared system prompt, question 1") is a  # both empty: first
    # a holds 40 of the 41 characters: over 0.5, so a, though b's (empty) tree is the smaller one
    assert p.pick([a, b], "the long shared system prompt, question 2") is a
    assert p.decide([b, a], "the long shared system prompt, question 3") == (a, MATCHED)


def test_match_at_or_below_threshold_goes_to_the_smallest_tree():
    p = policy(cache_threshold=0.5)
    a, b = W("a"), W("b")
    p.text_tree.insert("abcd", "a")
    p.text_tree.insert("0123456789", "b")
    # sizes: a 4, b 10; 4/8 = 0.5 is not above the threshold (sglang-router compares with >)
    assert p.decide([a, b], "abcdefgh") == (a, SMALLEST_TREE)
    assert p.decide([a, b], "abcdefg") == (a, MATCHED)  # 4/7 > 0.5
    p.text_tree.insert("abcd" + "z" * 20, "a")  # a's tree grows past b's
    assert p.decide([a, b], "qqqq") == (b, SMALLEST_TREE)
    # Equal trees: the less loaded one.
    c, d = W("c", load=3), W("d", load=1)
    assert p.decide([c, d], "qqqq") == (d, SMALLEST_TREE)


def test_imbalance_goes_to_the_least_loaded():
    p = policy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    a, b = W("a", load=10), W("b", load=5)
    p.text_tree.insert("cached prompt", "a")
    # 10 - 5 > 4 and 10 > 5 * 1.5: imbalanced, the match on a does not count
    assert p.decide([a, b], "cached prompt") == (b, BALANCED)
    assert p.pick([a, b], "cached prompt") is b
    assert p.text_tree.longest_match("cached prompt", {"b"}) == ("b", 13)  # still recorded where it went


def test_imbalance_needs_both_the_absolute_and_the_relative_threshold():
    p = policy(balance_abs_threshold=4, balance_rel_threshold=1.5)
    p.text_tree.insert("cached prompt", "a")
    # abs exceeded (100 - 90 > 4) but not rel (100 <= 90 * 1.5): cache wins
    assert p.decide([W("a", 100), W("b", 90)], "cached prompt")[1] == MATCHED
    # rel exceeded (4 > 1 * 1.5) but not abs (4 - 1 <= 4): cache wins
    assert p.decide([W("a", 4), W("b", 1)], "cached prompt")[1] == MATCHED
    # both: balanced
    assert p.decide([W("a", 6), W("b", 1)], "cached prompt") == (W("b", 1), BALANCED)


def test_no_key_goes_to_the_smallest_tree_and_records_nothing():
    p = policy()
    p.text_tree.insert("abc", "a")
    assert p.pick([W("a"), W("b")], None).tenant == "b"
    assert p.pick([W("a"), W("b")], "").tenant == "b"
    assert p.text_tree.tenants() == ["a"]


def test_text_and_token_ids_are_separate_key_spaces():
    p = policy()
    a, b = W("a"), W("b")
    assert p.pick([a, b], "1 2 3 4 5 6") is a
    assert p.pick([a, b], (1, 2, 3, 4, 5, 6)) is a  # token tree empty: smallest tree, first
    p.token_tree.insert((9,) * 50, "a")
    assert p.decide([a, b], (1, 2, 3, 4, 5, 6, 7)) == (a, MATCHED)
    assert p.decide([a, b], (7, 7, 7)) == (b, SMALLEST_TREE)  # b's token tree is the smaller one
    assert p.text_tree.size("a") == 11 and p.token_tree.size("a") == 56


def test_periodic_eviction_bounds_every_tree():
    p = policy(max_tree_size=20, eviction_interval_secs=0.01)
    for i in range(10):
        p.pick([W("a"), W("b")], f"conversation {i} " + "x" * 30)
        p.pick([W("a"), W("b")], (i,) * 30)
    p.maintain()
    for tree in (p.text_tree, p.token_tree):
        assert all(size <= 20 for size in tree.sizes().values()), tree.sizes()
        check_invariants(tree)

    async def run_upkeep():
        p2 = policy(max_tree_size=5, eviction_interval_secs=0.01)
        p2.text_tree.insert("y" * 100, "a")
        task = asyncio.create_task(RouterApp._upkeep(p2))
        for _ in range(200):
            await asyncio.sleep(0.01)
            if p2.text_tree.size("a") <= 5:
                break
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return p2.text_tree.size("a")

    assert asyncio.run(run_upkeep()) <= 5


# ---- servers, roles and DP ranks ----------------------------------------------------------
def make_up(url: str, role: Role, dp: int = 1) -> Upstream:
    tracker = HealthTracker()
    tracker.record(True)
    up = Upstream(url, role, tracker)
    up.dp_size = dp
    return up


def cache_pool(prefills: int = 1, decodes: int = 2, dp: int = 1, dp_aware: bool = False) -> UpstreamPool:
    return UpstreamPool([make_up(f"http://p{i}:1", Role.PREFILL, dp) for i in range(prefills)],
                        [make_up(f"http://d{i}:1", Role.DECODE, dp) for i in range(decodes)],
                        policy(), policy(), dp_aware)


def test_prefill_and_decode_keep_separate_trees_and_a_conversation_keeps_its_decode():
    pool = cache_pool(prefills=2, decodes=2)
    assert pool.prefill_policy is not pool.decode_policy and pool.needs_key
    turn1 = "system: you are terse. user: tell me about rivers."
    turn2 = turn1 + " assistant: they flow. user: and lakes?"
    other = "system: you are verbose. user: explain databases."
    first = pool.pick_pair(key=turn1)
    second = pool.pick_pair(key=other)
    assert second.decode is not first.decode and second.prefill is not first.prefill  # smallest trees
    for _ in range(3):
        again = pool.pick_pair(key=turn2)
        assert (again.prefill, again.decode) == (first.prefill, first.decode)
    # Each role's tree names only its own servers.
    assert set(pool.prefill_policy.text_tree.tenants()) == {"http://p0:1", "http://p1:1"}
    assert set(pool.decode_policy.text_tree.tenants()) == {"http://d0:1", "http://d1:1"}
    assert first.prefill_rank is None and first.decode_rank is None  # not DP-aware


def test_decode_affinity_survives_a_different_prefill_choice():
    """Prefill load may move a request to another prefill; its decode still follows the match."""
    pool = cache_pool(prefills=2, decodes=2)
    key = "a conversation that started earlier and grows turn by turn"
    first = pool.pick_pair(key=key)
    first.prefill.reported_load = 100  # prefill side imbalanced now
    nxt = pool.pick_pair(key=key + " next turn")
    assert nxt.prefill is not first.prefill and nxt.decode is first.decode


def test_dp_aware_affinity_is_per_server_and_rank():
    pool = cache_pool(prefills=1, decodes=2, dp=2, dp_aware=True)
    keys = [f"conversation {c}: " + "context " * 5 for c in range(4)]
    homes = {}
    for key in keys:
        pair = pool.pick_pair(key=key)
        homes[key] = (pair.decode.url, pair.decode_rank)
    # Four conversations, four (decode, rank) slots: each went to an empty tree.
    assert sorted(homes.values()) == [("http://d0:1", 0), ("http://d0:1", 1), ("http://d1:1", 0), ("http://d1:1", 1)]
    for key in keys:
        pair = pool.pick_pair(key=key + "more")
        assert (pair.decode.url, pair.decode_rank) == homes[key]
        assert pair.prefill_rank in (0, 1)
        p_body, d_body = leg_bodies({"text": key}, "h", None, 1, (pair.prefill_rank, pair.decode_rank))
        assert b'"routed_dp_rank":%d' % pair.decode_rank in d_body
        assert b'"disagg_prefill_dp_rank":%d' % pair.prefill_rank in d_body
    assert set(pool.decode_policy.text_tree.tenants()) == set(homes.values())


def test_dp_aware_rank_load_counts_per_rank():
    pool = cache_pool(prefills=1, decodes=1, dp=2, dp_aware=True)
    d = pool.decode[0]
    d.update_from_server_info({"dp_size": 2, "workers": [{"dp_rank": 0, "running_requests": 80},
                                                         {"dp_rank": 1, "running_requests": 0}]})
    assert (d.rank_load(0), d.rank_load(1), d.load) == (80, 0, 80)
    d.rank_inflight[1] = 3
    assert d.rank_load(1) == 3
    pool.decode_policy.text_tree.insert("cached on rank 0", ("http://d0:1", 0))
    pair = pool.pick_pair(key="cached on rank 0")
    assert pair.decode_rank == 1  # rank 0 is far busier: balanced away from the match


def test_other_policies_keep_round_robin_ranks_with_dp_aware():
    pool = UpstreamPool([make_up("http://p:1", Role.PREFILL, 2)], [make_up("http://d:1", Role.DECODE, 3)],
                        RoundRobinPolicy(), RoundRobinPolicy(), dp_aware=True)
    pairs = [pool.pick_pair() for _ in range(4)]
    assert [(p.prefill_rank, p.decode_rank) for p in pairs] == [(0, 0), (1, 1), (0, 2), (1, 0)]


def cache_app(*extra: str) -> RouterApp:
    args = build_router_parser().parse_args(["--prefill", "http://p0:1", "--prefill", "http://p1:1",
                                             "--decode", "http://d0:1", "--decode", "http://d1:1",
                                             "--policy", "cache_aware", *extra])
    app = RouterApp(config_from_args(args), rng=random.Random(0))
    for up in app.pool.all():
        up.health.record(True)
    return app


def test_server_leaving_selection_loses_its_tree():
    app = cache_app("--health-failure-threshold", "2")
    pool = app.pool
    pair = pool.pick_pair(key="a prompt long enough to be matched later")
    tree = pool.decode_policy.text_tree
    assert pair.decode.url in tree
    app.health.record(pair.decode, False, "refused")
    assert pair.decode.url in tree  # one failure: still selectable
    app.health.record(pair.decode, False, "refused")
    assert not pair.decode.health.selectable and pair.decode.url not in tree
    assert pair.prefill.url in pool.prefill_policy.text_tree  # the other role's tree is untouched


def test_restarted_server_and_dead_rank_lose_their_trees():
    app = cache_app("--dp-aware")
    pool = app.pool
    d0 = pool.decode[0]
    pool.update_server_info(d0, {"instance_id": "first", "dp_size": 2})
    d0_tenants = [(d0.url, 0), (d0.url, 1)]
    for t in d0_tenants:
        pool.decode_policy.text_tree.insert(f"prompt for {t}", t)
    pool.update_server_info(d0, {"instance_id": "first", "dp_size": 2})  # same instance: kept
    assert all(t in pool.decode_policy.text_tree for t in d0_tenants)
    pool.update_server_info(d0, {"instance_id": "first", "dp_size": 2,
                                 "dead_workers": [{"dp_rank": 1, "reason": "killed"}]})
    assert (d0.url, 0) in pool.decode_policy.text_tree and (d0.url, 1) not in pool.decode_policy.text_tree
    pool.update_server_info(d0, {"instance_id": "second", "dp_size": 2})  # restarted
    assert (d0.url, 0) not in pool.decode_policy.text_tree


def test_metrics_count_decisions_by_role_and_outcome():
    app = cache_app("--balance-abs-threshold", "2", "--balance-rel-threshold", "1.0")
    pool = app.pool
    pool.pick_pair(key="first prompt " * 4)  # empty trees: smallest tree on both roles
    pool.pick_pair(key="first prompt " * 5)  # matched on both roles
    busy = next(up for up in pool.decode if up.url in pool.decode_policy.text_tree)
    busy.reported_load = 10
    pool.pick_pair(key="first prompt " * 6)  # decode: balanced away; prefill: matched

    def count(role: str, outcome: str) -> float:
        return app.metrics.registry.get_sample_value(
            "pdserve_router_cache_aware_decisions_total", {"role": role, "outcome": outcome}) or 0

    assert [count("prefill", o) for o in (MATCHED, BALANCED, SMALLEST_TREE)] == [2, 0, 1]
    assert [count("decode", o) for o in (MATCHED, BALANCED, SMALLEST_TREE)] == [1, 1, 1]
    assert b"pdserve_router_cache_aware_decisions_total" in app.metrics.render()


# ---- routing keys and flags ---------------------------------------------------------------
@pytest.mark.parametrize("route,body,key", [
    (Route.GENERATE, {"text": "hello"}, "hello"),
    (Route.GENERATE, {"input_ids": [1, 2, 3], "text": "ignored"}, (1, 2, 3)),
    (Route.GENERATE, {"input_ids": [[1, 2], [3]]}, (1, 2, 3)),
    (Route.GENERATE, {"text": ["a", "b"]}, "a b"),
    (Route.GENERATE, {"text": ""}, None),
    (Route.GENERATE, {"input_ids": [1, "x"]}, None),
    (Route.GENERATE, {"input_ids": [True, 2]}, None),
    (Route.COMPLETIONS, {"prompt": "say hi"}, "say hi"),
    (Route.COMPLETIONS, {"prompt": ["x", "y"]}, "x y"),
    (Route.COMPLETIONS, {"prompt": [5, 6]}, (5, 6)),
    (Route.COMPLETIONS, {"prompt": {"bad": 1}}, None),
    (Route.CHAT, {"messages": [{"role": "system", "content": "be brief"},
                               {"role": "user", "content": [{"type": "text", "text": "look"},
                                                            {"type": "image_url", "image_url": {"url": "u"}},
                                                            {"type": "text", "text": "here"}]},
                               {"role": "assistant", "content": "ok", "reasoning_content": "thinking"},
                               {"role": "assistant", "content": None},
                               {"role": "tool", "content": "42"},
                               {"role": "user", "content": "next"}]},
     "be brief look here ok thinking 42 next"),
    (Route.CHAT, {"messages": []}, None),
    (Route.CHAT, {"messages": "nope"}, None),
    (Route.CHAT, {"messages": [7, {"role": "user"}]}, None),
])
def test_routing_keys(route, body, key):
    assert routing_key(route, body) == key


def test_cache_aware_flags_with_sglang_router_names_and_defaults():
    def cfg(extra: str = ""):
        return config_from_args(build_router_parser().parse_args(
            f"--prefill http://a:1 --decode http://d:1 {extra}".split()))

    default = cfg("--policy cache_aware").cache_aware()
    assert default == CacheAwareConfig(0.3, 64, 1.5, 60.0, 2 ** 26)
    c = cfg("--prefill-policy cache_aware --cache-threshold 0.7 "
            "--balance-abs-threshold 8 --balance-rel-threshold 1.2 --eviction-interval-secs 5 --max-tree-size 1000")
    assert (c.prefill_policy, c.decode_policy) == ("cache_aware", "round_robin")
    assert c.cache_aware() == CacheAwareConfig(0.7, 8, 1.2, 5.0, 1000)
    with pytest.raises(ValueError, match="cache-threshold"):
        cfg("--cache-threshold 1.5")
    with pytest.raises(ValueError, match="max-tree-size"):
        cfg("--max-tree-size -1")
    app = RouterApp(cfg("--policy cache_aware --eviction-interval-secs 0"))
    assert app.pool.decode_policy.maintenance_interval_s == 0  # no eviction task
    assert isinstance(app.pool.prefill_policy, CacheAwarePolicy)
