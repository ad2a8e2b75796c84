"""Packed matmul weights (engine/linear.py): bit-identical to F.linear in bfloat16 at every row
count, used only where exact, the plain copies freed, and a bf16 engine's greedy tokens,
sampled tokens and logprobs unchanged by packing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tiny_model import make_tiny_model  # noqa: E402

from pdserve.core.sampling import SamplingParams  # noqa: E402
from pdserve.engine.engine import Engine, EngineConfig  # noqa: E402
from pdserve.engine.kv_pool import KVPool  # noqa: E402
from pdserve.engine.linear import PackedLinear, PlainLinear, can_pack  # noqa: E402
from pdserve.engine.loader import load_model  # noqa: E402
from pdserve.engine.sequence import EngineRequest  # noqa: E402

needs_pack = pytest.mark.skipif(not can_pack(torch.bfloat16, "cpu"),
                                reason="this torch build has no oneDNN bf16 linear")


def test_can_pack_only_where_exact():
    assert not can_pack(torch.float32, "cpu")
    assert not can_pack(torch.float16, "cpu")
    assert not can_pack(torch.bfloat16, "meta")


@needs_pack
@pytest.mark.parametrize("rows", [1, 2, 7, 32, 129])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_equals_plain_bitwise(rows, bias):
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(200, 96, generator=g).bfloat16()
    b = torch.randn(200, generator=g).bfloat16() if bias else None
    x = torch.randn(rows, 96, generator=g).bfloat16()
    packed, plain = PackedLinear(w, b), PlainLinear(w, b)
    assert torch.equal(packed(x), plain(x))
    wide = torch.randn(rows, 192, generator=g).bfloat16()[:, ::2]  # a strided input
    assert torch.equal(packed(wide), F.linear(wide, w, b))


def test_plain_linear_sees_in_place_updates():
    w = torch.zeros(3, 4)
    lin = PlainLinear(w)
    w.copy_(torch.ones(3, 4))
    assert torch.equal(lin(torch.ones(1, 4)), torch.full((1, 3), 4.0))


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return make_tiny_model(str(tmp_path_factory.mktemp("packing_tiny")))


def test_float32_models_are_never_packed(tiny_path):
    model, _ = load_model(tiny_path, torch.float32, "cpu")
    assert not model.packed and not model.pack_weights()
    assert model.layers[0].qkv_proj.numel() > 0


def _run(model, cfg, requests: list[EngineRequest]) -> dict[str, tuple[list[int], list[float]]]:
    pool = KVPool(cfg.num_layers, 256, 4, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    engine = Engine(model, pool, EngineConfig(num_pages=256, page_size=4, max_running=16,
                                              prefill_budget=32, max_context=512,
                                              eos_token_ids=(), vocab_size=cfg.vocab_size))
    for r in requests:
        engine.add(r)
    out: dict[str, tuple[list[int], list[float]]] = {r.rid: ([], []) for r in requests}
    while engine.has_work():
        for o in engine.step():
            if o.token_id is not None:
                out[o.rid][0].append(o.token_id)
                out[o.rid][1].append(o.logprob)
    assert engine.cache.available == 256
    return out


@needs_pack
def test_bf16_engine_output_unchanged_by_packing(tiny_path):
    packed, cfg = load_model(tiny_path, torch.bfloat16, "cpu")
    plain, _ = load_model(tiny_path, torch.bfloat16, "cpu", pack=False)
    assert packed.packed and not plain.packed
    assert packed.layers[0].gate_up_proj.numel() == 0  # the plain copy is freed
    assert packed.embed_tokens.numel() > 0  # embeddings stay (tied lm_head has its own copy)

    def requests():
        greedy = SamplingParams(max_new_tokens=12, temperature=0.0, ignore_eos=True)
        sampled = SamplingParams(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
        prompts = [[5, 9, 11], list(range(3, 40)), [7] * 13, [100, 3]]
        return [EngineRequest(f"r{i}", p, greedy if i % 2 == 0 else sampled, return_logprob=True)
                for i, p in enumerate(prompts)] + [EngineRequest("long", [4, 5, 6], longer)]

    # "long" decodes alone at the end: one-row steps, where the unpacked engine turns oneDNN off
    longer = SamplingParams(max_new_tokens=30, temperature=0.0, ignore_eos=True)
    got_packed, got_plain = _run(packed, cfg, requests()), _run(plain, cfg, requests())
    assert got_packed == got_plain
