"""`pdserve bench structured`: engine throughput with a JSON schema against without, one run.

The same prompts at 1 and N concurrent requests, greedy with ignore_eos, run plain and under a
JSON schema whose shortest valid answer is longer than --new-tokens (so both runs emit exactly
as many tokens), interleaved so drift hits both alike. Prints median tokens/s by wall clock and
by process CPU time (it counts llguidance's mask threads too) and the ratio schema / plain.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

# at least 64 short strings: no answer closes before --new-tokens (default 128) tokens
SCHEMA = {"type": "object",
          "properties": {"title": {"type": "string", "maxLength": 40},
                         "words": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                   "minItems": 64}},
          "required": ["title", "words"], "additionalProperties": False}


def _run(engine, prompts: list[list[int]], new_tokens: int, grammar) -> tuple[float, float, int]:
    from ..core.sampling import SamplingParams
    from ..engine.sequence import EngineRequest

    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True, grammar=grammar)
    w0, c0 = time.perf_counter(), time.process_time()
    for i, p in enumerate(prompts):
        engine.add(EngineRequest(f"s{time.monotonic_ns()}-{i}", p, sp))
    n, reasons = 0, set()
    while engine.has_work():
        for o in engine.step():
            n += o.token_id is not None
            if o.finished:
                reasons.add(o.finish_reason["type"])
    assert reasons == {"length"}, f"every request must run to --new-tokens, got {reasons}"
    return time.perf_counter() - w0, time.process_time() - c0, n


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="pdserve bench structured", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--concurrency", default="1,32", help="comma-separated request counts run at once")
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    from ..core.config import ServerConfig
    from ..core.envs import Envs
    from ..core.grammar_spec import json_schema_spec
    from ..model_files.resolve import resolve_model
    from ..worker.setup import build_engine

    threads = a.threads or os.cpu_count() or 1
    levels = [int(x) for x in a.concurrency.split(",")]
    model_dir = resolve_model(a.model, Envs.read().cache_dir)
    cfg = ServerConfig(model=model_dir, dtype=a.dtype, device=a.device, num_threads=threads,
                       max_total_tokens=max(levels) * (a.prompt_tokens + a.new_tokens + 64),
                       max_running_requests=max(levels))
    engine, _, _ = build_engine(cfg, model_dir)
    schema = json_schema_spec(SCHEMA, "bench schema")
    g = torch.Generator().manual_seed(0)
    vocab = engine.cfg.vocab_size
    prompts = {c: [torch.randint(100, vocab, (a.prompt_tokens,), generator=g).tolist() for _ in range(c)]
               for c in levels}
    t = time.perf_counter()
    _run(engine, prompts[levels[0]][:1], 8, schema)  # warm-up; builds llguidance's tokenizer view
    setup = time.perf_counter() - t
    _run(engine, prompts[levels[0]][:1], 8, None)
    rows: dict[tuple[int, str], list[tuple[float, float, int]]] = {}
    for _ in range(a.repeats):
        for c in levels:
            for name, gr in (("plain", None), ("schema", schema)):
                rows.setdefault((c, name), []).append(_run(engine, prompts[c], a.new_tokens, gr))
    print(f"model={model_dir} dtype={a.dtype} device={a.device} threads={threads} "
          f"new_tokens={a.new_tokens} prompt_tokens={a.prompt_tokens} repeats={a.repeats} "
          f"first grammar request (tokenizer view + compile) {setup:.2f}s")
    print(f"{'concurrent':>10}{'clock':>7}{'plain tok/s':>13}{'schema tok/s':>14}{'ratio':>8}")
    for c in levels:
        for k, clock in ((0, "wall"), (1, "cpu")):
            plain = statistics.median(r[2] / r[k] for r in rows[(c, "plain")])
            sch = statistics.median(r[2] / r[k] for r in rows[(c, "schema")])
            print(f"{c:>10}{clock:>7}{plain:>13.1f}{sch:>14.1f}{sch / plain:>7.3f}x")


if __name__ == "__main__":
    main()
