"""`pdserve bench kernels`: our C kernels against the torch code they replace, per call.

SmolLM2-135M shapes (9 query heads, 3 KV heads, head_dim 64, hidden 576, 30 layers), bf16.
Attention: one step over all 30 layers of a pool far bigger than cache, pages handed out in
order as the engine's allocator does: a decode step of 32 sequences and a prefill step of 32
fresh prompts. Norms and RoPE: one call at 32 and 512 rows. Torch and ours alternate, medians
of the repeats, ratio = torch time / ours.

Long prompts (--long-prompts): one layer's attention over one fresh prompt of 1k-8k tokens,
the torch path, our kernel one query at a time (its path before tiling; still the one for
decode and short chunks) and tiled (query blocks x key blocks). --model-prefill MODEL: the
whole model's prefill of one prompt per length in an engine (default chunking, 512 tokens a
step, and one chunk of the whole prompt), split into matmuls, attention and the rest.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from ..engine.attention import AttnBatch, paged_attention
from ..engine.cpu_fused import load_fused_ops
from ..engine.cpu_kernels import PER_QUERY_ONLY, TILE_TWO_PASS, load_paged_attention
from ..engine.kv_pool import KVPool
from ..engine.model import TorchOps

HQ, HKV, D, HIDDEN, LAYERS, PAGE = 9, 3, 64, 576, 30, 16


def _median_ms(fns: dict, repeats: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def _attention_cases(kernel, g: torch.Generator) -> list[tuple[str, object, object]]:
    pool = KVPool(LAYERS, 1024, PAGE, HKV, D, torch.bfloat16)  # 377 MB: 10x the L3 cache
    for layer in pool.buffer:
        layer.copy_(torch.randn(layer.shape, generator=g).bfloat16())
    cases = []
    for label, lens, new in (
            ("decode step, 32 seqs of 17-192", torch.randint(17, 193, (32,), generator=g).tolist(), 1),
            ("prefill step, 32 prompts of 16-127", torch.randint(16, 128, (32,), generator=g).tolist(), None)):
        rows, at = [], 0
        for n in lens:
            rows.append(list(range(at, at + -(-n // PAGE))))
            at += len(rows[-1])
        new_lens = [1] * len(lens) if new == 1 else lens
        T = sum(new_lens)
        qkv = torch.randn(T, (HQ + 2 * HKV) * D, generator=g).bfloat16()
        q = qkv[:, :HQ * D].view(T, HQ, D)
        k = qkv[:, HQ * D:(HQ + HKV) * D].view(T, HKV, D)
        v = qkv[:, (HQ + HKV) * D:].view(T, HKV, D)

        def step(kern, lens=lens, new_lens=new_lens, rows=rows, q=q, k=k, v=v):
            batch = AttnBatch.build(lens, new_lens, rows, PAGE, kernel=kern)
            for layer in range(LAYERS):
                paged_attention(q, k, v, layer, batch, pool)
        cases.append((f"attention: {label} (30 layers)", lambda s=step: s(None),
                      lambda s=step: s(kernel)))
    return cases


def _fused_cases(ops, g: torch.Generator) -> list[tuple[str, object, object]]:
    cases = []
    for T in (32, 512):
        x = torch.randn(T, HIDDEN, generator=g).bfloat16()
        d = torch.randn(T, HIDDEN, generator=g).bfloat16() * 0.01
        w = torch.randn(HIDDEN, generator=g).bfloat16()
        qk = torch.randn(T, (HQ + 2 * HKV) * D, generator=g).bfloat16()[:, :(HQ + HKV) * D]
        qk = qk.view(T, HQ + HKV, D)
        cos = torch.randn(T, 1, D // 2, generator=g).bfloat16()
        sin = torch.randn(T, 1, D // 2, generator=g).bfloat16()
        xa, xb = x.clone(), x.clone()  # add_rms_norm updates them in place
        cases += [
            (f"rms_norm, {T} rows", lambda x=x, w=w: TorchOps.rms_norm(x, w, 1e-5),
             lambda x=x, w=w: ops.rms_norm(x, w, 1e-5)),
            (f"residual add + rms_norm, {T} rows",
             lambda xa=xa, d=d, w=w: TorchOps.add_rms_norm(xa, d, w, 1e-5),
             lambda xb=xb, d=d, w=w: ops.add_rms_norm(xb, d, w, 1e-5)),
            (f"rope q+k, {T} rows", lambda qk=qk, c=cos, s=sin: TorchOps.rope(qk, c, s),
             lambda qk=qk, c=cos, s=sin: ops.rope(qk, c, s)),
        ]
    return cases


def _per_query(kernel):
    """The kernel with tiling off: every query over its keys alone (the path before tiling)."""
    k = copy.copy(kernel)
    k.tile_min = PER_QUERY_ONLY
    return k


def _long_prefill(kernel, g: torch.Generator, lengths: list[int], repeats: int) -> None:
    """One layer's attention over one fresh prompt of n tokens: torch / per-query / tiled
    (online softmax, the default) / tiled two-pass (HF's rounding points)."""
    print("\nlong prompt prefill, one layer's attention (median ms per call)")
    print(f"{'prompt tokens':<16}{'reps':>5}{'torch':>10}{'per-query':>11}{'tiled':>9}"
          f"{'2-pass':>9}{'per-query/tiled':>17}{'torch/tiled':>13}")
    per_query = _per_query(kernel)
    two_pass = copy.copy(kernel)
    two_pass.tile_flags = TILE_TWO_PASS
    for n in lengths:
        pages = -(-n // PAGE)
        pool = KVPool(1, pages + 1, PAGE, HKV, D, torch.bfloat16)
        pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=g).bfloat16())
        rows = [list(range(pages))]
        qkv = torch.randn(n, (HQ + 2 * HKV) * D, generator=g).bfloat16()
        q = qkv[:, :HQ * D].view(n, HQ, D)
        k = qkv[:, HQ * D:(HQ + HKV) * D].view(n, HKV, D)
        v = qkv[:, (HQ + HKV) * D:].view(n, HKV, D)
        fns = {name: (lambda b=AttnBatch.build([n], [n], rows, PAGE, kernel=kern):
                      paged_attention(q, k, v, 0, b, pool))
               for name, kern in (("torch", None), ("per-query", per_query), ("tiled", kernel),
                                  ("2-pass", two_pass))}
        reps = max(min(repeats, 3), round(repeats * (1024 / n) ** 2))
        t = _median_ms(fns, reps) if reps > 1 else _once_ms(fns)
        print(f"{n:<16}{reps:>5}{t['torch']:>10.2f}{t['per-query']:>11.2f}{t['tiled']:>9.2f}"
              f"{t['2-pass']:>9.2f}{t['per-query'] / t['tiled']:>17.2f}"
              f"{t['torch'] / t['tiled']:>13.2f}", flush=True)


