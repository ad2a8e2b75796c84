"""Loopback throughput of the tcp transfer backend against a raw-socket baseline, in one run.

Both move the same bytes from one buffer into another in this process: tcp as 64 KiB pages
written in permuted runs (so many coalesced writes, each landing at its own offset) followed
by a control message; raw as one sendall into a recv_into loop. A transfer's time runs from
the first byte sent until the receiving side has everything (tcp: its message arrived).
Prints the median GB/s of each and the median of the paired (same round) tcp/raw throughput
ratios; target >= 0.9 for >= 16 MiB.

    python -m pdserve.bench.transfer_bench [--sizes-mib 1,16,64,256] [--repeats 5]
"""

from __future__ import annotations

import argparse
import queue
import socket
import statistics
import threading
import time

import numpy as np

from ..core.kv_layout import KVLayout
from ..transfer import layout_to_dict
from ..transfer.base import joint_runs
from ..transfer.tcp import TcpBackend

MIB = 1 << 20


def pool_layout(arr: np.ndarray, regions: int, page_bytes: int) -> KVLayout:
    pages = arr.nbytes // (regions * page_bytes)
    return KVLayout(arr.ctypes.data, regions, pages, page_bytes, pages * page_bytes, 16, "bfloat16")


def permuted_runs(num_pages: int, run_pages: int, rng: np.random.Generator) -> list[int]:
    """Destination pages: runs of `run_pages` consecutive pages, the runs in random order."""
    starts = rng.permutation(range(0, num_pages, run_pages))
    return [p for s in starts for p in range(s, min(s + run_pages, num_pages))]


class RawLink:
    """Baseline: one socket pair over loopback, a thread that recv_into's a whole buffer."""

    def __init__(self, dst: memoryview):
        lst = socket.create_server(("127.0.0.1", 0))
        self.tx = socket.create_connection(lst.getsockname())
        self.rx, _ = lst.accept()
        lst.close()
        self.dst, self.todo, self.done = dst, queue.Queue(), queue.Queue()
        self.thread = threading.Thread(target=self._receive, daemon=True)
        self.thread.start()

    def _receive(self) -> None:
        while (n := self.todo.get()) is not None:
            got = 0
            while got < n:
                k = self.rx.recv_into(self.dst[got:n])
                if k == 0:
                    return
                got += k
            self.done.put(n)

    def transfer(self, src: memoryview) -> float:
        self.todo.put(len(src))
        t0 = time.perf_counter()
        self.tx.sendall(src)
        self.done.get(timeout=120)
        return time.perf_counter() - t0

    def close(self) -> None:
        self.todo.put(None)
        self.tx.close()
        self.thread.join(timeout=10)
        self.rx.close()


def tcp_transfer(a: TcpBackend, b: TcpBackend, b_ep: dict, b_layout: dict, src_pages: list[int],
                 dst_pages: list[int], tag: int) -> float:
    t0 = time.perf_counter()
    a.write_pages(b_ep, b_layout, src_pages, dst_pages)
    a.send(b_ep, {"done": tag})
    if not any(m.get("done") == tag for _, m in b.recv(120)):
        raise TimeoutError(f"tcp round {tag}: no completion message within 120s")
    return time.perf_counter() - t0


def bench_size(size: int, args, rng) -> dict:
    src = rng.integers(0, 256, size, dtype=np.uint8)
    dst_tcp, dst_raw = np.zeros(size, np.uint8), np.zeros(size, np.uint8)
    la = pool_layout(src, args.regions, args.page_kib * 1024)
    lb = pool_layout(dst_tcp, args.regions, args.page_kib * 1024)
    src_pages = list(range(la.num_pages))
    dst_pages = permuted_runs(la.num_pages, args.run_pages, rng)
    a, b = TcpBackend(sockbuf_bytes=args.sockbuf), TcpBackend(sockbuf_bytes=args.sockbuf)
    raw = RawLink(memoryview(dst_raw))
    try:
        a.start(la)
        b_ep, b_layout = b.start(lb), layout_to_dict(lb)
        tcp_s, raw_s = [], []
        repeats = min(101, max(args.repeats, (512 * MIB) // size))  # small sizes: more rounds, less noise
        for i in range(repeats + 1):  # round 0 warms up (page faults, TCP windows)
            # Interleaved, order alternating: drift and other load hit both sides alike.
            if i % 2:
                r = raw.transfer(memoryview(src))
            t = tcp_transfer(a, b, b_ep, b_layout, src_pages, dst_pages, i)
            if not i % 2:
                r = raw.transfer(memoryview(src))
            if i:
                tcp_s.append(t)
                raw_s.append(r)
        shape = (args.regions, la.num_pages, la.page_bytes)
        assert np.array_equal(dst_tcp.reshape(shape)[:, dst_pages], src.reshape(shape)), "tcp bytes wrong"
        assert np.array_equal(dst_raw, src), "raw bytes wrong"
    finally:
        a.close()
        b.close()
        raw.close()
    runs = len(joint_runs(src_pages, dst_pages))
    return {"mib": size // MIB, "writes": runs * args.regions,
            "tcp": size / statistics.median(tcp_s) / 1e9, "raw": size / statistics.median(raw_s) / 1e9,
            "ratio": statistics.median(r / t for t, r in zip(tcp_s, raw_s))}  # of paired rounds


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", default="1,16,64,256")
    ap.add_argument("--repeats", type=int, default=7, help="rounds per size (at least 512 MiB worth)")
    ap.add_argument("--page-kib", type=int, default=64)
    ap.add_argument("--run-pages", type=int, default=16, help="pages per contiguous destination run")
    ap.add_argument("--regions", type=int, default=2)
    ap.add_argument("--sockbuf", type=int, default=TcpBackend().sockbuf_bytes,
                    help="SO_SNDBUF/SO_RCVBUF of the tcp backend (0 = kernel autotuning)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    print(f"tcp backend vs raw socket, loopback, {args.page_kib} KiB pages in runs of {args.run_pages}, "
          f"{args.regions} regions, medians of >= {args.repeats} interleaved rounds")
    print(f"{'MiB':>6} {'writes':>7} {'tcp GB/s':>9} {'raw GB/s':>9} {'tcp/raw':>8}")
    ok = True
    for mib in (int(s) for s in args.sizes_mib.split(",")):
        r = bench_size(mib * MIB, args, rng)
        print(f"{r['mib']:>6} {r['writes']:>7} {r['tcp']:>9.2f} {r['raw']:>9.2f} {r['ratio']:>8.2f}", flush=True)
        ok &= mib < 16 or r["ratio"] >= 0.9
    print("target tcp/raw >= 0.9 for >= 16 MiB:", "met" if ok else "NOT met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
