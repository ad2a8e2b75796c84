"""Top logprobs and prompt logprobs in the engine: k sorted alternatives per token, for the whole
batch at once, of the model's raw distribution (HF's log_softmax on the same weights), the chosen
token's logprob equal to its entry among them; prompt logprobs skip the prefix cache; a
prefilled request continued elsewhere carries the prefill's alternatives and prompt logprobs."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

from pdserve.core.errors import BadRequest  # noqa: E402
from pdserve.core.logprobs import PromptLogprobs  # noqa: E402
from pdserve.core.sampling import SamplingParams  # noqa: E402
from pdserve.engine.engine import Engine, EngineConfig  # noqa: E402
from pdserve.engine.kv_pool import KVPool  # noqa: E402
from pdserve.engine.loader import load_model  # noqa: E402
from pdserve.engine.logprobs import logprobs_of  # noqa: E402
from pdserve.engine.sequence import EngineRequest  # noqa: E402
from tests.harness.tiny_model import make_tiny_model  # noqa: E402

GREEDY = SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True)


def assert_sorted_and_consistent(alts, k: int, token: int, lp: float) -> None:
    assert len(alts) == k
    vals = [v for _, v in alts]
    assert vals == sorted(vals, reverse=True)
    assert len({t for t, _ in alts}) == k
    hit = [v for t, v in alts if t == token]
    if hit:
        assert hit[0] == lp  # the same row of the same tensor: exactly equal
    else:
        assert lp <= vals[-1]


def test_logprobs_of_the_batch_against_log_softmax():
    torch.manual_seed(0)
    logits = torch.randn(5, 50) * 4
    ref = torch.log_softmax(logits.double(), dim=-1)
    tokens = torch.tensor([int(logits[0].argmax()), 7, int(logits[2].argsort()[-2]), 3, int(logits[4].argmin())])
    tops = [1, 0, 3, 20, 5]
    chosen, alts = logprobs_of(logits, tokens, tops)
    assert alts[1] is None
    for i, k in enumerate(tops):
        assert chosen[i] == pytest.approx(ref[i, tokens[i]].item(), abs=1e-5)
        if k == 0:
            continue
        assert_sorted_and_consistent(alts[i], k, int(tokens[i]), chosen[i])
        want = torch.topk(ref[i], k)
        assert [t for t, _ in alts[i]] == want.indices.tolist()
        torch.testing.assert_close(torch.tensor([v for _, v in alts[i]], dtype=torch.double), want.values,
                                   atol=1e-5, rtol=0)
    assert alts[0][0][0] == int(tokens[0])  # greedy's token is the first alternative
    # bf16 logits: the same answer as their float32 copy
    half = logits.bfloat16()
    assert logprobs_of(half, tokens, tops) == logprobs_of(half.float(), tokens, tops)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = make_tiny_model(str(tmp_path_factory.mktemp("logprobs_tiny")))
    model, cfg = load_model(path, torch.float32, "cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return model, cfg, hf


def make_engine(tiny, budget: int = 64) -> Engine:
    model, cfg, _ = tiny
    pool = KVPool(cfg.num_layers, 256, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32)
    return Engine(model, pool, EngineConfig(num_pages=256, page_size=4, prefill_budget=budget,
                                            max_context=512, eos_token_ids=(2,), vocab_size=cfg.vocab_size))


def run(eng: Engine, reqs: list[EngineRequest]) -> dict[str, list]:
    for r in reqs:
        eng.add(r)
    outs: dict[str, list] = {r.rid: [] for r in reqs}
    for _ in range(500):
        if not eng.has_work():
            break
        for o in eng.step():
            outs[o.rid].append(o)
    assert all(o and o[-1].finished for o in outs.values())
    return outs


def hf_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)


def prompt(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


def test_engine_top_logprobs_are_the_raw_distribution_for_every_row(tiny):
    """One batch: greedy rows with k = 0, 3, 20, and rows whose sampler differs from the raw
    distribution (a logit_bias that forces a token, seeded temperature sampling with a penalty):
    their alternatives and logprobs are still the model's raw ones."""
    _, cfg, hf = tiny
    vocab = cfg.vocab_size
    biased = GREEDY.replace(logit_bias=((5, 100.0),))
    sampled = SamplingParams(max_new_tokens=6, temperature=1.3, seed=11, ignore_eos=True, presence_penalty=1.0)
    reqs = [EngineRequest("k0", prompt(1, 9, vocab), GREEDY, True, top_logprobs=0),
            EngineRequest("k3", prompt(2, 14, vocab), GREEDY, True, top_logprobs=3),
            EngineRequest("k20", prompt(3, 5, vocab), GREEDY, True, top_logprobs=20),
            EngineRequest("bias", prompt(4, 7, vocab), biased, True, top_logprobs=4),
            EngineRequest("temp", prompt(5, 11, vocab), sampled, True, top_logprobs=6),
            EngineRequest("none", prompt(6, 8, vocab), GREEDY, False, top_logprobs=0)]
    outs = run(make_engine(tiny), reqs)
    for req in reqs:
        steps = outs[req.rid]
        tokens = [o.token_id for o in steps]
        if not req.return_logprob:
            assert all(o.logprob is None and o.top_logprobs is None for o in steps)
            continue
        ref = hf_logprobs(hf, req.prompt_ids + tokens)
        n = len(req.prompt_ids)
        for i, o in enumerate(steps):
            row = ref[n - 1 + i]
            assert o.logprob == pytest.approx(row[o.token_id].item(), abs=1e-4)
            if req.top_logprobs == 0:
                assert o.top_logprobs is None
                continue
            assert_sorted_and_consistent(o.top_logprobs, req.top_logprobs, o.token_id, o.logprob)
            want = torch.topk(row, req.top_logprobs).values
            torch.testing.assert_close(torch.tensor([v for _, v in o.top_logprobs], dtype=torch.double), want,
                                       atol=1e-4, rtol=0)
            if req.sampling.greedy and not req.sampling.logit_bias:
                assert o.top_logprobs[0][0] == o.token_id
        if req.rid == "bias":
            assert tokens == [5] * 6 and any(t != 5 for t, _ in steps[0].top_logprobs[:1])


