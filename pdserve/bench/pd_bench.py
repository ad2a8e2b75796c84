"""`pdserve bench pd`: what disaggregation costs at low load, measured side by side in one run.

Starts a colocated server, two prefill servers (dp 2: follow_bootstrap_room, and a load-aware
method, `--balanced-method`, default round_robin) and two decode servers (one normal, one with
FORCE, so it always takes the query path), then sends the same 1-token requests one at a time,
round-robin over the four setups, for each prompt length. With max_new_tokens=1 the end-to-end
latency is the TTFT. Prints p50 TTFT of each setup, the extra TTFT of PD over colocated next to
the pure transfer time and the rest of the handoff breakdown, the load-aware prefill's TTFT
(its decode sends the KV request to the room's home rank, which forwards it: no query) and the
query path's, each over the fast path.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import time

import httpx

from ..core.launcher import ProcessGroup, free_port, http_ok


class _Proc:
    """One `pdserve serve` on free ports, in its own process group (core/launcher.py)."""

    def __init__(self, args: list[str]):
        self.port = free_port()
        self.bootstrap_port = free_port()
        cmd = [sys.executable, "-m", "pdserve", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--bootstrap-port", str(self.bootstrap_port), "--log-level", "warning", *args]
        self.url = f"http://127.0.0.1:{self.port}"
        self.group = ProcessGroup(cmd, name=f"server {self.url}", stdout=subprocess.DEVNULL)

    def wait(self, timeout: float = 600) -> None:
        self.group.wait_healthy(lambda: http_ok(self.url + "/health", 1.0), timeout, what="/health", poll_s=0.3)

    def stop(self) -> None:
        self.group.stop()


def _prompt_ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1000, 40000) for _ in range(n)]


async def _colocated(c: httpx.AsyncClient, url: str, ids: list[int]) -> float:
    t0 = time.perf_counter()
    r = await c.post(url + "/generate", json={"input_ids": ids, "sampling_params": {"max_new_tokens": 1}})
    r.raise_for_status()
    return time.perf_counter() - t0


async def _pd(c: httpx.AsyncClient, p: _Proc, d: _Proc, ids: list[int]) -> tuple[float, dict]:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": p.bootstrap_port, "bootstrap_room": random.getrandbits(63)}
    t0 = time.perf_counter()
    rp, rd = await asyncio.gather(c.post(p.url + "/generate", json=body), c.post(d.url + "/generate", json=body))
    dt = time.perf_counter() - t0
    rp.raise_for_status()
    rd.raise_for_status()
    return dt, rd.json()["meta_info"]


def _p50(xs: list[float]) -> float:
    return statistics.median(xs) * 1000


async def _run(a, colo: _Proc, pre: _Proc, pre_lb: _Proc, dec: _Proc, dec_q: _Proc) -> None:
    async with httpx.AsyncClient(timeout=120) as c:
        print(f"{'prompt':>7} {'colo TTFT':>10} {'PD TTFT':>9} {'extra':>8} {'transfer':>9} "
              f"{'resolve':>8} {'prealloc':>9} {'KiB':>7} {'GB/s':>6} {'fwd TTFT':>9} {'fwd-fast':>9} "
              f"{'query TTFT':>11} {'query-fast':>11}   (ms, p50)")
        for n in a.prompt_lens:
            ids = _prompt_ids(n, n)
            for _ in range(2):  # warm-up: topology caches, connections, allocator
                await _colocated(c, colo.url, ids)
                await _pd(c, pre, dec, ids)
                await _pd(c, pre, dec_q, ids)
                await _pd(c, pre_lb, dec, ids)
            col, pd, q, fwd, meta, qmeta, fmeta = [], [], [], [], [], [], []
            for i in range(a.repeats):
                ids_i = _prompt_ids(n, n * 1000 + i)
                col.append(await _colocated(c, colo.url, ids_i))
                dt, m = await _pd(c, pre, dec, ids_i)
                pd.append(dt)
                meta.append(m)
                dt, m = await _pd(c, pre, dec_q, ids_i)
                q.append(dt)
                qmeta.append(m)
                dt, m = await _pd(c, pre_lb, dec, ids_i)
                assert m["dp_rank_path"] == "forward", m
                fwd.append(dt)
                fmeta.append(m)
            transfer = [m["kv_transfer_s"] for m in meta]
            print(f"{n:>7} {_p50(col):>10.1f} {_p50(pd):>9.1f} {_p50(pd) - _p50(col):>8.1f} "
                  f"{_p50(transfer):>9.2f} {_p50([m['resolve_s'] for m in meta]):>8.2f} "
                  f"{_p50([m.get('prealloc_wait_s', 0.0) for m in meta]):>9.3f} "
                  f"{statistics.median(m['kv_bytes'] for m in meta) / 1024:>7.0f} "
                  f"{statistics.median(m['kv_gbps'] or 0 for m in meta):>6.2f} {_p50(fwd):>9.1f} "
                  f"{_p50(fwd) - _p50(pd):>9.1f} {_p50(q):>11.1f} "
                  f"{_p50(q) - _p50(pd):>11.1f}")
            rendezvous = {name: _p50([x.get("bootstrap_s", 0.0) for x in ms])
                          for name, ms in (("fast", meta), ("forward", fmeta), ("query", qmeta))}
            print(f"{'':>7} decode arrival -> KV request sent (resolve + reserve + send), p50 ms: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in rendezvous.items()))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="pdserve bench pd", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--balanced-method", default="round_robin", choices=["round_robin", "shortest_queue",
                                                                       "minimum_tokens"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="every server's --device")
    a = p.parse_args(argv)
    from ..core.envs import Envs
    from ..model_files.resolve import resolve_model

    model = resolve_model(a.model, Envs.read().cache_dir)
    # prefix cache off: every setup sends the same prompt in turn, and a cached one would skip its prefill
    common = ["--model", model, "--dtype", a.dtype, "--max-total-tokens", "16384", "--num-threads", "1",
              "--disable-prefix-cache", "--device", a.device]
    procs = [_Proc(["--role", "colocated", *common]), _Proc(["--role", "prefill", "--dp-size", "2", *common]),
             _Proc(["--role", "prefill", "--dp-size", "2", "--load-balance-method", a.balanced_method, *common])]
    procs += [_Proc(["--role", "decode", *common]),
              _Proc(["--role", "decode", "--force-query-prefill-dp-rank", *common])]
    try:
        for x in procs:
            x.wait()
        print(f"model={model} device={a.device} colocated dp1 | prefill dp2 (follow_bootstrap_room) | "
              f"prefill dp2 ({a.balanced_method}, forwarded KV requests) | decode dp1 fast path and decode dp1 with "
              f"FORCE (query path); {a.repeats} sequential 1-token requests per length; "
              f"1 torch thread per worker")
        asyncio.run(_run(a, *procs))
    finally:
        for x in procs:
            x.stop()


if __name__ == "__main__":
    main()
