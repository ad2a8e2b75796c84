"""Logit processors in the sampler (logit_bias, min_new_tokens, repetition / frequency /
presence penalties) against a plain per-element reference of their formulas, on random logits
for mixed batches (rows with and without processors, greedy and seeded); then in the engine
against HF transformers' own processors, and through the PD path (prefill with hold_kv, then
add_prefilled) against colocated."""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch

from pdserve.core.errors import BadRequest
from pdserve.core.sampling import SamplingParams
from pdserve.engine import sampler as sampler_mod
from pdserve.engine.sampler import TokenHistory, _sample_row, make_generator, process_logits, sample

V = 300
EOS = (2, 7)


def reference_row(row: torch.Tensor, p: SamplingParams, prompt: list[int], generated: list[int],
                  eos: tuple[int, ...]) -> torch.Tensor:
    """The formulas one token at a time (vLLM's order): bias, min tokens, repetition (prompt +
    generated), frequency * count + presence * [count > 0] (generated)."""
    x = row.float().clone()
    for t, b in p.logit_bias:
        x[t] += b
    if len(generated) < p.min_new_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos)):
            x[t] = -math.inf
    if p.repetition_penalty != 1.0:
        for t in set(prompt) | set(generated):
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t, c in Counter(generated).items():
        x[t] -= p.frequency_penalty * c + p.presence_penalty * (1 if c > 0 else 0)
    return x


def random_params(rng: random.Random, base: SamplingParams) -> SamplingParams:
    kind = rng.choice(["none", "none", "rep", "freq", "pres", "bias", "min", "all"])
    kw: dict = {}
    if kind in ("rep", "all"):
        kw["repetition_penalty"] = rng.choice([0.5, 1.3, 2.0])
    if kind in ("freq", "all"):
        kw["frequency_penalty"] = rng.uniform(-2, 2)
    if kind in ("pres", "all"):
        kw["presence_penalty"] = rng.uniform(-2, 2)
    if kind in ("bias", "all"):
        kw["logit_bias"] = tuple(sorted({rng.randrange(V): rng.uniform(-100, 100) for _ in range(5)}.items()))
    if kind in ("min", "all"):
        kw["min_new_tokens"] = rng.randrange(1, 12)
        kw["stop_token_ids"] = (rng.randrange(V),)
        kw["ignore_eos"] = rng.random() < 0.3
    return base.replace(**kw)


def random_batch(seed: int, n: int, base: SamplingParams):
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n, V, generator=g) * 3
    params, prompts, gens, hists = [], [], [], []
    for _ in range(n):
        p = random_params(rng, base)
        prompt = [rng.randrange(V) for _ in range(rng.randrange(1, 40))]
        gen = [rng.randrange(V) for _ in range(rng.randrange(0, 15))]
        gen += gen[:3]  # some repeats
        h = TokenHistory.for_params(prompt, p)
        for t in gen:
            if h is not None:
                h.append(t)
        params.append(p)
        prompts.append(prompt)
        gens.append(gen)
        hists.append(h)
    return logits, params, prompts, gens, hists


@pytest.mark.parametrize("seed", range(6))
def test_processed_logits_equal_the_reference(seed):
    logits, params, prompts, gens, hists = random_batch(seed, 16, SamplingParams(temperature=0.0))
    rows = [i for i, p in enumerate(params) if p.processes_logits]
    assert rows and len(rows) < len(params)
    raw = logits.clone()
    got = process_logits(logits, rows, params, hists, EOS)
    assert torch.equal(logits, raw)  # the input is not modified
    for j, i in enumerate(rows):
        want = reference_row(logits[i], params[i], prompts[i], gens[i], EOS)
        assert torch.equal(torch.isinf(got[j]), torch.isinf(want)), i
        fin = torch.isfinite(want)
        torch.testing.assert_close(got[j][fin], want[fin], rtol=1e-6, atol=1e-5)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_mixed_batch_takes_argmax_after_processing(seed, dtype):
    logits, params, prompts, gens, hists = random_batch(100 + seed, 16, SamplingParams(temperature=0.0))
    logits = logits.to(dtype)
    got = sample(logits, params, [None] * 16, hists, EOS)
    for i, p in enumerate(params):
        ref = reference_row(logits[i], p, prompts[i], gens[i], EOS) if p.processes_logits else logits[i].float()
        assert int(got[i]) == int(ref.argmax()), (i, p)
    # processed rows do change the choice somewhere (the test is not vacuous)
    assert any(int(got[i]) != int(logits[i].float().argmax()) for i, p in enumerate(params) if p.processes_logits)


