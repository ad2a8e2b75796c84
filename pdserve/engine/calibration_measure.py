"""Calibration's measurements: each candidate path timed on the model's own shapes (engine/
calibration.py decides from these timings and caches the plan).

Each candidate runs round robin within a time budget and keeps its least disturbed time, since
what others do on the machine only ever adds time; a candidate far behind at a smaller size is
not tried at a larger one.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import torch

from .attention import AttnBatch, paged_attention
from .cpu_matmul import GEMV_ROWS, MatmulKernels
from .cpu_plan import PREFILL_BUCKETS, AttentionPath, AttentionPaths, CpuPlan, ElementwisePath
from .kv_pool import KVPool
from .linear import MatmulPath, make_linear

if TYPE_CHECKING:
    from .calibration import Candidates

MATMUL_ROWS = (1, 16, 256)  # decode of one and of a batch, a prefill chunk
DECODE_SEQS, DECODE_KV = 16, 384
# new tokens of the measured prefill chunk per bucket: the cost per token at that KV length,
# at a size where our kernel tiles as it would for a 512-token chunk (a whole one is 1 s at 8k)
PREFILL_CHUNKS = (512, 256, 128)
REPEATS = 7
BUDGET_MS = 400.0  # per decision and size, after the warm-up run
SLOW_CUTOFF = 4.0  # a candidate this many times the best at a smaller size is not tried larger

# timings: decision key (e.g. "matmul@16", "prefill_attention@2048") -> candidate value -> ms
Timings = dict[str, dict[str, float]]


# ---- measuring -----------------------------------------------------------------------------------
def _time_ms(fns: dict[str, Callable[[], object]], budget_ms: float = BUDGET_MS) -> dict[str, float]:
    """Each fn run once to warm up (and to size the rounds), then round robin (drift hits all
    alike) as many rounds as fit budget_ms, 1 to REPEATS; the minimum of each, in ms: the
    least disturbed run, since what others do on the machine only ever adds time."""
    warm: dict[str, float] = {}
    for k, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        warm[k] = (time.perf_counter() - t0) * 1e3
    rounds = max(1, min(REPEATS, int(budget_ms / max(sum(warm.values()), 1e-3))))
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], (time.perf_counter() - t0) * 1e3)
    return best


def _survivors(cands: tuple, last: dict[str, float] | None) -> tuple:
    """The candidates measured last time and within SLOW_CUTOFF of the best there."""
    if not last:
        return cands
    best = min(last.values())
    return tuple(c for c in cands if c.value in last and last[c.value] <= best * SLOW_CUTOFF)


def measure_matmul(weights: list[tuple[torch.Tensor, torch.Tensor | None]], paths: tuple[MatmulPath, ...],
                   kernels: MatmulKernels, g: torch.Generator) -> Timings:
    """One decoder layer's matmuls (its real weights) per path at each of MATMUL_ROWS."""
    lins = {p: [make_linear(p, w, b, kernels) for w, b in weights] for p in paths}
    out: Timings = {}
    last = None
    for rows in MATMUL_ROWS:
        xs = [torch.randn(rows, w.shape[1], generator=g).to(w.dtype) for w, _ in weights]
        alive = _survivors(paths, last)
        same_as_onednn = rows > GEMV_ROWS and MatmulPath.ONEDNN in alive  # onednn_gemv runs oneDNN here
        last = _time_ms({p.value: (lambda ls=lins[p]: [lin(x) for lin, x in zip(ls, xs)])
                         for p in alive if not (same_as_onednn and p is MatmulPath.ONEDNN_GEMV)})
        if same_as_onednn and MatmulPath.ONEDNN_GEMV in alive:
            last[MatmulPath.ONEDNN_GEMV.value] = last[MatmulPath.ONEDNN.value]
        out[f"matmul@{rows}"] = last
    return out


