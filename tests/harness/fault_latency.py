"""How long a client waits for its answer after a fault (a measurement, not a test).

    python -m tests.harness.fault_latency [--reps 3]

Starts tiny-model servers on 127.0.0.1 (FAST_ENV deadlines: heartbeat 0.5 s x 2, bootstrap
8 s, waiting 20 s), injects each fault `--reps` times inside a widened window, and prints a
markdown table of the median seconds from the fault to the client's answer.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time

from .cluster import FAST_ENV, pd_body
from .fault_tools import GREEDY, LONG, KnobServer, Legs, Router, kv_req_sent, room_on, wait_for
from .fault_tools import prefilling as busy
from .tiny_model import make_tiny_model


def answer_after(fault, fut) -> tuple[float, str]:
    t0 = time.monotonic()
    fault()
    r = fut.result()
    took = time.monotonic() - t0
    return took, (type(r).__name__ if isinstance(r, Exception) else str(r.status_code))


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--reps", type=int, default=3)
    a = p.parse_args(argv)
    work = tempfile.mkdtemp(prefix="pdserve-fault-latency-")
    model = make_tiny_model(os.path.join(work, "tiny"))
    legs = Legs()
    rows: list[tuple[str, list[float], set[str]]] = []
    n = a.reps
    P = KnobServer("prefill", model, dp=n, log_dir=work)
    D = KnobServer("decode", model, dp=n + 1, log_dir=work)
    spares = [KnobServer("prefill", model, dp=1, log_dir=work) for _ in range(n)]
    servers = [P, D, *spares]
    try:
        for s in servers:
            s.wait_ready()
        # A: a prefill worker killed mid-prefill -> the decode leg's answer
        P.slow(step_s=0.25)
        times, codes = [], set()
        for rank in range(n):
            body = pd_body({"text": LONG, "sampling_params": GREEDY}, P, room_on(rank, n))
            _, fd = legs.both(P, D, body, decode_extra={"routed_dp_rank": n})
            wait_for(lambda: busy(P, rank), 20, "prefill")
            t, c = answer_after(lambda: P.kill_worker(rank), fd)
            times.append(t)
            codes.add(c)
        rows.append(("prefill DP worker killed during prefill: decode leg answers", times, codes))
        P.slow()
        # B: a whole prefill server killed mid-prefill -> the decode leg's answer
        times, codes = [], set()
        for S in spares:
            S.slow(step_s=0.25)
            body = pd_body({"text": LONG, "sampling_params": GREEDY}, S, random.getrandbits(63))
            _, fd = legs.both(S, D, body, decode_extra={"routed_dp_rank": n})
            wait_for(lambda: busy(S, 0), 20, "prefill")
            t, c = answer_after(S.kill, fd)
            times.append(t)
            codes.add(c)
        rows.append(("prefill server killed during prefill: decode leg answers", times, codes))
        # C: a decode worker killed while the prefill computes -> the prefill leg's answer
        Q = KnobServer("prefill", model, dp=1, log_dir=work).wait_ready()
        servers.append(Q)
        Q.slow(step_s=0.25)
        times, codes = [], set()
        for rank in range(n):
            body = pd_body({"text": LONG, "sampling_params": GREEDY}, Q, random.getrandbits(63))
            fp, _ = legs.both(Q, D, body, decode_extra={"routed_dp_rank": rank})
            wait_for(lambda: busy(Q, 0) and kv_req_sent(D, rank), 20, "prefill")
            t, c = answer_after(lambda: D.kill_worker(rank), fp)
            times.append(t)
            codes.add(c)
        rows.append(("decode DP worker killed during prefill: prefill leg answers", times, codes))
        Q.slow()
        # D: the router killed mid-decode -> both servers idle again
        D2 = KnobServer("decode", model, dp=1, log_dir=work).wait_ready()
        servers.append(D2)
        D2.slow(step_s=0.1)
        times = []
        for _ in range(n):
            router = Router([Q], [D2], log_dir=work).wait_healthy()
            legs.post(router.url + "/generate", {"text": LONG, "sampling_params": GREEDY, "stream": True})
            wait_for(lambda: D2.worker(0)["running_requests"] > 0, 20, "decode")
            t0 = time.monotonic()
            router.kill()
            Q.wait_idle(timeout=30)
            D2.wait_idle(timeout=30)
            times.append(time.monotonic() - t0)
            router.stop()
        rows.append(("router killed during decode: both servers idle again", times, {"-"}))
        D2.slow()
        # E: a prefill restarted on the same ports -> the first request after it
        times, codes = [], set()
        for _ in range(n):
            port, bport = Q.port, Q.bootstrap_port
            Q.kill()
            Q.proc.wait(10)
            Q.stop()
            Q = KnobServer("prefill", model, dp=1, log_dir=work, port=port, bootstrap_port=bport).wait_ready()
            servers.append(Q)
            body = pd_body({"text": LONG, "sampling_params": GREEDY}, Q, random.getrandbits(63))
            fp, fd = legs.both(Q, D2, body)
            t0 = time.monotonic()
            r = fd.result()
            times.append(time.monotonic() - t0)
            codes.add(str(getattr(r, "status_code", r)))
        rows.append(("prefill restarted on the same port: first request after it", times, codes))
    finally:
        legs.close()
        for s in servers:
            s.stop()
    print(f"\nFAST_ENV: {FAST_ENV}\n")
    print("| fault | median s | min-max s | client saw |\n|---|---|---|---|")
    for name, times, codes in rows:
        print(f"| {name} | {statistics.median(times):.2f} | {min(times):.2f}-{max(times):.2f} | "
              f"{', '.join(sorted(codes))} |")


if __name__ == "__main__":
    main()