@pytest.mark.parametrize("seed", range(4))
def test_seeded_sampling_mixed_batch_matches_reference(seed):
    base = SamplingParams(temperature=0.8, top_k=50, top_p=0.9)
    logits, params, prompts, gens, hists = random_batch(200 + seed, 12, base)
    params = [p.replace(seed=1000 + i, temperature=0.0 if i % 5 == 4 else p.temperature)
              for i, p in enumerate(params)]
    got = sample(logits, params, [make_generator(p.seed) for p in params], hists, EOS)
    for i, p in enumerate(params):
        ref = reference_row(logits[i], p, prompts[i], gens[i], EOS) if p.processes_logits else logits[i]
        want = int(ref.argmax()) if p.greedy else _sample_row(ref, p, make_generator(p.seed))
        assert int(got[i]) == want, (i, p)


def test_logit_bias_forces_and_forbids():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=g).to(torch.bfloat16)
    top = logits.float().argmax(-1)
    low = logits.float().argmin(-1)
    second = logits.float().topk(2, dim=-1).indices[:, 1]
    params = [SamplingParams(temperature=0.0, logit_bias=((int(low[0]), 100.0),)),         # force
              SamplingParams(temperature=0.0, logit_bias=((int(top[1]), -100.0),)),        # forbid
              SamplingParams(temperature=0.0)]                                              # untouched
    hists = [TokenHistory.for_params([1], p) for p in params]
    got = sample(logits, params, [None] * 3, hists)
    assert got.tolist() == [int(low[0]), int(second[1]), int(top[2])]
    # sampled (temperature 1): a +100 bias wins every draw, a -100 bias never drawn
    hot = [SamplingParams(seed=s, logit_bias=((5, 100.0),)) for s in range(20)]
    hist = [TokenHistory.for_params([1], p) for p in hot]
    got = sample(torch.zeros(20, V), hot, [make_generator(p.seed) for p in hot], hist)
    assert got.tolist() == [5] * 20
    ban = [SamplingParams(seed=s, logit_bias=tuple((t, -100.0) for t in range(V - 1))) for s in range(20)]
    got = sample(torch.zeros(20, V), ban, [make_generator(p.seed) for p in ban],
                 [TokenHistory.for_params([1], p) for p in ban])
    assert got.tolist() == [V - 1] * 20


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_min_new_tokens_blocks_eos_and_stop_ids_exactly_until_the_count(ignore_eos):
    """EOS 2 and stop id 9 are the two best tokens every step; min_new_tokens=5 masks both for
    exactly the first 5 tokens (with ignore_eos EOS is not masked, as vLLM)."""
    logits = torch.zeros(1, V)
    logits[0, 2], logits[0, 9], logits[0, 40] = 5.0, 4.0, 3.0
    p = SamplingParams(temperature=0.0, min_new_tokens=5, stop_token_ids=(9,), ignore_eos=ignore_eos)
    h = TokenHistory.for_params([1, 2, 3], p)
    seen = []
    for _ in range(8):
        t = int(sample(logits, [p], [None], [h], (2,))[0])
        seen.append(t)
        h.append(t)
    assert seen == ([2] * 8 if ignore_eos else [40] * 5 + [2] * 3)


def test_no_processor_costs_nothing(monkeypatch):
    """A batch where no row asks for a processor never reaches process_logits, needs no
    histories, and keeps the bf16 greedy fast path."""
    def boom(*a, **k):
        raise AssertionError("process_logits ran for a batch without processors")
    monkeypatch.setattr(sampler_mod, "process_logits", boom)
    logits = torch.randn(4, V).to(torch.bfloat16)
    plain = [SamplingParams(temperature=0.0)] * 4
    assert sample(logits, plain, [None] * 4).tolist() == logits.float().argmax(-1).tolist()
    assert sample(logits, plain, [None] * 4, [None] * 4, EOS).tolist() == logits.float().argmax(-1).tolist()
    assert TokenHistory.for_params([1, 2], SamplingParams()) is None
    assert not SamplingParams(repetition_penalty=1.0, presence_penalty=0.0).processes_logits


