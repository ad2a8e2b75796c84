"""`pdserve bench kernels`: our C kernels against the torch code they replace, per call.

SmolLM2-135M shapes (9 query heads, 3 KV heads, head_dim 64, hidden 576, 30 layers), bf16.
Attention: one step over all 30 layers of a pool far bigger than cache, pages handed out in
order as the engine's allocator does: a decode step of 32 sequences and a prefill step of 32
fresh prompts. Norms and RoPE: one call at 32 and 512 rows. Torch and ours alternate, medians
of the repeats, ratio = torch time / ours.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..engine.attention import AttnBatch, paged_attention
from ..engine.cpu_fused import load_fused_ops
from ..engine.cpu_kernels import load_paged_attention
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="pdserve bench kernels")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--cache-dir", default="", help="where kernels are built (default as for models)")
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


if __name__ == "__main__":
    main()