def test_prompt_logprobs_with_alternatives_skip_the_prefix_cache(tiny):
    """An echo request (max_new_tokens 0) after the same prompt was cached: every position is
    computed (cached_tokens 0), first entry None, the rest k alternatives equal to HF's; a
    logprobs-without-prompt request of the same prompt does use the cache."""
    _, cfg, hf = tiny
    p = prompt(9, 23, cfg.vocab_size)
    eng = make_engine(tiny, budget=8)  # prompt logprobs assembled across prefill chunks
    run(eng, [EngineRequest("warm", p, GREEDY)])
    echo = EngineRequest("echo", p, GREEDY.replace(max_new_tokens=0), True, top_logprobs=3,
                         prompt_logprobs=PromptLogprobs.IN_REPLY)
    (o,), = run(eng, [echo]).values()
    assert o.finished and o.token_id is None and o.cached_tokens == 0
    assert len(o.input_logprobs) == len(p) and o.input_logprobs[0] is None
    assert len(o.input_top_logprobs) == len(p) and o.input_top_logprobs[0] is None
    ref = hf_logprobs(hf, p)
    for i in range(1, len(p)):
        assert o.input_logprobs[i] == pytest.approx(ref[i - 1, p[i]].item(), abs=1e-4)
        assert_sorted_and_consistent(o.input_top_logprobs[i], 3, p[i], o.input_logprobs[i])
        assert [t for t, _ in o.input_top_logprobs[i]] == torch.topk(ref[i - 1], 3).indices.tolist()
    only_out = EngineRequest("out", p, GREEDY.replace(max_new_tokens=2), True, top_logprobs=2,
                             prompt_logprobs=PromptLogprobs.NONE)
    steps = run(eng, [only_out])["out"]
    assert steps[0].cached_tokens > 0 and all(s.input_logprobs is None for s in steps)
    assert all(len(s.top_logprobs) == 2 for s in steps)


def test_add_prefilled_carries_the_prefill_logprobs(tiny):
    """A decode continuing a prefilled request: the first output is the prefill's token with its
    logprob and alternatives, and the prompt's logprobs when given; max_new_tokens 0 ends at once
    with no token (echo of the prompt only) and frees the pages."""
    _, cfg, _ = tiny
    eng = make_engine(tiny)
    p = prompt(12, 10, cfg.vocab_size)
    prompt_lps = [None] + [-1.0] * (len(p) - 1)
    prompt_top = [None] + [[(1, -0.5)]] * (len(p) - 1)
    free = eng.stats().free_pages
    assert eng.reserve("zero", len(p))
    o = eng.add_prefilled(EngineRequest("zero", p, GREEDY.replace(max_new_tokens=0), True, top_logprobs=1),
                          7, -0.25, [(7, -0.25)], prompt_lps, prompt_top)
    assert o.finished and o.token_id is None and o.finish_reason == {"type": "length", "length": 0}
    assert (o.input_logprobs, o.input_top_logprobs) == (prompt_lps, prompt_top)
    assert eng.stats().free_pages + eng.stats().cached_pages == free
    assert eng.reserve("one", len(p))
    o = eng.add_prefilled(EngineRequest("one", p, GREEDY.replace(max_new_tokens=1), True, top_logprobs=1),
                          7, -0.25, [(7, -0.25)])
    assert o.finished and (o.token_id, o.logprob, o.top_logprobs, o.input_logprobs) == (7, -0.25, [(7, -0.25)], None)


def test_top_logprobs_out_of_range_is_refused(tiny):
    eng = make_engine(tiny)
    with pytest.raises(BadRequest, match="top_logprobs=21"):
        eng.add(EngineRequest("big", [3, 4, 5], GREEDY, True, top_logprobs=21))


def test_kv_done_carries_the_alternatives_over_the_wire():
    import msgspec

    from pdserve.disagg.wire import KvDone, from_wire, to_wire
    done = KvDone(room=7, prefill_rank=0, first_token=5, first_logprob=-0.5, first_top_logprobs=[(5, -0.5), (9, -1.5)],
                  input_logprobs=[None, -2.0], input_top_logprobs=[None, [(3, -1.0)]])
    back = from_wire(msgspec.msgpack.decode(msgspec.msgpack.encode(to_wire(done))))
    assert back == done and back.first_top_logprobs[1] == (9, -1.5)