def test_token_history_grows_and_keeps_the_prompt_only_for_repetition():
    h = TokenHistory([5, 6, 7], keep_prompt=True, capacity=4)
    for t in range(40):
        h.append(t)
    assert h.all_tokens().tolist() == [5, 6, 7] + list(range(40))
    assert h.generated().tolist() == list(range(40)) and h.num_generated == 40
    h = TokenHistory.for_params([5, 6, 7], SamplingParams(frequency_penalty=1.0))
    h.append(9)
    assert h.all_tokens().tolist() == [9] and h.num_generated == 1


def test_out_of_vocab_ids_are_skipped_not_crashing():
    """stop_token_ids past the vocabulary (accepted by the API: they can never be sampled) and
    history ids outside it never index out of range."""
    p = SamplingParams(temperature=0.0, min_new_tokens=2, stop_token_ids=(V + 5,), repetition_penalty=1.5,
                       logit_bias=((V + 1, 5.0),))
    h = TokenHistory.for_params([1, 2], p)
    assert sample(torch.randn(1, V), [p], [None], [h], (V + 9,)).shape == (1,)


# ---- in the engine: against HF transformers, and through the PD path ----------------------

transformers = pytest.importorskip("transformers")

from pdserve.engine.engine import Engine, EngineConfig  # noqa: E402
from pdserve.engine.kv_pool import KVPool  # noqa: E402
from pdserve.engine.loader import load_model  # noqa: E402
from pdserve.engine.sequence import EngineRequest  # noqa: E402
from tests.harness.tiny_model import make_tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("penalty_tiny")))
    model, cfg = load_model(path, torch.float32, "cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, cfg, hf


def make_engine(tiny, eos: tuple[int, ...], num_pages: int = 256) -> Engine:
    model, cfg, _ = tiny
    pool = KVPool(cfg.num_layers, num_pages, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    return Engine(model, pool, EngineConfig(num_pages=num_pages, page_size=4, prefill_budget=64,
                                            max_context=512, eos_token_ids=eos, vocab_size=cfg.vocab_size))


def run_all(engine: Engine, reqs: list[EngineRequest]) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {r.rid: [] for r in reqs}
    for r in reqs:
        engine.add(r)
    steps = 0
    while engine.has_work():
        for o in engine.step():
            if o.token_id is not None:
                out[o.rid].append(o.token_id)
        steps += 1
        assert steps < 2000
    return out


PROMPTS = [[5, 9, 9, 30, 31, 5, 9], [100, 101, 102], [7] * 12, [250, 3, 250, 3, 250]]


def hf_greedy(hf, prompt: list[int], n: int, eos: int, **kw) -> list[int]:
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                          pad_token_id=0, **kw)
    return out[0, len(prompt):].tolist()


def test_repetition_penalty_and_min_new_tokens_equal_hf(tiny):
    """Greedy with repetition_penalty (prompt + generated, HF's definition) and with
    min_new_tokens (EOS masked) equals HF generate's own processors, batched together with
    rows without processors."""
    _, _, hf = tiny
    plain = make_engine(tiny, (2,))
    free = run_all(plain, [EngineRequest(f"p{i}", p, SamplingParams(max_new_tokens=10, temperature=0.0,
                                                                    ignore_eos=True))
                           for i, p in enumerate(PROMPTS)])
    eos = free["p0"][2]  # a token the model produces early: EOS for the min_new_tokens case
    engine = make_engine(tiny, (eos,))
    reqs = []
    for i, p in enumerate(PROMPTS):
        reqs.append(EngineRequest(f"rep{i}", p, SamplingParams(max_new_tokens=12, temperature=0.0,
                                                               repetition_penalty=1.8, ignore_eos=True)))
        reqs.append(EngineRequest(f"min{i}", p, SamplingParams(max_new_tokens=12, temperature=0.0,
                                                               min_new_tokens=6)))
        reqs.append(EngineRequest(f"none{i}", p, SamplingParams(max_new_tokens=12, temperature=0.0)))
    got = run_all(engine, reqs)
    changed = 0
    for i, p in enumerate(PROMPTS):
        want = hf_greedy(hf, p, 12, -1, repetition_penalty=1.8)
        assert got[f"rep{i}"] == want, i
        want_min = hf_greedy(hf, p, 12, eos, min_new_tokens=6)
        assert got[f"min{i}"] == want_min, i
        assert got[f"none{i}"] == hf_greedy(hf, p, 12, eos), i
        assert eos not in got[f"min{i}"][:6]
        changed += got[f"rep{i}"][:10] != free[f"p{i}"]
    assert changed  # the penalty changed some greedy continuation
    assert got["min0"] != got["none0"]  # min_new_tokens delayed an EOS


def test_logit_bias_vocabulary_is_checked_by_the_engine(tiny):
    _, cfg, _ = tiny
    engine = make_engine(tiny, (2,))
    with pytest.raises(BadRequest, match="logit_bias token id"):
        engine.add(EngineRequest("x", [1, 2], SamplingParams(logit_bias=((cfg.vocab_size, 1.0),))))
    engine.add(EngineRequest("y", [1, 2], SamplingParams(max_new_tokens=2, logit_bias=((cfg.vocab_size - 1, 1.0),))))


PD_CASES = {
    "repetition": SamplingParams(max_new_tokens=14, temperature=0.0, repetition_penalty=1.7, ignore_eos=True),
    "frequency": SamplingParams(max_new_tokens=14, temperature=0.0, frequency_penalty=2.0, ignore_eos=True),
    "presence": SamplingParams(max_new_tokens=14, temperature=0.0, presence_penalty=2.0, ignore_eos=True),
    "min_tokens": SamplingParams(max_new_tokens=14, temperature=0.0, min_new_tokens=8),
    "mixed": SamplingParams(max_new_tokens=14, temperature=0.0, repetition_penalty=1.2, frequency_penalty=0.7,
                            presence_penalty=-0.3, min_new_tokens=3, logit_bias=((11, 3.0),)),
}


@pytest.mark.parametrize("case", list(PD_CASES))
def test_pd_path_equals_colocated(tiny, case):
    """The prefill runs the prompt with max_new_tokens=1 (worker/prefill.py): its first token
    sees the prompt for repetition_penalty and counts 0 generated tokens; the decode's sequence
    (add_prefilled) starts from that first token, so its counts include it."""
    sp = PD_CASES[case]
    probe = run_all(make_engine(tiny, (2,)), [EngineRequest("p", PROMPTS[0], SamplingParams(
        max_new_tokens=6, temperature=0.0, ignore_eos=True))])["p"]
    eos = (probe[1],)  # EOS early in the plain greedy output, so min_new_tokens matters
    colo = run_all(make_engine(tiny, eos), [EngineRequest(f"c{i}", p, sp) for i, p in enumerate(PROMPTS)])
    a, b = make_engine(tiny, eos, 128), make_engine(tiny, eos, 128)
    held = {}
    for i, p in enumerate(PROMPTS):
        a.add(EngineRequest(f"c{i}", p, sp.replace(max_new_tokens=1), hold_kv=True))
    while a.has_work():
        for o in a.step():
            if o.finished:
                held[o.rid] = (o.token_id, o.held_pages)
    got = {}
    for i, p in enumerate(PROMPTS):
        rid = f"c{i}"
        first, src = held[rid]
        dst = b.reserve(rid, len(p))
        for layer in range(a.pool.num_layers):
            for kind in ("k", "v"):
                sv = getattr(a.pool, kind)(layer).view(128, 4, -1)
                dv = getattr(b.pool, kind)(layer).view(128, 4, -1)
                dv[torch.tensor(dst)] = sv[torch.tensor(src)]
        a.release(rid)
        out = b.add_prefilled(EngineRequest(rid, p, sp), first)
        assert out.token_id == first
        got[rid] = [first]
        if not out.finished:  # the decode's counts include the prefill's first token
            h = b.seqs[rid].history
            assert h.num_generated == 1 and (not h.store or h.generated().tolist() == [first])
    steps = 0
    while b.has_work():
        for o in b.step():
            if o.token_id is not None:
                got[o.rid].append(o.token_id)
        steps += 1
        assert steps < 2000
    assert got == colo
    plain = run_all(make_engine(tiny, eos), [EngineRequest(f"c{i}", p, sp.replace(
        repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0, min_new_tokens=0, logit_bias=()))
        for i, p in enumerate(PROMPTS)])
    assert colo != plain  # each field changes some output here
