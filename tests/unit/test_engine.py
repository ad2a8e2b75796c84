"""The engine in-process on a tiny random-weight Llama (float32): batching, chunked prefill and
preemption never change greedy tokens; stops, sampling, logprobs (against HF) and every way a
request ends give all pages back. Also the bf16 attention paths against a float32 reference."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pdserve.core.errors import BadRequest  # noqa: E402
from pdserve.core.sampling import SamplingParams  # noqa: E402
from pdserve.engine.attention import AttnBatch, paged_attention  # noqa: E402
from pdserve.engine.engine import Engine, EngineConfig  # noqa: E402
from pdserve.engine.kv_pool import KVPool  # noqa: E402
from pdserve.engine.loader import load_model  # noqa: E402
from pdserve.engine.sequence import EngineRequest  # noqa: E402
from tests.harness.tiny_model import make_tiny_model  # noqa: E402

EOS = 2
GREEDY = SamplingParams(max_new_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(our float32 model, its config, HF's model) on the same weights."""
    path = make_tiny_model(str(tmp_path_factory.mktemp("engine_tiny")))
    model, cfg = load_model(path, torch.float32, "cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, cfg, hf


def make_engine(tiny, num_pages: int = 512, page_size: int = 4, budget: int = 64,
                max_running: int = 64, max_context: int = 512, eos: tuple[int, ...] = (EOS,)) -> Engine:
    model, cfg, _ = tiny
    pool = KVPool(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    ecfg = EngineConfig(num_pages=num_pages, page_size=page_size, max_running=max_running,
                        prefill_budget=budget, max_context=max_context, eos_token_ids=eos,
                        vocab_size=cfg.vocab_size)
    return Engine(model, pool, ecfg)


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    input_logprobs: list | None = None
    finish_reason: dict | None = None
    held_pages: list[int] | None = None


def drive(engine: Engine, arrivals: dict[int, list[EngineRequest]],
          max_steps: int = 5000) -> dict[str, Result]:
    """Add arrivals[k] before step k, step until idle; every request must finish exactly once."""
    results: dict[str, Result] = {}
    step = 0
    while engine.has_work() or any(k >= step for k in arrivals):
        for req in arrivals.get(step, []):
            engine.add(req)
            results[req.rid] = Result()
        for out in engine.step():
            r = results.setdefault(out.rid, Result())
            assert r.finish_reason is None, f"{out.rid} produced output after finishing"
            if out.token_id is not None:
                r.tokens.append(out.token_id)
                r.logprobs.append(out.logprob)
            if out.input_logprobs is not None:
                r.input_logprobs = out.input_logprobs
            if out.finished:
                r.finish_reason, r.held_pages = out.finish_reason, out.held_pages
        step += 1
        assert step < max_steps, f"no progress: stats {engine.stats()}"
    unfinished = [rid for rid, r in results.items() if r.finish_reason is None]
    assert not unfinished, f"requests never finished: {unfinished}"
    return results


def assert_idle(engine: Engine) -> None:
    s = engine.stats()
    assert (s.free_pages + s.cached_pages, s.running, s.waiting, s.held_pages) == (s.total_pages, 0, 0, 0), s
    assert not engine.seqs and not engine.held


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = [1, 2, 3, 5, 7, 9, 12, 16, 17, 25, 31, 40, 47, 60, 75, 90]
    return [torch.randint(3, 400, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)]


def one_at_a_time(tiny, reqs: list[EngineRequest]) -> dict[str, Result]:
    out = {}
    for req in reqs:
        engine = make_engine(tiny)
        out.update(drive(engine, {0: [req]}))
        assert_idle(engine)
    return out


def mixed_requests(n: int = 16, seed: int = 0) -> list[EngineRequest]:
    return [EngineRequest(f"r{i}", p, GREEDY.replace(max_new_tokens=4 + (7 * i) % 29))
            for i, p in enumerate(prompts(n, seed))]


@pytest.fixture(scope="module")
def reference(tiny):
    reqs = mixed_requests()
    return reqs, one_at_a_time(tiny, reqs)


def test_one_at_a_time_matches_hf_generate(tiny, reference):
    _, _, hf = tiny
    reqs, ref = reference
    for req in reqs[::5]:
        n = req.sampling.max_new_tokens
        with torch.no_grad():
            want = hf.generate(torch.tensor([req.prompt_ids]), max_new_tokens=n, do_sample=False,
                               eos_token_id=EOS, pad_token_id=0)[0, len(req.prompt_ids):].tolist()
        assert ref[req.rid].tokens == want, req.rid


@pytest.mark.parametrize("case", ["all_at_once", "staggered", "small_budget", "page_pressure"])
def test_batched_greedy_equals_one_at_a_time(tiny, reference, case):
    reqs, ref = reference
    kw, arrivals = {}, {0: reqs}
    if case == "staggered":  # new prompts join while others decode
        arrivals = {3 * i: [r] for i, r in enumerate(reqs)}
    if case == "small_budget":  # prompts prefilled in chunks of at most 7 tokens, several per step
        kw = dict(budget=7)
    if case == "page_pressure":  # 16 requests need ~4x the pool: decode must preempt and recompute
        kw = dict(num_pages=40, budget=16)
    engine = make_engine(tiny, **kw)
    preempted = []
    original = engine.scheduler.preempt
    engine.scheduler.preempt = lambda seq: (preempted.append(seq.rid), original(seq))[1]
    got = drive(engine, arrivals)
    assert {rid: r.tokens for rid, r in got.items()} == {rid: r.tokens for rid, r in ref.items()}
    assert {rid: r.finish_reason for rid, r in got.items()} == \
        {rid: r.finish_reason for rid, r in ref.items()}
    if case == "page_pressure":
        assert preempted, "the pool was large enough: no preemption happened"
    assert_idle(engine)


def test_partial_prefills_never_block_the_queue(tiny):
    """A prompt part-way through a chunked prefill holds pages; when the queue's head needs them
    (after a preemption) they are taken back instead of stalling the engine for ever. Input
    logprobs survive the recompute."""
    g = torch.Generator().manual_seed(11)
    a = EngineRequest("a", torch.randint(3, 400, (90,), generator=g).tolist(),
                      GREEDY.replace(max_new_tokens=60, ignore_eos=True), return_logprob=True)
    b = EngineRequest("b", torch.randint(3, 400, (75,), generator=g).tolist(),
                      GREEDY.replace(max_new_tokens=5, ignore_eos=True), return_logprob=True)
    ref = one_at_a_time(tiny, [a, b])
    eng = make_engine(tiny, num_pages=40, budget=64)  # 160 tokens: a alone needs 150
    got = drive(eng, {0: [a, b]}, max_steps=2000)
    for rid in ("a", "b"):
        assert got[rid].tokens == ref[rid].tokens
        assert len(got[rid].input_logprobs) == len(ref[rid].input_logprobs)
        torch.testing.assert_close(torch.tensor(got[rid].input_logprobs[1:]),
                                   torch.tensor(ref[rid].input_logprobs[1:]), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(torch.tensor(got[rid].logprobs), torch.tensor(ref[rid].logprobs),
                                   atol=1e-5, rtol=1e-5)
    assert_idle(eng)


def test_stop_conditions(tiny):
    prompt = prompts(4, seed=3)[2]
    base = one_at_a_time(tiny, [EngineRequest("b", prompt, GREEDY.replace(max_new_tokens=12))])["b"].tokens
    target = base[5]
    first = base.index(target)
    # EOS: the engine's eos list; ignore_eos runs on to max_new_tokens
    eng = make_engine(tiny, eos=(target,))
    got = drive(eng, {0: [EngineRequest("eos", prompt, GREEDY.replace(max_new_tokens=12)),
                          EngineRequest("ign", prompt, GREEDY.replace(max_new_tokens=12, ignore_eos=True))]})
    assert got["eos"].tokens == base[:first + 1]
    assert got["eos"].finish_reason == {"type": "stop", "matched": target}
    assert got["ign"].tokens == base and got["ign"].finish_reason == {"type": "length", "length": 12}
    # stop_token_ids stop even with ignore_eos; max_new_tokens (0 too) ends with "length"
    got = drive(eng, {0: [
        EngineRequest("sti", prompt,
                      GREEDY.replace(max_new_tokens=12, stop_token_ids=(target,), ignore_eos=True)),
        EngineRequest("len", prompt, GREEDY.replace(max_new_tokens=3, ignore_eos=True)),
        EngineRequest("zero", prompt, GREEDY.replace(max_new_tokens=0))]})
    assert got["sti"].tokens == base[:first + 1] and got["sti"].finish_reason["matched"] == target
    assert got["len"].tokens == base[:3] and got["len"].finish_reason == {"type": "length", "length": 3}
    assert got["zero"].tokens == [] and got["zero"].finish_reason == {"type": "length", "length": 0}
    assert_idle(eng)


def test_context_limit_and_validation(tiny):
    eng = make_engine(tiny, num_pages=16, page_size=4, max_context=40)
    prompt = prompts(16, seed=4)[14][:30]
    sp = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    got = drive(eng, {0: [EngineRequest("edge", prompt, sp)]})  # exactly the context: allowed
    assert len(got["edge"].tokens) == 10 and got["edge"].finish_reason["type"] == "length"
    bad = {"empty": ([], sp), "past context": (prompt, sp.replace(max_new_tokens=11)),
           "past pool": (prompt[:20], sp.replace(max_new_tokens=20))}
    eng16 = make_engine(tiny, num_pages=8, page_size=4, max_context=40)  # pool: 32 tokens
    for name, (ids, params) in bad.items():
        with pytest.raises(BadRequest):
            (eng16 if name == "past pool" else eng).add(EngineRequest(name, ids, params))
    eng.add(EngineRequest("dup", prompt[:4], sp.replace(max_new_tokens=2)))
    with pytest.raises(BadRequest, match="already in use"):
        eng.add(EngineRequest("dup", prompt[:4], sp))
    assert eng.abort("dup")
    assert_idle(eng)
    assert_idle(eng16)


def test_sampling_seeds_top_k_top_p_min_p(tiny):
    prompt = prompts(2, seed=5)[1]
    sp = SamplingParams(max_new_tokens=16, temperature=1.0, ignore_eos=True)
    ref = one_at_a_time(tiny, [EngineRequest("g", prompt, sp.replace(temperature=0.0))])["g"].tokens
    variants = {"s7": sp.replace(seed=7), "s7b": sp.replace(seed=7), "s8": sp.replace(seed=8),
                "k1": sp.replace(top_k=1, seed=1), "p0": sp.replace(top_p=1e-6, seed=2),
                "m1": sp.replace(min_p=1.0, seed=3),
                "mix": sp.replace(top_k=20, top_p=0.9, min_p=0.05, seed=7)}
    others = [EngineRequest(f"o{i}", p, GREEDY) for i, p in enumerate(prompts(5, seed=6))]
    eng = make_engine(tiny)
    got = drive(eng, {0: [EngineRequest(k, prompt, v) for k, v in variants.items()] + others})
    alone = drive(eng, {0: [EngineRequest("s7", prompt, variants["s7"])]})["s7"].tokens
    assert got["s7"].tokens == got["s7b"].tokens == alone  # a seed reproduces, batched or not
    assert got["s7"].tokens != got["s8"].tokens
    assert got["s7"].tokens != ref  # temperature 1 on O(1) logits does sample
    for k in ("k1", "p0", "m1"):  # each filter that keeps only the top token is greedy
        assert got[k].tokens == ref, k
    assert len(got["mix"].tokens) == 16
    assert_idle(eng)


def test_logprobs_equal_hf_log_softmax(tiny):
    _, _, hf = tiny
    reqs = [EngineRequest(f"lp{i}", p, GREEDY.replace(max_new_tokens=6), return_logprob=True)
            for i, p in enumerate(prompts(16, seed=7)[6::4])]  # 12, 31 and 75 tokens
    eng = make_engine(tiny, budget=5)  # input logprobs assembled across prefill chunks
    got = drive(eng, {0: reqs})
    for req in reqs:
        r = got[req.rid]
        ids = req.prompt_ids + r.tokens
        with torch.no_grad():
            lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        n = len(req.prompt_ids)
        want_in = [None] + [lp[i - 1, ids[i]].item() for i in range(1, n)]
        want_out = [lp[n - 1 + i, t].item() for i, t in enumerate(r.tokens)]
        assert r.input_logprobs[0] is None and len(r.input_logprobs) == n
        torch.testing.assert_close(torch.tensor(r.input_logprobs[1:]), torch.tensor(want_in[1:]),
                                   atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(r.logprobs), torch.tensor(want_out), atol=1e-4, rtol=1e-4)
    assert_idle(eng)


def test_abort_in_every_state_frees_pages(tiny):
    eng = make_engine(tiny, budget=8, num_pages=64)
    ps = prompts(4, seed=8)
    sp = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    for i, p in enumerate([ps[3] * 2, ps[1], ps[2]]):
        eng.add(EngineRequest(f"a{i}", p, sp))
    eng.step()  # a0 is part-way through a chunked prefill; a1, a2 wait
    assert eng.seqs["a0"].pages and 0 < eng.seqs["a0"].num_computed < len(ps[3] * 2)
    assert eng.abort("a0") and eng.abort("a2")
    while not eng.scheduler.running:
        eng.step()
    eng.step()
    assert eng.abort("a1")  # decoding
    assert not eng.abort("a1") and not eng.abort("never-added")
    assert_idle(eng)


def test_hold_reserve_release_and_add_prefilled(tiny, reference):
    """The PD path inside one process: prefill with hold_kv on engine A, copy its pages into
    pages reserved on engine B, continue with add_prefilled: same tokens as colocated."""
    reqs, ref = reference
    a, b = make_engine(tiny, num_pages=128), make_engine(tiny, num_pages=96)
    picked = [r for r in reqs if r.sampling.max_new_tokens > 1][:4]
    held = drive(a, {0: [EngineRequest(r.rid, r.prompt_ids, r.sampling.replace(max_new_tokens=1),
                                       hold_kv=True) for r in picked]})
    assert a.stats().held_pages == sum(len(h.held_pages) for h in held.values()) > 0
    assert b.reserve("too-big", 96 * 4 + 1) is None and b.stats().free_pages == 96
    for r in picked:
        dst = b.reserve(r.rid, len(r.prompt_ids))
        src = held[r.rid].held_pages
        assert len(dst) == len(src) == -(-len(r.prompt_ids) // 4)
        for layer in range(a.pool.num_layers):
            for kind in ("k", "v"):
                sv = getattr(a.pool, kind)(layer).view(128, 4, -1)
                dv = getattr(b.pool, kind)(layer).view(96, 4, -1)
                dv[torch.tensor(dst)] = sv[torch.tensor(src)]
        assert a.release(r.rid) and not a.release(r.rid)
    assert_idle(a)
    b.reserve("reserved-then-released", 10)
    assert b.release("reserved-then-released")
    first = {}
    for r in picked:
        out = b.add_prefilled(r, held[r.rid].tokens[0])
        first[r.rid] = out.token_id
        assert not out.finished
    got = drive(b, {})
    for r in picked:
        assert [first[r.rid]] + got[r.rid].tokens == ref[r.rid].tokens, r.rid
    b.reserve("abandoned", 9)
    assert b.abort("abandoned")  # abort also drops a reservation
    assert_idle(b)


# ---- attention paths in bf16 (the engine tests above run float32) ------------------------

def _reference_attention(q, pool_k, pool_v, slots_per_seq, new_lens):
    """Naive float32 attention per sequence over the given slots (causal for new tokens)."""
    outs, t = [], 0
    G = q.shape[1] // pool_k.shape[1]
    for slots, new in zip(slots_per_seq, new_lens):
        k = pool_k[slots].float().repeat_interleave(G, 1).transpose(0, 1)
        v = pool_v[slots].float().repeat_interleave(G, 1).transpose(0, 1)
        qq = q[t:t + new].float().transpose(0, 1)
        s = qq @ k.transpose(1, 2) / q.shape[-1] ** 0.5
        n = len(slots)
        allowed = torch.arange(n).view(1, n) <= torch.arange(n - new, n).view(new, 1)
        p = torch.softmax(s.masked_fill(~allowed, float("-inf")), -1)
        outs.append((p @ v).transpose(0, 1).reshape(new, -1))
        t += new
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", ["decode_small", "decode_large", "prefill_with_prefix", "prefill_long"])
def test_attention_paths_match_reference(dtype, shape):
    g = torch.Generator().manual_seed(0)
    page, hq, hkv, d = 4, 6, 2, 16
    B = {"decode_small": 3, "decode_large": 11, "prefill_with_prefix": 4, "prefill_long": 2}[shape]
    seq_lens = torch.randint(5, 40, (B,), generator=g).tolist()
    new_lens = [1] * B if shape.startswith("decode") else [min(n, 1 + 3 * i) for i, n in enumerate(seq_lens)]
    if shape == "prefill_with_prefix":
        new_lens[-1] = seq_lens[-1]  # and one fresh prompt (no prefix: the is_causal path)
    if shape == "prefill_long":  # fresh prompts on both sides of GEMM_PREFILL_MAX_LEN
        seq_lens = new_lens = [300, 37]
    pool = KVPool(1, 128, page, hkv, d, dtype)
    perm = torch.randperm(128, generator=g).tolist()
    ends = torch.tensor([-(-n // page) for n in seq_lens]).cumsum(0).tolist()
    rows = [perm[e - -(-n // page):e] for e, n in zip(ends, seq_lens)]
    slots = [torch.tensor([r[j // page] * page + j % page for j in range(n)]) for r, n in zip(rows, seq_lens)]
    for s in slots:  # cached prefix
        pool.k(0)[s] = torch.randn(len(s), hkv, d, generator=g).to(dtype)
        pool.v(0)[s] = torch.randn(len(s), hkv, d, generator=g).to(dtype)
    T = sum(new_lens)
    # slices of one fused projection, as the model passes them (not contiguous)
    qkv = torch.randn(T, hq + 2 * hkv, d, generator=g).to(dtype)
    q, k, v = qkv[:, :hq], qkv[:, hq:hq + hkv], qkv[:, hq + hkv:]
    batch = AttnBatch.build(seq_lens, new_lens, rows, page)
    got = paged_attention(q, k, v, 0, batch, pool)
    want = _reference_attention(q, pool.k(0), pool.v(0), slots, new_lens)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    assert got.dtype == dtype and got.shape == (T, hq * d)
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)
