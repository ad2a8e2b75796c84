"""The engine with its prefix cache on a tiny float32 Llama: greedy tokens equal a cache-off
engine's for prefixes ending on and off a page boundary, cached_tokens is exact, eviction in a
tiny pool under many requests, aborts of sharers, flush while idle and busy, every page back."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("transformers")

from pdserve.core.sampling import SamplingParams  # noqa: E402
from pdserve.engine.engine import Engine, EngineConfig  # noqa: E402
from pdserve.engine.kv_pool import KVPool  # noqa: E402
from pdserve.engine.loader import load_model  # noqa: E402
from pdserve.engine.sequence import EngineRequest  # noqa: E402
from tests.harness.prefix_tools import expected_cached  # noqa: E402
from tests.harness.tiny_model import make_tiny_model  # noqa: E402

PAGE = 4
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("prefix_tiny")))
    return load_model(path, torch.float32, "cpu")


def make_engine(model, cache: bool = True, num_pages: int = 256, budget: int = 64,
                max_running: int = 64) -> Engine:
    m, cfg = model
    pool = KVPool(cfg.num_layers, num_pages, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    ecfg = EngineConfig(num_pages=num_pages, page_size=PAGE, max_running=max_running,
                        prefill_budget=budget, max_context=512, eos_token_ids=(2,),
                        vocab_size=cfg.vocab_size, prefix_cache=cache)
    return Engine(m, pool, ecfg)


def run(engine: Engine, arrivals: dict[int, list[EngineRequest]], aborts: dict[int, list[str]] | None = None,
        max_steps: int = 4000) -> dict[str, dict]:
    """Add arrivals[k] / abort aborts[k] before step k; step until idle. -> rid -> tokens, cached."""
    aborts = aborts or {}
    out: dict[str, dict] = {}
    step = 0
    while engine.has_work() or any(k >= step for k in list(arrivals) + list(aborts)):
        for req in arrivals.get(step, []):
            engine.add(req)
            out[req.rid] = {"tokens": [], "cached": None, "done": False}
        for rid in aborts.get(step, []):
            engine.abort(rid)
            out[rid]["done"] = "aborted"
        for o in engine.step():
            r = out[o.rid]
            assert not r["done"], f"{o.rid} produced output after finishing"
            if o.token_id is not None:
                r["tokens"].append(o.token_id)
            r["cached"] = o.cached_tokens
            r["done"] = r["done"] or o.finished
        step += 1
        assert step < max_steps, f"no progress: {engine.stats()}"
    assert all(r["done"] for r in out.values())
    return out


def assert_idle(engine: Engine) -> None:
    s = engine.stats()
    assert s.free_pages + s.cached_pages == s.total_pages and (s.running, s.waiting, s.held_pages) == (0, 0, 0), s
    assert all(engine.cache.refcount(p) == 0 for p in range(s.total_pages))
    assert not engine.seqs and not engine.held


def req(rid: str, ids: list[int], sampling: SamplingParams = GREEDY, **kw) -> EngineRequest:
    return EngineRequest(rid, list(ids), sampling, **kw)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(n)]


def reference(model, reqs: list[EngineRequest]) -> dict[str, list[int]]:
    """Each request alone on a cache-off engine."""
    eng = make_engine(model, cache=False)
    return {r.rid: run(eng, {0: [r]})[r.rid]["tokens"] for r in reqs}


@pytest.mark.parametrize("prefix_len", [12, 13, 15, 16])  # on and off a page boundary
def test_greedy_equal_with_cache_on_and_off_and_cached_tokens_exact(model, prefix_len):
    prefix = tokens(prefix_len, prefix_len)
    prompts = [prefix + tokens(100 + i, 3 + i) for i in range(4)] + [prefix, prefix + [7]]
    reqs = [req(f"r{i}", p) for i, p in enumerate(prompts)]
    ref = reference(model, reqs)
    eng = make_engine(model)
    seen: list[list[int]] = []
    for r in reqs:  # one after another: each can reuse what the ones before it computed
        got = run(eng, {0: [r]})[r.rid]
        assert got["tokens"] == ref[r.rid], r.rid
        assert got["cached"] == expected_cached(r.prompt_ids, seen, PAGE), r.rid
        seen.append(r.prompt_ids + got["tokens"][:-1])
    assert eng.stats().cache.hit_tokens == sum(expected_cached(p, seen[:i], PAGE) for i, p in enumerate(prompts))
    assert eng.stats().cache.hit_tokens > 0
    assert_idle(eng)


def test_concurrent_sharers_and_repeated_prompt(model):
    prefix = tokens(1, 21)
    reqs = [req(f"c{i}", prefix + tokens(200 + i, i % 5 + 1)) for i in range(8)]
    reqs.append(req("same", list(reqs[0].prompt_ids)))
    ref = reference(model, reqs)
    eng = make_engine(model, budget=16)
    got = run(eng, {k: [r] for k, r in enumerate(reqs)})
    assert {rid: g["tokens"] for rid, g in got.items()} == ref
    assert sum(g["cached"] for g in got.values()) > 0
    assert_idle(eng)


def test_output_pages_are_cached_too_for_the_next_turn(model):
    """A second turn whose prompt is the first turn's prompt + answer + more reuses the answer's pages."""
    first = req("t1", tokens(3, 10), SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True))
    eng = make_engine(model)
    answer = run(eng, {0: [first]})["t1"]["tokens"]
    second = req("t2", first.prompt_ids + answer + tokens(4, 5))
    got = run(eng, {0: [second]})["t2"]
    assert got["cached"] == (10 + 12 - 1) // PAGE * PAGE  # every computed full page
    assert got["tokens"] == reference(model, [second])["t2"]
    assert_idle(eng)


def test_eviction_in_a_tiny_pool_under_many_requests(model):
    """30 requests over 3 prefixes through a 24-page pool: everyone finishes with the tokens
    it has alone, pages are evicted (and preempted sequences re-prefill), all come back."""
    prefixes = [tokens(10 + k, 17) for k in range(3)]
    reqs = [req(f"e{i}", prefixes[i % 3] + tokens(300 + i, 1 + i % 6)) for i in range(30)]
    ref = reference(model, reqs)
    eng = make_engine(model, num_pages=24, budget=24, max_running=8)
    arrivals: dict[int, list[EngineRequest]] = {}
    for i, r in enumerate(reqs):
        arrivals.setdefault(i // 3, []).append(r)
    got = run(eng, arrivals)
    assert {rid: g["tokens"] for rid, g in got.items()} == ref
    s = eng.stats()
    assert s.cache.evicted_pages > 0 and s.cache.hit_tokens > 0
    assert_idle(eng)


def test_aborted_sharers_leave_reusers_intact(model):
    """C decodes; A reuses C's prompt pages and is mid-prefill when C is aborted; A is aborted
    mid-prefill too; B then reuses what both computed. Tokens equal the cache-off run's."""
    base = tokens(5, 24)
    c = req("C", base, SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True))
    a = req("A", base + tokens(6, 60))
    b = req("B", base + tokens(6, 60)[:30] + tokens(7, 3))
    eng = make_engine(model, budget=16)
    eng.add(c)
    for _ in range(4):  # C prefilled (2 chunks) and decoding
        eng.step()
    eng.add(a)
    eng.step()  # A reuses C's 6 full prompt pages (24 tokens), prefills 16 more
    seq_a = eng.seqs["A"]
    shared = seq_a.pages[:6]
    assert seq_a.cached_tokens == 24 and seq_a.num_computed == 40
    assert shared == eng.seqs["C"].pages[:6] and all(eng.cache.refcount(p) == 2 for p in shared)
    assert eng.abort("C")
    assert all(eng.cache.refcount(p) == 1 for p in shared)
    eng.step()  # A mid-prefill on pages whose first owner is gone
    assert eng.seqs["A"].num_computed == 56
    assert eng.abort("A")
    assert all(eng.cache.refcount(p) == 0 for p in shared)
    got = run(eng, {0: [b]})["B"]
    assert got["cached"] == 54 // PAGE * PAGE  # B shares 54 tokens with what A computed
    assert got["tokens"] == reference(model, [b])["B"]
    assert_idle(eng)


