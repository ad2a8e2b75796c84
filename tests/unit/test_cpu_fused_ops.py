"""Our fused bf16 CPU ops (engine/cpu_fused_ops.c via engine/cpu_fused.py) against the torch
formulas they replace in model.py: bit-identical at every shape (rows of 64..3072 and odd
widths, 1..517 rows, strided input rows), subnormals kept as torch keeps them; where the CPU or
compiler lacks what they need, load_fused_ops returns None and this module is skipped."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine import cpu_fused, cpu_kernels
from pdserve.engine.model import apply_rope, rms_norm

TS = (1, 3, 32, 517)
NS = (64, 576, 1536, 3072)
EPS = 1e-5


@pytest.fixture(scope="module")
def ops(kernel_cache_dir):
    o = cpu_fused.load_fused_ops(kernel_cache_dir)
    if o is None:
        pytest.skip("no AVX-512 BF16 or AVX2 CPU, or no gcc here: load_fused_ops gave None, the model "
                    "keeps the torch formulas")
    return o


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    """Both torch and the kernels at this many threads (torch's reductions split work by
    thread count, and the kernels parallelize big calls)."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


def _bf16(*shape, g, scale=1.0):
    return (torch.randn(*shape, generator=g) * scale).bfloat16()


def _strided(T, N, g, scale=3.0, pad=24, off=5):
    """[T, N] bf16 rows inside wider rows (row stride N + pad, not 16-byte aligned)."""
    return _bf16(T, N + pad, g=g, scale=scale)[:, off:off + N]


