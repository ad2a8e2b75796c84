"""`pdserve bench engine`: our engine against HF transformers on the same weights, one run.

Prints medians and ratios: single-stream decode tokens/s, and throughput of N concurrent
requests (continuous batching) against HF `generate` at a fixed batch size. Each figure is
given by wall clock and by process CPU time: with --threads 1 the CPU-time ratio stays
meaningful on a machine shared with other work, where wall-clock ratios swing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch


def _engine(model_dir: str, dtype: str, threads: int, max_running: int, cpu_kernels: str = "auto",
            device: str = "cpu", cpu_matmul: str = "auto"):
    from ..core.config import ServerConfig
    from ..worker.setup import build_engine

    cfg = ServerConfig(model=model_dir, dtype=dtype, num_threads=threads, max_total_tokens=65536,
                       max_running_requests=max_running, cpu_kernels=cpu_kernels, device=device,
                       cpu_matmul=cpu_matmul)
    engine, mcfg, _ = build_engine(cfg, model_dir)
    return engine


@dataclass
class Timing:
    wall: float
    cpu: float
    tokens: int


def _timed(fn) -> Timing:
    w0, c0 = time.perf_counter(), time.process_time()
    n = fn()
    if torch.cuda.is_initialized():  # --device cuda: the clock stops when the GPU's work is done
        torch.cuda.synchronize()
    return Timing(time.perf_counter() - w0, time.process_time() - c0, n)


def _run_ours(engine, prompts: list[list[int]], new_tokens: int) -> Timing:
    from ..core.sampling import SamplingParams
    from ..engine.sequence import EngineRequest

    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add(EngineRequest(f"b{time.monotonic_ns()}-{i}", p, sp))

    def run() -> int:
        n = 0
        while engine.has_work():
            n += sum(1 for o in engine.step() if o.token_id is not None)
        return n
    return _timed(run)


def _run_hf(model, prompts: list[list[int]], new_tokens: int, batch: int) -> Timing:
    return _timed(lambda: _hf_generate(model, prompts, new_tokens, batch))


def _hf_generate(model, prompts: list[list[int]], new_tokens: int, batch: int) -> int:
    n = 0
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        width = max(len(p) for p in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk], device=model.device)
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        n += (out.shape[1] - width) * len(chunk)
    return n


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="pdserve bench engine")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--hf-batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--cpu-kernels", default="auto", choices=["auto", "torch"],
                   help="our C kernels (attention, norms, RoPE) where they apply, or torch")
    p.add_argument("--cpu-matmul", default="auto",
                   choices=["auto", "torch", "onednn", "panel", "float32", "onednn_gemv"],
                   help="force our engine's matmul path, as the server's flag (auto: calibrated)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                   help="torch device of both engines (ours and HF's)")
    a = p.parse_args(argv)
    import os

    from transformers import AutoModelForCausalLM

    from ..core.envs import Envs
    from ..model_files.resolve import resolve_model

    threads = a.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    model_dir = resolve_model(a.model, Envs.read().cache_dir)
    dtype = getattr(torch, a.dtype)
    engine = _engine(model_dir, a.dtype, threads, max(a.concurrency, 1), a.cpu_kernels, a.device, a.cpu_matmul)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="sdpa")
    hf = hf.to(a.device).eval()
    g = torch.Generator().manual_seed(0)
    vocab = engine.cfg.vocab_size
    one = [torch.randint(100, vocab, (32,), generator=g).tolist()]
    many = [torch.randint(100, vocab, (int(n),), generator=g).tolist()
            for n in torch.randint(16, 128, (a.concurrency,), generator=g)]
    _run_ours(engine, one, 8), _run_hf(hf, one, 8, 1)  # warm-up
    runs = {"single_ours": lambda: _run_ours(engine, one, a.new_tokens),
            "single_hf": lambda: _run_hf(hf, one, a.new_tokens, 1),
            "many_ours": lambda: _run_ours(engine, many, a.new_tokens),
            "many_hf": lambda: _run_hf(hf, many, a.new_tokens, a.hf_batch)}
    rows: dict[str, list[Timing]] = {k: [] for k in runs}
    for _ in range(a.repeats):  # interleaved, so drift hits both sides alike
        for k, fn in runs.items():
            rows[k].append(fn())
    from ..core.host import HostInfo

    plan = engine.plan
    print(f"model={model_dir} device={a.device} dtype={a.dtype} threads={threads} new_tokens={a.new_tokens} "
          f"repeats={a.repeats} cpu={HostInfo.read().model_name!r} matmul={plan.matmul.value} "
          f"decode_attention={plan.decode_attention.value} "
          f"prefill_attention={','.join(p.value for p in plan.prefill_attention)} norms={plan.elementwise.value} "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '')} "
          f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', '')} "
          "(a server's worker gets the setting `pdserve bench calibrate` shows; set it here to match)")
    print(f"{'case (median tokens/s)':<40}{'clock':>6}{'pdserve':>10}{'HF':>10}{'ratio':>8}")
    cases = (("single-stream decode", "single"),
             (f"{a.concurrency} concurrent vs HF batch {a.hf_batch}", "many"))
    for label, key in cases:
        for clock in ("wall", "cpu"):
            ours = statistics.median(t.tokens / getattr(t, clock) for t in rows[key + "_ours"])
            ref = statistics.median(t.tokens / getattr(t, clock) for t in rows[key + "_hf"])
            print(f"{label:<40}{clock:>6}{ours:>10.1f}{ref:>10.1f}{ours / ref:>7.2f}x")


if __name__ == "__main__":
    main()