def test_abort_of_a_waiting_sharer_holding_matched_pages(model):
    """A request that matched cached pages but could not get the rest of its pages, aborted
    while it waits, gives its references back."""
    base = tokens(8, 16)
    eng = make_engine(model, num_pages=12, budget=64)
    run(eng, {0: [req("warm", base)]})
    hog = req("hog", tokens(9, 20), SamplingParams(max_new_tokens=20, temperature=0.0, ignore_eos=True))
    eng.add(hog)
    eng.step()
    eng.add(req("late", base + tokens(10, 20)))  # needs 9 pages; 4 are cached, too few free
    eng.step()
    late = eng.seqs["late"]
    assert late.pages and late.num_computed == 16 and late in eng.scheduler.waiting
    assert eng.abort("late") and eng.abort("hog")
    assert_idle(eng)


def test_flush_while_idle_and_while_busy(model):
    prompt = tokens(11, 20)
    eng = make_engine(model)
    run(eng, {0: [req("a", prompt)]})
    cached = eng.stats().cached_pages
    assert cached > 0
    assert eng.flush_cache() == cached
    assert eng.stats().cached_pages == 0 and eng.stats().free_pages == eng.stats().total_pages
    assert run(eng, {0: [req("b", prompt)]})["b"]["cached"] == 0  # nothing left to reuse

    # busy: c decodes on the cached pages of b's prompt when the cache is flushed
    long = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    ref = reference(model, [req("c", prompt, long)])["c"]
    eng.add(req("c", prompt, long))
    got = []
    for _ in range(3):
        got.extend(o.token_id for o in eng.step())
    seq = eng.seqs["c"]
    assert seq.cached_tokens == 16
    held = list(seq.pages)
    cached_before = eng.stats().cached_pages
    assert eng.flush_cache() == cached_before and eng.stats().cached_pages == 0
    assert all(eng.cache.refcount(p) == 1 for p in held)  # c keeps every page it holds
    while eng.has_work():
        got.extend(o.token_id for o in eng.step())
    assert got == ref  # and finishes as it would alone
    assert_idle(eng)
    # c's prompt pages lost their keys in the flush: a new request finds nothing of them
    assert run(eng, {0: [req("d", prompt)]})["d"]["cached"] == 0
    assert_idle(eng)