def _same(a: torch.Tensor, b: torch.Tensor) -> int:
    """Number of elements whose bits differ (NaN == NaN)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    return int((a.view(torch.int16) != b.view(torch.int16)).sum())


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("N", NS + (100, 8, 5))
def test_rms_norm_exact(ops, threads, T, N):
    g = torch.Generator().manual_seed(T * 10007 + N)
    x, w = _strided(T, N, g), _bf16(N, g=g)
    got = ops.rms_norm(x, w, EPS)
    assert got.is_contiguous() and got.shape == (T, N)
    assert _same(got, rms_norm(x, w, EPS)) == 0
    assert _same(ops.rms_norm(x.contiguous(), w, EPS), got) == 0


def test_rms_norm_many_rows_exact(ops):
    """The float32 sum of squares in torch's order: a different order (e.g. 16-lane sums, as
    a natural AVX-512 kernel has) flips a bf16 by one ulp in ~1 row of 1500, which the small
    cases above rarely see; ~28k rows here."""
    g = torch.Generator().manual_seed(7)
    for N in (576, 1536):
        x, w = _bf16(300_000 // N * 40, N, g=g, scale=3.0), _bf16(N, g=g)
        assert _same(ops.rms_norm(x, w, 1e-6), rms_norm(x, w, 1e-6)) == 0


def test_rms_norm_extremes(ops):
    """Tiny (subnormal results), huge, zero rows and an eps that dominates."""
    g = torch.Generator().manual_seed(3)
    w = _bf16(576, g=g)
    for scale in (1e-30, 1e-3, 1e3, 1e30):
        x = _bf16(8, 576, g=g, scale=scale)
        for eps in (1e-6, 1e-5, 1.0):
            assert _same(ops.rms_norm(x, w, eps), rms_norm(x, w, eps)) == 0
    z = torch.zeros(2, 576, dtype=torch.bfloat16)
    assert _same(ops.rms_norm(z, w, EPS), rms_norm(z, w, EPS)) == 0
    sub = torch.full((2, 576), 1e-39, dtype=torch.bfloat16)   # subnormal in and out
    assert _same(ops.rms_norm(sub, w, EPS), rms_norm(sub, w, EPS)) == 0


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("N", NS + (100,))
def test_add_rms_norm_exact(ops, threads, T, N):
    g = torch.Generator().manual_seed(T * 7919 + N)
    w = _bf16(N, g=g)
    big = _bf16(T, N + 8, g=g, scale=3.0)
    x = big[:, 8:]                        # residual rows strided too
    d = _strided(T, N, g, scale=1.0)
    want_x = x.clone().add_(d)
    want = rms_norm(want_x, w, EPS)
    before = big[:, :8].clone()
    got = ops.add_rms_norm(x, d, w, EPS)
    assert _same(x, want_x) == 0, "residual add not bit-identical to x.add_(delta)"
    assert _same(got, want) == 0
    assert _same(big[:, :8], before) == 0, "wrote outside x"


@pytest.mark.parametrize("T", TS)
@pytest.mark.parametrize("H,D", [(12, 64), (5, 128), (3, 40)])
def test_rope_exact(ops, threads, T, H, D):
    g = torch.Generator().manual_seed(T * 13 + H * D)
    qkv = _bf16(T, (H + 3) * D, g=g, scale=2.0)
    qk = qkv[:, : H * D].view(T, H, D)                       # rows strided, as in the model
    pos = torch.randint(0, 4096, (T,), generator=g)
    angles = torch.outer(pos.float(), 1.0 / (10000 ** (torch.arange(0, D, 2).float() / D)))
    cos, sin = angles.cos().bfloat16().unsqueeze(1), angles.sin().bfloat16().unsqueeze(1)
    want = apply_rope(qk, cos, sin)
    got = ops.rope(qk, cos, sin)
    assert got.is_contiguous() and got.shape == (T, H, D)
    assert _same(got, want) == 0
    assert _same(ops.rope(qk, cos.squeeze(1), sin.squeeze(1)), want) == 0
    # arbitrary bf16 cos/sin (not on the unit circle): still each op rounded as torch does
    c2, s2 = _bf16(T, 1, D // 2, g=g), _bf16(T, 1, D // 2, g=g)
    assert _same(ops.rope(qk, c2, s2), apply_rope(qk, c2, s2)) == 0


def test_rejects_what_it_cannot_take(ops):
    with pytest.raises(ValueError):
        ops.rms_norm(torch.randn(2, 64), torch.randn(64).bfloat16(), EPS)
    with pytest.raises(ValueError):
        ops.rope(torch.randn(2, 3, 8).bfloat16().transpose(1, 2), torch.randn(2, 1).bfloat16(),
                 torch.randn(2, 1).bfloat16())


def test_loaded_once_and_cached(ops, tmp_path):
    a = cpu_fused.load_fused_ops(str(tmp_path))
    assert a is cpu_fused.load_fused_ops(str(tmp_path))
    assert a.path.exists() and a.path.parent == tmp_path / "kernels"
    cpu_fused.load_fused_ops.cache_clear()
    b = cpu_fused.load_fused_ops(str(tmp_path))
    assert b.path == a.path                                    # not rebuilt: same cached .so


def test_none_without_cpu_support(monkeypatch, tmp_path):
    monkeypatch.setattr(cpu_kernels, "cpu_flags", lambda: frozenset({"sse2"}))
    cpu_fused.load_fused_ops.cache_clear()
    try:
        assert cpu_fused.load_fused_ops(str(tmp_path)) is None
    finally:
        cpu_fused.load_fused_ops.cache_clear()


def test_model_with_fused_ops_is_bit_identical(ops, tmp_path):
    """A bf16 model's prefill and decode hidden states, and a bf16 engine's greedy tokens, are
    the same bits with the fused ops as with the torch formulas."""
    from pdserve.core.sampling import SamplingParams
    from pdserve.engine.attention import AttnBatch
    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.kv_pool import KVPool
    from pdserve.engine.loader import load_model
    from pdserve.engine.sequence import EngineRequest
    from tests.harness.tiny_model import make_tiny_model

    model, cfg = load_model(make_tiny_model(str(tmp_path / "m"), layers=3), torch.bfloat16, "cpu")

    def hidden(fused):
        model.use_fused_ops(fused)
        pool = KVPool(cfg.num_layers, 64, 4, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
        lens, rows = [7, 12], [[0, 1], [2, 3, 4]]
        ids = torch.arange(3, 22)
        pos = torch.cat([torch.arange(7), torch.arange(12)])
        pre = model(ids, pos, AttnBatch.build(lens, lens, rows, 4), pool)
        dec = model(torch.tensor([5, 9]), torch.tensor([7, 12]),
                    AttnBatch.build([8, 13], [1, 1], [[0, 1], [2, 3, 4, 5]], 4), pool)
        return pre, dec, pool.buffer.clone()

    for a, b in zip(hidden(None), hidden(ops)):
        assert torch.equal(a, b)

    def greedy(fused):
        model.use_fused_ops(fused)
        pool = KVPool(cfg.num_layers, 128, 4, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
        engine = Engine(model, pool, EngineConfig(num_pages=128, page_size=4, max_context=512,
                                                  vocab_size=cfg.vocab_size))
        sp = SamplingParams(max_new_tokens=16, temperature=0.0, ignore_eos=True)
        for i in range(4):
            engine.add(EngineRequest(f"r{i}", list(range(3, 10 + 7 * i)), sp))
        out: dict[str, list[int]] = {}
        while engine.has_work():
            for o in engine.step():
                out.setdefault(o.rid, []).append(o.token_id)
        return out

    assert greedy(ops) == greedy(None)
    model.use_fused_ops(None)
