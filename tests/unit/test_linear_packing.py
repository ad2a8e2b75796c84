"""The matmul paths (engine/linear.py): oneDNN's packed weights bit-identical to F.linear in
bfloat16 at every row count, used only where exact, the plain copies freed, and a bf16 engine's
greedy tokens, sampled tokens and logprobs unchanged by packing; our AVX2 panel kernel within
bf16 rounding of float64 and batch-invariant; which paths exist where."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pdserve.core.sampling import SamplingParams  # noqa: E402
from pdserve.engine.cpu_matmul import GEMV_ROWS, MatmulKernels, load_gemv, load_matmul  # noqa: E402
from pdserve.engine.engine import Engine, EngineConfig  # noqa: E402
from pdserve.engine.kv_pool import KVPool  # noqa: E402
from pdserve.engine.linear import (  # noqa: E402
    MatmulPath,
    PackedLinear,
    PlainLinear,
    available_paths,
    can_pack,
    default_path,
    make_linear,
)
from pdserve.engine.loader import load_model  # noqa: E402
from pdserve.engine.sequence import EngineRequest  # noqa: E402
from tests.harness.tiny_model import make_tiny_model  # noqa: E402

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
    assert model.matmul is MatmulPath.TORCH
    assert available_paths(torch.float32, "cpu", MatmulKernels(panel=object(), gemv=object())) == [MatmulPath.TORCH]
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
    packed, cfg = load_model(tiny_path, torch.bfloat16, "cpu", matmul=MatmulPath.ONEDNN)
    plain, _ = load_model(tiny_path, torch.bfloat16, "cpu", matmul=MatmulPath.TORCH)
    assert packed.matmul is MatmulPath.ONEDNN and plain.matmul is MatmulPath.TORCH
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


# ---- our panel kernel (cpu_matmul.c) -------------------------------------------------------------
@pytest.fixture(scope="module")
def panel(kernel_cache_dir):
    k = load_matmul(kernel_cache_dir)
    if k is None:
        pytest.skip("no AVX2+FMA CPU or no gcc here: load_matmul gave None")
    return MatmulKernels(panel=k)


def _bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """What bf16 output rounding (half an ulp: 2^-9 relative, 2^-8 to be safe at binade edges)
    plus a float32 sum of K products (K * 2^-24 of the sum of |products|) can move a result."""
    ref = x.double() @ w.double().T + (0 if b is None else b.double())
    mag = x.double().abs() @ w.double().abs().T
    return ref, ref.abs() * 2.0 ** -8 + mag * x.shape[1] * 2.0 ** -24 + 1e-30


@pytest.mark.parametrize("n,k", [(3072, 576), (37, 70), (16, 8), (200, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_panel_within_bf16_rounding_of_float64(panel, n, k, bias):
    g = torch.Generator().manual_seed(n * k)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    lin = make_linear(MatmulPath.PANEL, w, b, panel)
    for rows in (1, 2, 3, 4, 5, 6, 7, 13, 64):
        x = torch.randn(rows, k, generator=g).bfloat16()
        y = lin(x)
        assert y.dtype is torch.bfloat16 and y.shape == (rows, n)
        ref, tol = _bound(x, w, b)
        assert ((y.double() - ref).abs() <= tol).all(), (rows, (y.double() - ref).abs().max())


def test_panel_is_batch_and_thread_invariant(panel):
    """A row's output bits depend on nothing but the row: not on its batch, its place in it,
    the row count (whose register blocks differ) or the thread count."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(130, 96, generator=g).bfloat16()
    lin = make_linear(MatmulPath.PANEL, w, None, panel)
    x = torch.randn(40, 96, generator=g).bfloat16()
    alone = torch.cat([lin(x[i:i + 1]) for i in range(40)])
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for rows in (2, 3, 5, 6, 7, 12, 40):
                assert torch.equal(lin(x[:rows]), alone[:rows]), (threads, rows)
            assert torch.equal(lin(x[7:19]), alone[7:19])
    finally:
        torch.set_num_threads(before)


def test_panel_takes_strided_rows_and_nan(panel):
    g = torch.Generator().manual_seed(5)
    w = torch.randn(48, 32, generator=g).bfloat16()
    lin = make_linear(MatmulPath.PANEL, w, None, panel)
    wide = torch.randn(9, 64, generator=g).bfloat16()
    assert torch.equal(lin(wide[:, :32]), lin(wide[:, :32].contiguous()))
    x = torch.randn(2, 32, generator=g).bfloat16()
    x[1, 3] = float("nan")
    y = lin(x)
    assert not y[0].isnan().any() and y[1].isnan().all()


# ---- our few-row kernel (cpu_gemv.c) beside oneDNN ------------------------------------------------
@pytest.fixture(scope="module")
def gemv(kernel_cache_dir):
    k = load_gemv(kernel_cache_dir)
    if k is None or not can_pack(torch.bfloat16, "cpu"):
        pytest.skip("no AVX-512 BF16 CPU, no gcc or no oneDNN bf16 here")
    return MatmulKernels(gemv=k)