def test_prompt_logprobs_requests_compute_every_position(model):
    prompt = tokens(12, 18)
    eng = make_engine(model)
    run(eng, {0: [req("warm", prompt)]})
    out = []
    eng.add(req("lp", prompt, return_logprob=True))
    while eng.has_work():
        out.extend(eng.step())
    first = out[0]
    assert first.cached_tokens == 0 and len(first.input_logprobs) == len(prompt)
    assert all(lp is not None for lp in first.input_logprobs[1:])
    assert_idle(eng)


def test_cache_off_never_reuses(model):
    prompt = tokens(13, 20)
    eng = make_engine(model, cache=False)
    run(eng, {0: [req("a", prompt)]})
    assert run(eng, {0: [req("b", prompt)]})["b"]["cached"] == 0
    s = eng.stats()
    assert s.cached_pages == 0 and s.free_pages == s.total_pages and s.cache.hit_tokens == 0


def test_reserved_pages_come_from_eviction_and_received_prompts_are_cached(model):
    """The decode side: reserve() evicts cached pages rather than failing, and a prompt whose
    KV arrived through add_prefilled is reusable afterwards."""
    eng = make_engine(model, num_pages=10)
    run(eng, {0: [req("fill", tokens(14, 30))]})  # 8 pages computed, cached after it ends
    assert eng.stats().free_pages < 8
    pages = eng.reserve("imp", 32)  # 8 pages: needs eviction
    assert pages is not None and len(pages) == 8 and eng.stats().cache.evicted_pages > 0
    eng.release("imp")
    assert_idle(eng)


def test_reserve_prompt_reuses_and_pins_the_cached_prefix(model):
    """The decode side of KV reuse: reserve_prompt() takes the cached full pages of a prompt
    (pinned: eviction cannot take them while reserved), fresh pages for the rest, and reports
    the key of the last reused page, which a prefill recomputes from the same tokens."""
    from pdserve.core.page_keys import prefix_key

    eng = make_engine(model, num_pages=12)
    first = tokens(15, 18)  # 4 full pages + 2 tokens
    run(eng, {0: [req("turn1", first)]})  # its prompt and output pages are cached now
    second = first + tokens(16, 9)  # 27 tokens: 7 pages, the first 4 (at least) cached
    pages, reused, key = eng.reserve_prompt("turn2", second)
    assert reused >= 4 and len(pages) == 7 and key == prefix_key(second, PAGE, reused)
    assert all(eng.cache.refcount(p) == 1 for p in pages[:reused])
    # the pool is squeezed by another reservation: eviction must not take the pinned pages
    assert eng.reserve("other", (12 - 7) * PAGE) is not None
    assert eng.reserve("more", PAGE) is None
    eng.release("other")
    eng.add_prefilled(req("turn2", second), first_token=5)
    while eng.has_work():
        eng.step()
    assert_idle(eng)
    assert eng.reserve_prompt("cold", tokens(99, 9))[1:] == (0, "")
    eng.release("cold")
    assert_idle(eng)


def test_reserve_prompt_with_the_cache_off_reuses_nothing(model):
    eng = make_engine(model, cache=False)
    run(eng, {0: [req("a", tokens(17, 16))]})
    assert eng.reserve_prompt("b", tokens(17, 16))[1:] == (0, "")
    eng.release("b")
    assert_idle(eng)


def test_a_flush_or_eviction_during_a_handoff_leaves_the_reused_pages_alone(model):
    """Between reserve_prompt() and add_prefilled() the decode's reused pages must keep their KV:
    neither a flush nor allocation pressure may hand them out."""
    eng = make_engine(model, num_pages=10)
    first = tokens(21, 13)
    run(eng, {0: [req("t1", first)]})
    second = first + tokens(22, 3)
    pages, reused, _ = eng.reserve_prompt("t2", second)
    assert reused >= 3
    before = eng.pool.buffer[:, :, pages[:reused]].clone()
    eng.flush_cache()
    squeeze = eng.reserve("squeeze", eng.stats().free_pages * PAGE)  # every page not pinned
    assert squeeze is not None and not set(squeeze) & set(pages)
    assert torch.equal(before, eng.pool.buffer[:, :, pages[:reused]])
    eng.release("squeeze")
    eng.add_prefilled(req("t2", second), first_token=7)
    while eng.has_work():
        eng.step()
    assert_idle(eng)
