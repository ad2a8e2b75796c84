"""`pdserve bench engine`: our engine against HF transformers on the same weights, one run.

Prints medians and ratios: single-stream decode tokens/s, and throughput of N concurrent
requests (continuous batching) against HF `generate` at a fixed batch size.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _engine(model_dir: str, dtype: str, threads: int, max_running: int):
    from ..core.config import ServerConfig
    from ..worker.setup import build_engine

    cfg = ServerConfig(model=model_dir, dtype=dtype, num_threads=threads, max_total_tokens=65536,
                       max_running_requests=max_running)
    engine, mcfg, _ = build_engine(cfg, model_dir)
    return engine


def _run_ours(engine, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    from ..core.sampling import SamplingParams
    from ..engine.sequence import EngineRequest

    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add(EngineRequest(f"b{time.monotonic_ns()}-{i}", p, sp))
    t0 = time.perf_counter()
    n = 0
    while engine.has_work():
        n += sum(1 for o in engine.step() if o.token_id is not None)
    return time.perf_counter() - t0, n


def _run_hf(model, prompts: list[list[int]], new_tokens: int, batch: int) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = 0
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        n += (out.shape[1] - width) * len(chunk)
    return time.perf_counter() - t0, n


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="pdserve bench engine")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--hf-batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    import os

    from transformers import AutoModelForCausalLM

    from ..core.envs import Envs
    from ..model_files.resolve import resolve_model

    threads = a.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    model_dir = resolve_model(a.model, Envs.read().cache_dir)
    dtype = getattr(torch, a.dtype)
    engine = _engine(model_dir, a.dtype, threads, max(a.concurrency, 1))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa").eval()
    g = torch.Generator().manual_seed(0)
    vocab = engine.cfg.vocab_size
    one = [torch.randint(100, vocab, (32,), generator=g).tolist()]
    many = [torch.randint(100, vocab, (int(n),), generator=g).tolist()
            for n in torch.randint(16, 128, (a.concurrency,), generator=g)]
    _run_ours(engine, one, 8), _run_hf(hf, one, 8, 1)  # warm-up
    rows = {"single_ours": [], "single_hf": [], "many_ours": [], "many_hf": []}
    for _ in range(a.repeats):  # interleaved, so drift hits both sides alike
        dt, n = _run_ours(engine, one, a.new_tokens); rows["single_ours"].append(n / dt)
        dt, n = _run_hf(hf, one, a.new_tokens, 1); rows["single_hf"].append(n / dt)
        dt, n = _run_ours(engine, many, a.new_tokens); rows["many_ours"].append(n / dt)
        dt, n = _run_hf(hf, many, a.new_tokens, a.hf_batch); rows["many_hf"].append(n / dt)
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"model={model_dir} dtype={a.dtype} threads={threads} new_tokens={a.new_tokens} "
          f"repeats={a.repeats}")
    print(f"{'case':<44}{'pdserve tok/s':>15}{'HF tok/s':>12}{'ratio':>8}")
    print(f"{'single-stream decode':<44}{med['single_ours']:>15.1f}{med['single_hf']:>12.1f}"
          f"{med['single_ours'] / med['single_hf']:>7.2f}x")
    label = f"{a.concurrency} concurrent vs HF batch {a.hf_batch}"
    print(f"{label:<44}{med['many_ours']:>15.1f}{med['many_hf']:>12.1f}"
          f"{med['many_ours'] / med['many_hf']:>7.2f}x")


if __name__ == "__main__":
    main()