def _attention_case(pool: KVPool, q, k, v, lens, new, paths: AttentionPaths, decode: bool):
    rows, at = [], 0
    ps = pool.page_size
    for n in lens:
        rows.append(list(range(at, at + -(-n // ps))))
        at += len(rows[-1])
    kernel, cd = paths.for_step(decode, max(lens))

    def run():
        batch = AttnBatch.build(lens, new, rows, ps, kernel=kernel, compute_dtype=cd)
        return paged_attention(q, k, v, 0, batch, pool)
    return run


def measure_attention(hq: int, hkv: int, d: int, dtype: torch.dtype, kernel, decode_paths: tuple,
                      prefill_paths: tuple, g: torch.Generator) -> Timings:
    """One layer's attention: a decode step of DECODE_SEQS sequences, and for each prefill
    bucket one chunk of PREFILL_CHUNKS new tokens whose KV reaches the bucket's limit."""
    top = PREFILL_BUCKETS[-1]
    pool = KVPool(1, -(-(top + DECODE_SEQS * DECODE_KV) // 16) + DECODE_SEQS + 1, 16, hkv, d, dtype)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=g).to(dtype))

    def qkv(t):
        return (torch.randn(t, hq, d, generator=g).to(dtype), torch.randn(t, hkv, d, generator=g).to(dtype),
                torch.randn(t, hkv, d, generator=g).to(dtype))

    def plan(path: AttentionPath) -> AttentionPaths:
        p = CpuPlan(MatmulPath.TORCH, path, (path,) * len(PREFILL_BUCKETS), ElementwisePath.TORCH)
        return AttentionPaths(p, kernel)

    out: Timings = {}
    if len(decode_paths) > 1:
        lens = [DECODE_KV + i * 7 for i in range(DECODE_SEQS)]
        q, k, v = qkv(DECODE_SEQS)
        out["decode_attention"] = _time_ms({
            p.value: _attention_case(pool, q, k, v, lens, [1] * DECODE_SEQS, plan(p), True)
            for p in decode_paths})
    if len(prefill_paths) > 1:
        last = None
        for limit, new in zip(PREFILL_BUCKETS, PREFILL_CHUNKS):
            q, k, v = qkv(new)
            alive = _survivors(prefill_paths, last)
            last = _time_ms({p.value: _attention_case(pool, q, k, v, [limit], [new], plan(p), False)
                             for p in alive})
            out[f"prefill_attention@{limit}"] = last
    return out


def measure_elementwise(fused, torch_ops, hidden: int, hq: int, hkv: int, d: int,
                        g: torch.Generator) -> Timings:
    """rms_norm, add + rms_norm and RoPE at 32 and 512 rows, our fused ops against torch's."""
    cases = []
    for rows in (32, 512):
        x = torch.randn(rows, hidden, generator=g).bfloat16()
        delta = torch.randn(rows, hidden, generator=g).bfloat16()
        w = torch.randn(hidden, generator=g).bfloat16()
        qk = torch.randn(rows, hq + hkv, d, generator=g).bfloat16()
        cos = torch.randn(rows, 1, d // 2, generator=g).bfloat16()
        sin = torch.randn(rows, 1, d // 2, generator=g).bfloat16()
        cases.append((x, delta, w, qk, cos, sin))

    def run(ops):
        def fn():
            for x, delta, w, qk, cos, sin in cases:
                ops.rms_norm(x, w, 1e-5)
                ops.add_rms_norm(x.clone(), delta, w, 1e-5)
                ops.rope(qk, cos, sin)
        return fn
    return {"elementwise": _time_ms({ElementwisePath.FUSED.value: run(fused),
                                       ElementwisePath.TORCH.value: run(torch_ops)})}


def measure(model, kernel, kernels: MatmulKernels, fused, cands: Candidates, which: set[str], seed: int = 0) -> Timings:
    """Timings for the decisions in `which`, on the model's own shapes (and layer 0's weights)."""
    g = torch.Generator().manual_seed(seed)
    cfg, out = model.cfg, {}
    if "matmul" in which:
        layer = model.layers[0]
        weights = [(lin.weight, lin.bias) for lin in (layer.qkv, layer.o) + (
            (layer.gate_up, layer.down) if layer.moe is None else ())]
        out.update(measure_matmul(weights, cands.matmul, kernels, g))
    if which & {"decode_attention", "prefill_attention"}:
        out.update(measure_attention(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.dtype, kernel,
            cands.decode_attention if "decode_attention" in which else (),
            cands.prefill_attention if "prefill_attention" in which else (), g))
    if "elementwise" in which:
        out.update(measure_elementwise(fused, model.torch_ops, cfg.hidden_size, cfg.num_heads,
                                       cfg.num_kv_heads, cfg.head_dim, g))
    return out
