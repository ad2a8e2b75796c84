"""`python -m pdserve.engine.wait_probe --threads N --cpus LIST`: how fast a decode-like loop of
small parallel torch ops runs under this process's OpenMP wait settings (from its environment,
read when torch starts), on a quiet machine and beside a CPU-bound process on one of its cores.
Prints one JSON line {"quiet_ms": ..., "busy_ms": ...} (median ms per loop).

Run by core/wait_policy.py once per candidate setting: threads that spin between parallel
regions are fast when the cores are theirs and slow everything when another process wants one
of them; which setting balances the two best differs between CPUs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

LAYERS = 30
# a neighbour as one arrives: free to run on any of our cores, placed by the scheduler (a hog
# pinned to one core measured spinning waits 2x too kind on a Zen 5 VM)
HOG = "import os, sys; os.sched_setaffinity(0, [int(c) for c in sys.argv[1].split(',')])\nwhile True: pass"
SETTLE_S = 0.2  # the neighbour started and placed before the clock runs


def _loop(torch, g):
    """One 'step': per layer a small matmul, a softmax and a row gather, each big enough to be
    split over the threads (torch parallelizes from ~32k elements), as a decode step's are."""
    w = torch.randn(576, 1536, generator=g)
    x = torch.randn(16, 576, generator=g)
    scores = torch.randn(16 * 9, 400, generator=g)
    pool = torch.randn(20000, 192, generator=g)
    rows = torch.randint(0, 20000, (6000,), generator=g)

    def step():
        for _ in range(LAYERS):
            torch.mm(x, w)
            scores.softmax(-1)
            pool.index_select(0, rows)
    return step


def _time(step, seconds: float) -> float:
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m pdserve.engine.wait_probe")
    p.add_argument("--threads", type=int, required=True)
    p.add_argument("--cpus", default="", help="comma-separated cores to run on (default: all)")
    p.add_argument("--seconds", type=float, default=0.6, help="per measurement")
    a = p.parse_args(argv)
    cpus = [int(c) for c in a.cpus.split(",") if c] or sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, cpus)
    import torch

    torch.set_num_threads(a.threads)
    step = _loop(torch, torch.Generator().manual_seed(0))
    step()
    quiet = _time(step, a.seconds)
    hog = subprocess.Popen([sys.executable, "-c", HOG, ",".join(map(str, cpus))])
    try:
        time.sleep(SETTLE_S)
        busy = _time(step, a.seconds)
    finally:
        hog.kill()
        hog.wait()
    print(json.dumps({"quiet_ms": quiet, "busy_ms": busy}), flush=True)


if __name__ == "__main__":
    main()