@pytest.mark.parametrize("n,k", [(3072, 576), (37, 70), (9, 31), (200, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_gemv_within_bf16_rounding_of_float64(gemv, n, k, bias):
    """Up to GEMV_ROWS rows on our kernel (any K: its tail is a masked load), more on oneDNN."""
    g = torch.Generator().manual_seed(n * k + 1)
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    lin = make_linear(MatmulPath.ONEDNN_GEMV, w, b, gemv)
    assert lin.path is MatmulPath.ONEDNN_GEMV
    for rows in (1, 2, 3, 17):
        x = torch.randn(rows, k, generator=g).bfloat16()
        y = lin(x)
        assert y.dtype is torch.bfloat16 and y.shape == (rows, n)
        ref, tol = _bound(x, w, b)
        assert ((y.double() - ref).abs() <= tol).all(), (rows, (y.double() - ref).abs().max())


def test_gemv_rows_go_to_our_kernel_and_the_rest_to_onednn(gemv, monkeypatch):
    w = torch.randn(40, 64).bfloat16()
    lin = make_linear(MatmulPath.ONEDNN_GEMV, w, None, gemv)
    seen: list[int] = []
    real = gemv.gemv.linear
    monkeypatch.setattr(gemv.gemv, "linear", lambda x, *a: seen.append(x.shape[0]) or real(x, *a))
    for rows in range(1, GEMV_ROWS + 3):
        lin(torch.randn(rows, 64).bfloat16())
    assert seen == list(range(1, GEMV_ROWS + 1))


def test_gemv_takes_strided_rows_and_nan(gemv):
    g = torch.Generator().manual_seed(6)
    w = torch.randn(48, 32, generator=g).bfloat16()
    lin = make_linear(MatmulPath.ONEDNN_GEMV, w, None, gemv)
    wide = torch.randn(2, 64, generator=g).bfloat16()
    assert torch.equal(lin(wide[:, :32]), lin(wide[:, :32].contiguous()))
    x = torch.randn(2, 32, generator=g).bfloat16()
    x[1, 3] = float("nan")
    y = lin(x)
    assert not y[0].isnan().any() and y[1].isnan().all()


def test_paths_where_they_exist(panel):
    bf16 = available_paths(torch.bfloat16, "cpu", panel)
    assert bf16[0] is MatmulPath.TORCH and MatmulPath.PANEL in bf16 and MatmulPath.FLOAT32 in bf16
    assert (MatmulPath.ONEDNN in bf16) == can_pack(torch.bfloat16, "cpu")
    assert MatmulPath.PANEL not in available_paths(torch.bfloat16, "cpu")
    assert MatmulPath.ONEDNN_GEMV not in bf16  # the few-row kernel was not given
    assert available_paths(torch.bfloat16, "cuda", panel) == [MatmulPath.TORCH]
    assert default_path(torch.bfloat16, "cpu", panel) is (
        MatmulPath.ONEDNN if can_pack(torch.bfloat16, "cpu") else MatmulPath.PANEL)
    with pytest.raises(ValueError, match="panel"):
        make_linear(MatmulPath.PANEL, torch.zeros(4, 4, dtype=torch.bfloat16), None)
    with pytest.raises(ValueError, match="onednn_gemv"):
        make_linear(MatmulPath.ONEDNN_GEMV, torch.zeros(4, 4, dtype=torch.bfloat16), None)


@pytest.mark.parametrize("path", [MatmulPath.PANEL, MatmulPath.FLOAT32, MatmulPath.ONEDNN_GEMV])
def test_bf16_engine_on_each_path_frees_plain_weights_and_runs(tiny_path, panel, gemv, path):
    """The whole model on the path: its plain weights freed (a tied lm_head keeps the
    embedding), greedy output within bf16 noise of F.linear's (same tokens on this tiny model)."""
    plain, cfg = load_model(tiny_path, torch.bfloat16, "cpu", matmul=MatmulPath.TORCH)
    other, _ = load_model(tiny_path, torch.bfloat16, "cpu", matmul=path,
                          kernels=MatmulKernels(panel.panel, gemv.gemv))
    assert other.matmul is path
    assert other.layers[0].gate_up_proj.numel() == 0 and other.embed_tokens.numel() > 0
    with pytest.raises(RuntimeError, match="already on"):
        other.use_matmul(MatmulPath.TORCH)
    greedy = SamplingParams(max_new_tokens=10, temperature=0.0, ignore_eos=True)
    def reqs() -> list[EngineRequest]:
        return [EngineRequest(f"r{i}", p, greedy) for i, p in enumerate([[5, 9, 11], list(range(3, 30))])]
    a, b = _run(plain, cfg, reqs()), _run(other, cfg, reqs())
    assert [t for t, _ in a.values()] == [t for t, _ in b.values()]
