"""Calibration (engine/calibration.py, cpu_plan.py): the choice follows the timings, a forced
choice wins, the cache is keyed so another CPU measures again, and a measured plan runs. None of
it depends on this host: timings are made up, the host is patched, except the one smoke test."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from pdserve.core.host import HostInfo
from pdserve.engine import calibration as cal
from pdserve.engine.calibration import Candidates, Forced, PlanCache, PlanKey, decide
from pdserve.engine.cpu_kernels import PER_QUERY_ONLY
from pdserve.engine.cpu_plan import PREFILL_BUCKETS, AttentionPaths, CpuPlan, static_plan
from pdserve.engine.cpu_plan import AttentionPath as A
from pdserve.engine.cpu_plan import ElementwisePath as E
from pdserve.engine.linear import NO_KERNELS
from pdserve.engine.linear import MatmulPath as M
from tests.harness.tiny_model import make_tiny_model

CANDS = Candidates((M.ONEDNN, M.TORCH, M.PANEL, M.FLOAT32), (A.KERNEL, A.TORCH, A.TORCH_FP32),
                   (A.KERNEL, A.KERNEL_PER_QUERY, A.TORCH, A.TORCH_FP32), (E.FUSED, E.TORCH))


def _timings(matmul=None, decode=None, prefill=None, elementwise=None) -> cal.Timings:
    t: cal.Timings = {}
    for rows, times in zip(cal.MATMUL_ROWS, matmul or ()):
        t[f"matmul@{rows}"] = times
    if decode:
        t["decode_attention"] = decode
    for limit, times in zip(PREFILL_BUCKETS, prefill or ()):
        t[f"prefill_attention@{limit}"] = times
    if elementwise:
        t["elementwise"] = elementwise
    return t


def test_the_fastest_path_is_chosen_per_decision_and_bucket():
    t = _timings(
        matmul=[{"onednn": 4.0, "torch": 2.0, "panel": 1.0, "float32": 3.0}] * 3,
        decode={"kernel": 1.0, "torch": 3.0, "torch_fp32": 2.0},
        prefill=[{"kernel": 1.0, "kernel_per_query": 2.0, "torch": 3.0, "torch_fp32": 4.0},
                 {"kernel": 5.0, "kernel_per_query": 6.0, "torch": 2.0, "torch_fp32": 4.0},
                 {"kernel": 9.0, "kernel_per_query": 9.5, "torch": 8.0, "torch_fp32": 3.0}],
        elementwise={"fused": 2.0, "torch": 1.0})
    plan = decide(t, CANDS)
    assert plan.matmul is M.PANEL
    assert plan.decode_attention is A.KERNEL
    assert plan.prefill_attention == (A.KERNEL, A.TORCH, A.TORCH_FP32)
    assert plan.elementwise is E.TORCH
    assert "panel fastest" in plan.reasons["matmul"]
    assert "torch_fp32 fastest" in plan.reasons[f"prefill_attention@{PREFILL_BUCKETS[-1]}"]
    assert plan.measured_ms == t
    # each bucket answers for its own KV lengths
    assert plan.prefill_path(1) is A.KERNEL and plan.prefill_path(PREFILL_BUCKETS[0]) is A.KERNEL
    assert plan.prefill_path(PREFILL_BUCKETS[0] + 1) is A.TORCH
    assert plan.prefill_path(10 ** 6) is A.TORCH_FP32


def test_the_default_is_kept_unless_another_is_clearly_faster():
    t = _timings(decode={"kernel": 1.04, "torch": 1.0, "torch_fp32": 3.0})
    plan = decide(t, CANDS)
    assert plan.decode_attention is A.KERNEL and "kept" in plan.reasons["decode_attention"]
    t = _timings(decode={"kernel": 1.2, "torch": 1.0, "torch_fp32": 3.0})
    assert decide(t, CANDS).decode_attention is A.TORCH


def test_matmul_takes_one_path_by_mean_slowdown_over_row_counts():
    # onednn wins big at 256 rows, panel wins small: the mean of time / best decides
    t = _timings(matmul=[{"onednn": 2.0, "panel": 1.0}, {"onednn": 2.0, "panel": 1.0},
                         {"onednn": 1.0, "panel": 3.0}])
    plan = decide(t, Candidates((M.ONEDNN, M.PANEL), (A.TORCH,), (A.TORCH,), (E.TORCH,)))
    assert plan.matmul is M.ONEDNN  # mean 1.33x against panel's 1.67x
    # a candidate cut after being far slower at a smaller size is out of the running
    t = _timings(matmul=[{"onednn": 10.0, "panel": 1.0}, {"panel": 1.0}, {"panel": 5.0}])
    assert decide(t, Candidates((M.ONEDNN, M.PANEL), (A.TORCH,), (A.TORCH,), (E.TORCH,))).matmul is M.PANEL


def test_a_forced_choice_wins_and_an_unavailable_one_is_refused():
    t = _timings(matmul=[{"onednn": 4.0, "torch": 2.0, "panel": 1.0, "float32": 3.0}] * 3,
                 decode={"kernel": 1.0, "torch": 3.0, "torch_fp32": 2.0})
    plan = decide(t, CANDS, Forced(matmul=M.TORCH, prefill_attention=A.TORCH_FP32))
    assert plan.matmul is M.TORCH and "forced by --cpu-matmul" in plan.reasons["matmul"]
    assert plan.prefill_attention == (A.TORCH_FP32,) * len(PREFILL_BUCKETS)
    assert plan.decode_attention is A.KERNEL  # still measured
    few = Candidates((M.TORCH,), (A.TORCH,), (A.TORCH,), (E.TORCH,))
    with pytest.raises(ValueError, match="--cpu-matmul panel is not available here"):
        decide({}, few, Forced(matmul=M.PANEL))
    with pytest.raises(ValueError, match="--cpu-decode-attention kernel"):
        decide({}, few, Forced(decode_attention=A.KERNEL))


def test_one_candidate_or_no_timing_means_the_default():
    plan = decide({}, CANDS)
    assert (plan.matmul, plan.decode_attention, plan.elementwise) == (M.ONEDNN, A.KERNEL, E.FUSED)
    assert "not measured" in plan.reasons["matmul"]
    few = Candidates((M.TORCH,), (A.TORCH,), (A.TORCH,), (E.TORCH,))
    assert decide({}, few).reasons["matmul"] == "torch: the only path here"
    assert static_plan(M.PANEL, False, False).decode_attention is A.TORCH


def test_plan_json_round_trip():
    plan = decide(_timings(decode={"kernel": 2.0, "torch": 1.0, "torch_fp32": 3.0}), CANDS)
    back = CpuPlan.from_json(plan.to_json())
    assert back == plan and back.reasons == plan.reasons and back.measured_ms == plan.measured_ms
    bad = plan.to_json() | {"prefill_buckets": [1, 2]}
    with pytest.raises(ValueError):
        CpuPlan.from_json(bad)


def test_attention_paths_per_step():
    class Kernel:
        tile_min = 0

    kernel = Kernel()
    plan = CpuPlan(M.TORCH, A.KERNEL, (A.KERNEL_PER_QUERY, A.TORCH, A.TORCH_FP32), E.TORCH)
    paths = AttentionPaths(plan, kernel)
    assert paths.for_step(True, 0) == (kernel, None)
    k, dt = paths.for_step(False, 100)
    assert k is not kernel and k.tile_min == PER_QUERY_ONLY and kernel.tile_min == 0 and dt is None
    assert paths.for_step(False, PREFILL_BUCKETS[1]) == (None, None)
    assert paths.for_step(False, PREFILL_BUCKETS[-1] * 4) == (None, torch.float32)
    # no kernel built: a plan naming it falls back to torch
    assert AttentionPaths(plan, None).for_step(True, 0) == (None, None)


# ---- the cache and plan_for ----------------------------------------------------------------------
HOST = HostInfo("Test CPU A", frozenset({"avx2", "fma"}), 2)


def _key(**kw) -> PlanKey:
    base = dict(host=HOST, threads=2, torch_version="2.13.0", kernels="abc", model=("Llama", 64),
                candidates=CANDS)
    return PlanKey(**(base | kw))


def test_the_cache_is_keyed_so_another_cpu_measures_again(tmp_path):
    cache = PlanCache(tmp_path)
    plan = decide(_timings(decode={"kernel": 2.0, "torch": 1.0, "torch_fp32": 3.0}), CANDS)
    cache.store(_key(), plan)
    assert cache.load(_key()) == plan
    others = [_key(host=HostInfo("Test CPU B", HOST.isa_flags, 2)),
              _key(host=HostInfo(HOST.model_name, HOST.isa_flags | {"avx512_bf16"}, 2)),
              _key(threads=1), _key(torch_version="2.14.0"), _key(kernels="def"),
              _key(model=("Llama", 128))]
    digests = {k.digest() for k in others} | {_key().digest()}
    assert len(digests) == len(others) + 1
    for k in others:
        assert cache.load(k) is None
    # a file whose stored key does not match (a hash collision, a hand edit) is not trusted
    (tmp_path / f"{others[0].digest()}.json").write_text((tmp_path / f"{_key().digest()}.json").read_text())
    assert cache.load(others[0]) is None


@pytest.fixture(scope="module")
def tiny_bf16(tmp_path_factory):
    from pdserve.engine.loader import load_model

    path = make_tiny_model(str(tmp_path_factory.mktemp("calib_tiny")))
    model, _ = load_model(path, torch.bfloat16, "cpu", matmul=M.TORCH)
    model.path = path
    return model


def test_plan_for_measures_once_then_reads_the_cache(tmp_path, monkeypatch, tiny_bf16):
    calls = []
    fake = _timings(matmul=[{"torch": 2.0, "float32": 1.0}] * 3,
                    decode={"torch": 1.0, "torch_fp32": 2.0},
                    prefill=[{"torch": 1.0, "torch_fp32": 2.0}] * 3)

    def measure(model, kernel, kernels, fused, cands, which, seed=0):
        calls.append(which)
        return {k: v for k, v in fake.items() if k.split("@")[0] in which}

    monkeypatch.setattr(cal, "measure", measure)
    monkeypatch.setattr(cal.HostInfo, "read", staticmethod(lambda: HOST))
    cache = PlanCache(tmp_path)
    plan = cal.plan_for(tiny_bf16, "cpu", None, NO_KERNELS, None, Forced(), "auto", cache, 2)
    assert calls == [{"matmul", "decode_attention", "prefill_attention"}]
    assert plan.matmul is M.FLOAT32 and plan.decode_attention is A.TORCH
    assert cal.plan_for(tiny_bf16, "cpu", None, NO_KERNELS, None, Forced(), "auto", cache, 2) == plan
    assert len(calls) == 1  # cached
    forced = cal.plan_for(tiny_bf16, "cpu", None, NO_KERNELS, None, Forced(decode_attention=A.TORCH_FP32),
                          "auto", cache, 2)
    assert len(calls) == 1 and forced.decode_attention is A.TORCH_FP32 and forced.matmul is M.FLOAT32
    cal.plan_for(tiny_bf16, "cpu", None, NO_KERNELS, None, Forced(), "redo", cache, 2)
    assert len(calls) == 2
    off = cal.plan_for(tiny_bf16, "cpu", None, NO_KERNELS, None, Forced(), "off", cache, 2)
    assert len(calls) == 2
    assert off.matmul is cal.candidates_for(torch.bfloat16, "cpu", None, NO_KERNELS, None).matmul[0]
    assert "calibration off" in off.reasons["matmul"]
    monkeypatch.setattr(cal.HostInfo, "read", staticmethod(lambda: dataclasses.replace(HOST, model_name="Other")))
    cal.plan_for(tiny_bf16, "cpu", None, NO_KERNELS, None, Forced(), "auto", cache, 2)
    assert len(calls) == 3  # another CPU: measured again
    cal.plan_for(tiny_bf16, "cpu", None, NO_KERNELS, None, Forced(), "auto", cache, 1)
    assert len(calls) == 4  # another thread count too


def test_nothing_is_measured_where_there_is_no_choice(tmp_path, monkeypatch, tiny_bf16):
    monkeypatch.setattr(cal, "measure", lambda *a, **k: pytest.fail("measured"))
    every = Forced(M.TORCH, A.TORCH, A.TORCH, E.TORCH)
    plan = cal.plan_for(tiny_bf16, "cpu", None, NO_KERNELS, None, every, "auto", PlanCache(tmp_path), 2)
    assert plan.matmul is M.TORCH and not list(tmp_path.iterdir())


def test_a_waiting_worker_goes_on_after_the_lock_deadline(tmp_path):
    import fcntl

    cache = PlanCache(tmp_path)
    key = _key()
    tmp_path.mkdir(exist_ok=True)
    with open(tmp_path / f"{key.digest()}.lock", "w") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX)
        with cache.locked(key, timeout_s=0.3):
            assert cache.waited_s >= 0.3


def test_a_real_measurement_on_a_tiny_model_gives_a_plan_that_runs(tmp_path, tiny_bf16, kernel_cache_dir):
    """On this host, whatever it is: every candidate that exists is timed (a few seconds at
    most for a tiny model), the plan names existing paths, and an engine runs with it."""
    import time

    from pdserve.core.sampling import SamplingParams
    from pdserve.engine.cpu_kernels import load_paged_attention
    from pdserve.engine.cpu_matmul import MatmulKernels, load_gemv, load_matmul
    from pdserve.engine.engine import Engine, EngineConfig
    from pdserve.engine.kv_pool import KVPool
    from pdserve.engine.loader import load_model
    from pdserve.engine.sequence import EngineRequest

    kernel = load_paged_attention(kernel_cache_dir)
    kernels = MatmulKernels(load_matmul(kernel_cache_dir), load_gemv(kernel_cache_dir))
    t0 = time.monotonic()
    plan = cal.plan_for(tiny_bf16, "cpu", kernel, kernels, None, Forced(), "auto", PlanCache(tmp_path), 1)
    assert time.monotonic() - t0 < 60
    cands = cal.candidates_for(torch.bfloat16, "cpu", kernel, kernels, None)
    assert plan.matmul in cands.matmul and plan.decode_attention in cands.decode_attention
    assert set(plan.prefill_attention) <= set(cands.prefill_attention)
    assert {f"matmul@{r}" for r in cal.MATMUL_ROWS} <= set(plan.measured_ms)
    model, cfg = load_model(tiny_bf16.path, torch.bfloat16, "cpu", matmul=plan.matmul, kernels=kernels)
    pool = KVPool(cfg.num_layers, 64, 4, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16)
    engine = Engine(model, pool, EngineConfig(num_pages=64, page_size=4, max_context=256,
                                              vocab_size=cfg.vocab_size), "cpu", kernel, plan=plan)
    engine.add(EngineRequest("r", list(range(3, 40)), SamplingParams(max_new_tokens=5, temperature=0.0,
                                                                     ignore_eos=True)))
    out = []
    while engine.has_work():
        out += [o.token_id for o in engine.step() if o.token_id is not None]
    assert len(out) == 5


def test_host_names_the_family_and_model_so_cpus_sold_under_one_name_calibrate_apart(tmp_path):
    def host(family: str, model: str) -> HostInfo:
        f = tmp_path / f"cpuinfo-{family}-{model}"
        f.write_text(f"processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: {model}\n"
                     f"model name\t: AMD EPYC\nstepping\t: 1\nflags\t\t: fpu avx2 fma avx512f avx512_bf16\n")
        return HostInfo.read(str(f))
    zen1, zen5 = host("23", "1"), host("26", "2")
    assert zen5.model_name == "AMD EPYC (family 26 model 2 stepping 1)"
    assert zen5.isa_flags == {"avx2", "fma", "avx512f", "avx512_bf16"}
    assert _key(host=zen1).digest() != _key(host=zen5).digest()


def test_onednn_gemv_is_timed_where_it_differs_from_onednn_only(kernel_cache_dir):
    """Above GEMV_ROWS onednn_gemv runs oneDNN's code: it takes oneDNN's timing there, so the
    choice between them turns on the rows where our kernel runs, not on noise."""
    from pdserve.engine.calibration_measure import measure_matmul
    from pdserve.engine.cpu_matmul import GEMV_ROWS, MatmulKernels, load_gemv
    from pdserve.engine.linear import can_pack

    gemv = load_gemv(kernel_cache_dir)
    if gemv is None or not can_pack(torch.bfloat16, "cpu"):
        pytest.skip("no AVX-512 BF16 kernel or oneDNN bf16 here")
    g = torch.Generator().manual_seed(0)
    weights = [(torch.randn(96, 64, generator=g).bfloat16(), None)]
    t = measure_matmul(weights, (M.ONEDNN, M.ONEDNN_GEMV), MatmulKernels(gemv=gemv), g)
    for rows in cal.MATMUL_ROWS:
        row = t[f"matmul@{rows}"]
        assert "onednn_gemv" in row
        if rows > GEMV_ROWS and "onednn" in row:  # (a candidate far behind at fewer rows is dropped)
            assert row["onednn_gemv"] == row["onednn"]