def _once_ms(fns: dict) -> dict[str, float]:
    out = {}
    for k, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        out[k] = (time.perf_counter() - t0) * 1e3
    return out


class _Timed:
    """Wraps a callable, adding its wall time to totals[key]."""

    def __init__(self, fn, totals: dict, key: str):
        self.fn, self.totals, self.key = fn, totals, key

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.totals[self.key] += time.perf_counter() - t0


def _model_prefill(model: str, threads: int, lengths: list[int], repeats: int) -> None:
    """Whole-model prefill (prompt in, first token out) of one prompt per length in an engine,
    at 512 tokens a step (the default --chunked-prefill-size) and in one chunk: attention as
    tiled (ours), per query (ours, before tiling) and torch; medians, split into matmuls (the
    model's linears and lm_head), attention (paged_attention) and the rest (norms, RoPE,
    embedding, sampling, scheduling)."""
    from ..core.config import ServerConfig
    from ..core.envs import Envs
    from ..core.sampling import SamplingParams
    from ..engine import model as model_module
    from ..engine.sequence import EngineRequest
    from ..model_files.resolve import resolve_model
    from ..worker.setup import build_engine

    model_dir = resolve_model(model, Envs.read().cache_dir)
    totals = {"attention": 0.0, "matmul": 0.0}
    engines = {}
    for chunk in (512, max(lengths)):
        cfg = ServerConfig(model=model_dir, dtype="bfloat16", num_threads=threads,
                           max_total_tokens=65536, chunked_prefill_size=chunk,
                           disable_prefix_cache=True)
        engine, mcfg, _ = build_engine(cfg, model_dir)
        for layer in engine.model.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                setattr(layer, name, _Timed(getattr(layer, name), totals, "matmul"))
        engine.model.head = _Timed(engine.model.head, totals, "matmul")
        engines[chunk] = engine
    kernel = engines[512].attention_kernel
    if kernel is None:
        raise SystemExit("the engine has no attention kernel here")
    saved = model_module.paged_attention
    model_module.paged_attention = _Timed(saved, totals, "attention")
    g = torch.Generator().manual_seed(1)
    variants = {"tiled": kernel, "per-query": _per_query(kernel), "torch": None}
    print(f"\nwhole-model prefill, {model} bf16, threads={threads} (median ms over {repeats}; "
          f"matmul / attention / rest)")
    print(f"{'prompt':>7}{'chunk':>7}  " + "".join(f"{v:>28}" for v in variants))
    try:
        for n in lengths:
            for chunk, engine in engines.items():
                if chunk != 512 and chunk < n:
                    continue
                runs = {v: [] for v in variants}
                for rep in range(repeats + 1):  # the first round warms up
                    for name, kern in variants.items():
                        engine.attention_kernel = kern
                        prompt = torch.randint(100, mcfg.vocab_size, (n,), generator=g).tolist()
                        engine.add(EngineRequest(f"p{n}-{chunk}-{rep}-{name}", prompt,
                                                 SamplingParams(max_new_tokens=1, temperature=0.0,
                                                                ignore_eos=True)))
                        totals.update(attention=0.0, matmul=0.0)
                        t0 = time.perf_counter()
                        while engine.has_work():
                            engine.step()
                        total = time.perf_counter() - t0
                        if rep:
                            runs[name].append((total, totals["matmul"], totals["attention"]))
                engine.attention_kernel = kernel
                cells = []
                for name in variants:
                    tot, mm, at = (statistics.median(r[i] for r in runs[name]) * 1e3 for i in range(3))
                    cells.append(f"{tot:7.0f} = {mm:5.0f} /{at:5.0f} /{tot - mm - at:4.0f}")
                label = chunk if chunk == 512 else n
                print(f"{n:>7}{label:>7}  " + "".join(f"{c:>28}" for c in cells), flush=True)
    finally:
        model_module.paged_attention = saved


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="pdserve bench kernels")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--cache-dir", default="", help="where kernels are built (default as for models)")
    p.add_argument("--long-prompts", default="1024,2048,4096,8192",
                   help="prompt lengths for one layer's long-prompt prefill ('' = none)")
    p.add_argument("--model-prefill", default="", metavar="MODEL",
                   help="also time the whole model's prefill in an engine (e.g. smollm2-135m)")
    p.add_argument("--model-prompts", default="1024,2048,4096,8191",
                   help="prompt lengths for --model-prefill (8191: the default model's context "
                        "holds 8192 tokens, the prompt and its first output)")
    p.add_argument("--model-repeats", type=int, default=3)
    a = p.parse_args(argv)
    import os

    from ..model_files.resolve import cache_root

    torch.set_num_threads(a.threads or os.cpu_count() or 1)
    kernel = load_paged_attention(cache_root(a.cache_dir))
    ops = load_fused_ops(cache_root(a.cache_dir))
    if kernel is None or ops is None:
        raise SystemExit("our kernels do not build on this machine (they need an AVX-512 BF16 CPU "
                         "and gcc); the engine uses torch here, so there is nothing to compare")
    g = torch.Generator().manual_seed(0)
    print(f"threads={torch.get_num_threads()} repeats={a.repeats} (median ms per call)")
    print(f"{'case':<58}{'torch':>9}{'ours':>9}{'ratio':>8}")
    for label, torch_fn, ours_fn in _attention_cases(kernel, g) + _fused_cases(ops, g):
        reps = a.repeats if label.startswith("attention") else a.repeats * 20
        t = _median_ms({"torch": torch_fn, "ours": ours_fn}, reps)
        print(f"{label:<58}{t['torch']:>9.3f}{t['ours']:>9.3f}{t['torch'] / t['ours']:>7.2f}x",
              flush=True)
    lengths = [int(n) for n in a.long_prompts.split(",") if n.strip()]
    if lengths:
        _long_prefill(kernel, g, lengths, a.repeats)
    if a.model_prefill:
        _model_prefill(a.model_prefill, torch.get_num_threads(),
                       [int(n) for n in a.model_prompts.split(",") if n.strip()], a.model_repeats)


if __name__ == "__main__":
    main()
