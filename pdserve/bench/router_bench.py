"""Router overhead benchmark: latency and req/s at a fixed concurrency, direct vs pdserve vs sglang-router.

`python -m pdserve.bench.router_bench` starts one fast prefill stub and one fast decode stub
(tests/harness/stub_pd_server.py), our router, and sglang-router 0.3.2 when it is installed, all on
127.0.0.1. Each round sends the same requests to every target in a rotating order: "direct"
posts straight to the decode stub (a router that costs nothing), the routers post to both legs.
It prints per-target medians over rounds of p50/p99/req/s, the added latency over direct, and
pdserve/sglang ratios measured in this one run. `--client-ab` instead compares the router's leg
client (pdserve/router/http1.py) with aiohttp's client, alone in this process against one stub.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from ..core.launcher import ProcessGroup, free_port, stop_all

REPO = Path(__file__).resolve().parents[2]
STUB = REPO / "tests" / "harness" / "stub_pd_server.py"
BOOTSTRAP_PORT = 18998


@dataclass
class RoundResult:
    p50_ms: float
    p99_ms: float
    req_per_s: float
    errors: int


def start(procs: list[ProcessGroup], cmd: list[str], name: str) -> ProcessGroup:
    """A child in its own process group, its output in a temp file (removed by `stop`)."""
    fd, log = tempfile.mkstemp(prefix="router-bench-", suffix=".log")
    os.close(fd)
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    procs.append(ProcessGroup(cmd, name=name, log_path=log, env=env, cwd=REPO))
    return procs[-1]


def stop(procs: list[ProcessGroup]) -> None:
    stop_all(reversed(procs), grace_s=10.0)
    for g in procs:
        os.unlink(g.log_path)


def start_stub(procs: list[ProcessGroup], role: str) -> str:
    proc = start(procs, [sys.executable, str(STUB), "--role", role, "--port", "0", "--no-record", "--max-lifetime",
                         "3600"], f"{role} stub")
    port = proc.wait_output(r"STUB READY port=(\d+)", 60.0).group(1)
    return f"http://127.0.0.1:{port}"


def start_pdserve_router(procs: list[ProcessGroup], prefill: str, decode: str) -> str:
    proc = start(procs, [sys.executable, "-m", "pdserve.router", "--host", "127.0.0.1", "--port", "0", "--prefill",
                         prefill, str(BOOTSTRAP_PORT), "--decode", decode, "--log-level", "warning"], "pdserve router")
    port = proc.wait_output(r"listening on http://127\.0\.0\.1:(\d+)", 60.0).group(1)
    return f"http://127.0.0.1:{port}"


def start_sglang_router(procs: list[ProcessGroup], prefill: str, decode: str) -> str:
    port = free_port()
    start(procs, [sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation", "--prefill", prefill,
                  str(BOOTSTRAP_PORT), "--decode", decode, "--host", "127.0.0.1", "--port", str(port),
                  "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                  "--policy", "round_robin", "--log-level", "warn"], "sglang-router")
    return f"http://127.0.0.1:{port}"


async def wait_ready(url: str, body: bytes, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            try:
                async with session.post(url + "/generate", data=body,
                                        headers={"Content-Type": "application/json"}) as resp:
                    if resp.status == 200:
                        await resp.read()
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.2)
    raise RuntimeError(f"{url} never answered /generate")


async def run_round(url: str, body: bytes, requests: int, concurrency: int) -> RoundResult:
    latencies: list[float] = []
    errors = 0
    todo = iter(range(requests))
    headers = {"Content-Type": "application/json"}
    connector = aiohttp.TCPConnector(limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def worker() -> None:
            nonlocal errors
            for _ in todo:
                t0 = time.perf_counter()
                try:
                    async with session.post(url + "/generate", data=body, headers=headers) as resp:
                        await resp.read()
                        ok = resp.status == 200
                except aiohttp.ClientError:
                    ok = False
                latencies.append(time.perf_counter() - t0)
                errors += not ok

        t_start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - t_start
    latencies.sort()
    return RoundResult(p50_ms=1000 * latencies[len(latencies) // 2],
                       p99_ms=1000 * latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))],
                       req_per_s=requests / elapsed, errors=errors)


async def bench(targets: dict[str, str], body: bytes, args: argparse.Namespace) -> dict[str, list[RoundResult]]:
    for url in targets.values():
        await wait_ready(url, body)
        await run_round(url, body, args.warmup, args.concurrency)
    results: dict[str, list[RoundResult]] = {name: [] for name in targets}
    names = list(targets)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            results[name].append(await run_round(targets[name], body, args.requests, args.concurrency))
    return results


async def client_round(kind: str, url: str, body: bytes, requests: int, concurrency: int) -> tuple[float, float]:
    """(req/s, CPU µs per request of this process) posting `body` with one leg client kind.

    "aiohttp" is set up as the router's legs were before http1.py (pooled, no limit, no cookie jar).
    """
    from pdserve.router.http1 import Http1Pool

    todo = iter(range(requests))
    headers = {"Content-Type": "application/json"}
    if kind == "aiohttp":
        session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0),
                                        cookie_jar=aiohttp.DummyCookieJar())

        async def post() -> None:
            async with session.post(url + "/generate", data=body, headers=headers) as resp:
                await resp.read()
    else:
        pool = Http1Pool(url, 4.0, 10.0)
        head = pool.cached_head("/generate", headers)

        async def post() -> None:
            resp = await pool.post(head, body)
            await resp.read()
            resp.close()

    async def worker() -> None:
        for _ in todo:
            await post()

    try:
        await asyncio.gather(*(worker() for _ in range(concurrency)))  # connect outside the timing
        todo = iter(range(requests))
        t0, cpu0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    finally:
        if kind == "aiohttp":
            await session.close()
        else:
            pool.close()
    return requests / wall, 1e6 * cpu / requests


def client_ab(args: argparse.Namespace, body: bytes) -> None:
    """A/B of the router's leg client (http1.py) against aiohttp's client, alone against one stub."""
    try:
        import uvloop
        loop_factory = uvloop.new_event_loop
    except ImportError:
        loop_factory = None
    procs: list[ProcessGroup] = []
    try:
        decode = start_stub(procs, "decode")
        results: dict[str, list[tuple[float, float]]] = {"aiohttp": [], "http1": []}
        with asyncio.Runner(loop_factory=loop_factory) as runner:
            runner.run(client_round("http1", decode, body, args.warmup, args.concurrency))
            for r in range(args.rounds):
                for kind in (["aiohttp", "http1"] if r % 2 == 0 else ["http1", "aiohttp"]):
                    results[kind].append(runner.run(client_round(kind, decode, body, args.requests,
                                                                 args.concurrency)))
    finally:
        stop(procs)
    print(f"\nleg client A/B: {args.rounds} rounds x {args.requests} POSTs to one stub, concurrency "
          f"{args.concurrency} (medians; CPU is this process: client + load loop)")
    med = {k: (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v)) for k, v in results.items()}
    for kind, (rps, cpu) in med.items():
        print(f"{kind:<10}{rps:>9.0f} req/s{cpu:>9.1f} CPU us/request")
    ratio = statistics.median(h[1] / a[1] for h, a in zip(results["http1"], results["aiohttp"]))
    print(f"http1/aiohttp CPU per request, same-round median: x{ratio:.2f}")
    print("JSON " + json.dumps({"medians": med, "cpu_ratio_http1_over_aiohttp": ratio}))


def summarize(results: dict[str, list[RoundResult]]) -> dict:
    med = {name: {k: statistics.median(getattr(x, k) for x in rounds) for k in ("p50_ms", "p99_ms", "req_per_s")}
           for name, rounds in results.items()}
    for name, rounds in results.items():
        med[name]["errors"] = sum(x.errors for x in rounds)
        if name != "direct":
            med[name]["added_p50_ms"] = statistics.median(
                x.p50_ms - d.p50_ms for x, d in zip(rounds, results["direct"]))
            med[name]["added_p99_ms"] = statistics.median(
                x.p99_ms - d.p99_ms for x, d in zip(rounds, results["direct"]))
    if "sglang-router" in med:
        ours, theirs = med["pdserve-router"], med["sglang-router"]
        med["ratios_pdserve_over_sglang"] = {
            "p50": ours["p50_ms"] / theirs["p50_ms"], "p99": ours["p99_ms"] / theirs["p99_ms"],
            "req_per_s": ours["req_per_s"] / theirs["req_per_s"],
            "added_p50": ours["added_p50_ms"] / theirs["added_p50_ms"] if theirs["added_p50_ms"] > 0 else None}
    return med


def print_table(summary: dict, args: argparse.Namespace) -> None:
    print(f"\nrouter bench: {args.rounds} rounds x {args.requests} requests, concurrency {args.concurrency}, "
          f"stream={args.stream} (medians over rounds)")
    print(f"{'target':<16}{'p50 ms':>9}{'p99 ms':>9}{'req/s':>9}{'+p50 ms':>9}{'+p99 ms':>9}{'errors':>8}")
    for name, m in summary.items():
        if name.startswith("ratios"):
            continue
        print(f"{name:<16}{m['p50_ms']:>9.2f}{m['p99_ms']:>9.2f}{m['req_per_s']:>9.0f}"
              f"{m.get('added_p50_ms', 0):>9.2f}{m.get('added_p99_ms', 0):>9.2f}{m['errors']:>8}")
    if "ratios_pdserve_over_sglang" in summary:
        r = summary["ratios_pdserve_over_sglang"]
        added = f"{r['added_p50']:.2f}" if r["added_p50"] is not None else "n/a"
        print(f"pdserve/sglang: p50 x{r['p50']:.2f}  p99 x{r['p99']:.2f}  req/s x{r['req_per_s']:.2f}  "
              f"added p50 x{added}")
    print("JSON " + json.dumps(summary))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=2000, help="requests per target per round")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--stream", action="store_true", help="stream the replies (SSE)")
    p.add_argument("--no-sglang", action="store_true", help="skip sglang-router even if installed")
    p.add_argument("--client-ab", action="store_true",
                   help="instead: A/B of the router's leg client (http1.py) vs aiohttp's, against one stub")
    args = p.parse_args(argv)
    if not STUB.exists():
        sys.exit(f"router_bench needs the stub server at {STUB} (run from a source checkout)")
    body = json.dumps({"text": "The capital of France is", "sampling_params": {"max_new_tokens": 8,
                       "temperature": 0}, "stream": args.stream}).encode()
    if args.client_ab:
        client_ab(args, body)
        return
    procs: list[ProcessGroup] = []
    try:
        prefill, decode = start_stub(procs, "prefill"), start_stub(procs, "decode")
        targets = {"direct": decode, "pdserve-router": start_pdserve_router(procs, prefill, decode)}
        if not args.no_sglang and importlib.util.find_spec("sglang_router") is not None:
            targets["sglang-router"] = start_sglang_router(procs, prefill, decode)
        else:
            print("sglang-router not installed (pip install sglang-router==0.3.2): comparing with direct only")
        results = asyncio.run(bench(targets, body, args))
        print_table(summarize(results), args)
    finally:
        stop(procs)


if __name__ == "__main__":
    main()
