"""`python -m pdserve.bench.metrics_overhead`: what metrics cost on the engine benchmark, one run.

The engine benchmark's concurrent workload (N random prompts decoding together) runs in the
shape of the serving loop, twice per repeat, interleaved: without metrics (step, wrap each
output in a TokenOutput) and with every per-step and per-output metrics hook the serving path
runs (the worker's QueueClock around each step and on each output batch; the front's
dispatch, token, finish and handoff observations). On a real server the front's half runs in
another process; here both halves load the engine's own thread, an upper bound. Prints
tokens/s by wall clock and by process CPU time, the overhead of metrics in percent, and the
time spent inside the hooks as a share of the loop (the direct measure, immune to noise from
other work on the machine, which the A/B ratios are not; "best" is the least disturbed run).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from dataclasses import dataclass, field

import torch

from ..core.config import ServerConfig
from ..core.messages import TokenOutput
from ..core.sampling import SamplingParams
from ..engine.sequence import EngineRequest
from ..server.metrics import FrontMetrics
from ..worker.queue_clock import QueueClock
from ..worker.role import to_token_output
from ..worker.setup import build_engine


@dataclass
class _Item:
    """The fields of the front's ItemProgress that the metrics read (no detokenizer here)."""

    prompt_tokens: int
    arrival: float = field(default_factory=time.monotonic)
    output_ids: list[int] = field(default_factory=list)
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: dict | None = None
    error: None = None
    meta: dict = field(default_factory=dict)
    stages: dict = field(default_factory=dict)

    def e2e_latency(self) -> float:
        return time.monotonic() - self.arrival


class _Hooks:
    """Every metrics call one worker + front pair makes, in one thread."""

    def __init__(self) -> None:
        self.clock = QueueClock()
        self.metrics = FrontMetrics("colocated", "bench", "0")
        self.items: dict[str, _Item] = {}

    def added(self, rid: str, prompt_len: int) -> None:
        self.clock.watch(rid)
        self.items[rid] = _Item(prompt_len)
        self.metrics.items_started(1)
        self.metrics.dispatched(0, "round_robin")

    def outputs(self, outs: list[TokenOutput]) -> None:
        self.clock.stamp(outs)
        now = time.monotonic()
        for out in outs:
            item = self.items[out.rid]
            item.stages.update(out.timeline)
            prev = item.last_token_at
            item.output_ids.extend(out.token_ids)
            item.first_token_at = item.first_token_at or now
            item.last_token_at = now
            self.metrics.tokens_arrived(item, len(out.token_ids), prev)  # type: ignore[arg-type]
            if out.finished:
                item.finish_reason = out.finish_reason
                self.metrics.item_finished(self.items.pop(out.rid))  # type: ignore[arg-type]


def _run(engine, prompts: list[list[int]], new_tokens: int,
         hooks: _Hooks | None) -> tuple[float, float, int, float]:
    """-> (wall s, CPU s, tokens, seconds inside the metrics hooks)"""
    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        rid = f"m{time.monotonic_ns()}-{i}"
        engine.add(EngineRequest(rid, p, sp))
        if hooks is not None:
            hooks.added(rid, len(p))
    w0, c0, n, in_hooks = time.perf_counter(), time.process_time(), 0, 0.0
    while engine.has_work():
        if hooks is None:
            outs = [to_token_output(o) for o in engine.step()]
        else:
            t0 = time.perf_counter()
            started = time.time()
            hooks.clock.before_step(engine.seqs, started)
            t1 = time.perf_counter()
            stepped = engine.step()
            t2 = time.perf_counter()
            hooks.clock.after_step(engine.seqs, started)
            t3 = time.perf_counter()
            outs = [to_token_output(o) for o in stepped]
            t4 = time.perf_counter()
            hooks.outputs(outs)
            in_hooks += (t1 - t0) + (t3 - t2) + (time.perf_counter() - t4)
        n += sum(len(o.token_ids) for o in outs)
    return time.perf_counter() - w0, time.process_time() - c0, n, in_hooks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m pdserve.bench.metrics_overhead")
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)
    from ..core.envs import Envs
    from ..model_files.resolve import resolve_model

    threads = a.threads or os.cpu_count() or 1
    model_dir = resolve_model(a.model, Envs.read().cache_dir)
    cfg = ServerConfig(model=model_dir, dtype=a.dtype, num_threads=threads, max_total_tokens=65536,
                       max_running_requests=max(a.concurrency, 1))
    engine, _, _ = build_engine(cfg, model_dir)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, engine.cfg.vocab_size, (int(n),), generator=g).tolist()
               for n in torch.randint(16, 128, (a.concurrency,), generator=g)]
    _run(engine, prompts[:2], 4, _Hooks())  # warm-up
    rows: dict[str, list[tuple[float, float, int, float]]] = {"without": [], "with": []}
    for k in range(a.repeats):  # interleaved, alternating which goes first
        for arm in (("without", "with") if k % 2 == 0 else ("with", "without")):
            rows[arm].append(_run(engine, prompts, a.new_tokens, _Hooks() if arm == "with" else None))
    share = statistics.median(h / w for w, _, _, h in rows["with"])
    print(f"model={model_dir} dtype={a.dtype} threads={threads} concurrency={a.concurrency} "
          f"new_tokens={a.new_tokens} repeats={a.repeats}")
    print(f"{'tokens/s':<28}{'without metrics':>16}{'with metrics':>14}{'overhead':>10}")
    for clock, k in (("wall", 0), ("CPU time", 1)):
        for stat, pick in (("median", statistics.median), ("best", max)):
            v = {arm: pick(run[2] / run[k] for run in r) for arm, r in rows.items()}
            print(f"{f'{clock}, {stat} of {a.repeats}':<28}{v['without']:>16.1f}{v['with']:>14.1f}"
                  f"{100 * (v['without'] / v['with'] - 1):>9.2f}%")
    print(f"time inside the metrics hooks: {100 * share:.3f}% of the loop's wall time")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
