"""Loopback throughput of the tcp transfer backend against a raw-socket baseline, in one run.

Both move the same bytes from one buffer into another in this process: tcp as 64 KiB pages
written in permuted runs (so many coalesced writes, each landing at its own offset) followed
by a control message; raw as one sendall into a recv_into loop, once with the kernel's default
socket buffers and once ("raw=buf") with the buffer sizes the tcp backend sets on a same-host
connection, so the backend's own overhead shows apart from its buffer tuning. A transfer's time
runs from the first byte sent until the receiving side has everything (tcp: its message arrived).
Prints the median GB/s of each and the medians of the paired (same round) throughput ratios;
target tcp/raw >= 0.9 for >= 16 MiB.

    python -m pdserve.bench.transfer_bench [--sizes-mib 1,16,64,256] [--repeats 5] [--sockbuf N]
"""

from __future__ import annotations

import argparse
import queue
import random
import socket
import statistics
import threading
import time

import numpy as np

from ..core.kv_layout import KVLayout
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
    """Baseline: one socket pair over loopback, a thread that recv_into's a whole buffer.
    `sockbuf` > 0 sets SO_SNDBUF/SO_RCVBUF on both ends (as the tcp backend does); 0 = defaults."""

    def __init__(self, dst: memoryview, sockbuf: int = 0):
        lst = socket.create_server(("127.0.0.1", 0))
        self.tx = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        for s in (lst, self.tx) if sockbuf > 0 else ():
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sockbuf)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sockbuf)
        self.tx.connect(lst.getsockname())
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


def tcp_transfer(a: TcpBackend, b: TcpBackend, b_ep: dict, b_layout: KVLayout, src_pages: list[int],
                 dst_pages: list[int], tag: int, phases: list | None = None) -> float:
    """One round's seconds; `phases` gets the (write_pages returned, send returned, message
    received) offsets from the start too."""
    t0 = time.perf_counter()
    a.write_pages(b_ep, b_layout, src_pages, dst_pages)
    t_written = time.perf_counter()
    a.send(b_ep, {"done": tag})
    t_sent = time.perf_counter()
    if not any(m.get("done") == tag for _, m in b.recv(120)):
        raise TimeoutError(f"tcp round {tag}: no completion message within 120s")
    took = time.perf_counter() - t0
    if phases is not None:
        phases.append((t_written - t0, t_sent - t0, took))
    return took


def bench_size(size: int, args, rng) -> dict:
    src = rng.integers(0, 256, size, dtype=np.uint8)
    dst_tcp, dst_raw, dst_buf = (np.zeros(size, np.uint8) for _ in range(3))
    la = pool_layout(src, args.regions, args.page_kib * 1024)
    lb = pool_layout(dst_tcp, args.regions, args.page_kib * 1024)
    src_pages = list(range(la.num_pages))
    dst_pages = permuted_runs(la.num_pages, args.run_pages, rng)
    sockbufs = {"local_sockbuf_bytes": args.sockbuf}
    if not args.sockbuf:  # autotuning needs no size on the listener either: accepted sockets inherit it
        sockbufs["sockbuf_bytes"] = 0
    a, b = TcpBackend(**sockbufs), TcpBackend(**sockbufs)
    raw, raw_buf = RawLink(memoryview(dst_raw)), RawLink(memoryview(dst_buf), args.sockbuf)
    order = random.Random(size)
    try:
        a.start(la)
        b_ep, b_layout = b.start(lb), lb
        phases: list[tuple[float, float, float]] = []
        moves = {"tcp": lambda i: tcp_transfer(a, b, b_ep, b_layout, src_pages, dst_pages, i,
                                               phases if i else None),
                 "raw": lambda i: raw.transfer(memoryview(src)),
                 "raw=buf": lambda i: raw_buf.transfer(memoryview(src))}
        secs: dict[str, list[float]] = {k: [] for k in moves}
        repeats = min(101, max(args.repeats, (2048 * MIB) // size))  # small sizes: more rounds, less noise
        for i in range(repeats + 1):  # round 0 warms up (page faults, TCP windows)
            # Interleaved in a shuffled order per round: drift, other load and which one runs
            # right after itself (warm caches) hit every side alike.
            names = list(moves)
            order.shuffle(names)
            took = {k: moves[k](i) for k in names}
            if i:
                for k, t in took.items():
                    secs[k].append(t)
        shape = (args.regions, la.num_pages, la.page_bytes)
        assert np.array_equal(dst_tcp.reshape(shape)[:, dst_pages], src.reshape(shape)), "tcp bytes wrong"
        assert np.array_equal(dst_raw, src) and np.array_equal(dst_buf, src), "raw bytes wrong"
    finally:
        a.close()
        b.close()
        raw.close()
        raw_buf.close()
    runs = len(joint_runs(src_pages, dst_pages))
    out = {"mib": size // MIB, "writes": runs * args.regions}
    out.update({k: size / statistics.median(v) / 1e9 for k, v in secs.items()})
    for k in ("raw", "raw=buf"):  # medians of paired (same round) ratios
        out[f"tcp/{k}"] = statistics.median(r / t for t, r in zip(secs["tcp"], secs[k]))
    out["phases_ms"] = [statistics.median(p[j] for p in phases) * 1e3 for j in range(3)]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", default="1,16,64,256")
    ap.add_argument("--repeats", type=int, default=7, help="rounds per size (at least 2 GiB worth, at most 101)")
    ap.add_argument("--page-kib", type=int, default=64)
    ap.add_argument("--run-pages", type=int, default=16, help="pages per contiguous destination run")
    ap.add_argument("--regions", type=int, default=2)
    ap.add_argument("--sockbuf", type=int, default=TcpBackend().local_sockbuf_bytes,
                    help="SO_SNDBUF/SO_RCVBUF of the tcp backend's same-host connections and of "
                         "raw=buf (0 = kernel autotuning)")
    ap.add_argument("--phases", action="store_true",
                    help="also print when write_pages and send returned in the tcp rounds (medians)")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    print(f"tcp backend vs raw socket, loopback, {args.page_kib} KiB pages in runs of {args.run_pages}, "
          f"{args.regions} regions, socket buffers {args.sockbuf} B (raw: kernel defaults), "
          f"medians of >= {args.repeats} interleaved rounds")
    print(f"{'MiB':>6} {'writes':>7} {'tcp GB/s':>9} {'raw GB/s':>9} {'raw=buf GB/s':>13} "
          f"{'tcp/raw':>8} {'tcp/raw=buf':>12}")
    met = {"raw": True, "raw=buf": True}
    for mib in (int(s) for s in args.sizes_mib.split(",")):
        r = bench_size(mib * MIB, args, rng)
        print(f"{r['mib']:>6} {r['writes']:>7} {r['tcp']:>9.2f} {r['raw']:>9.2f} {r['raw=buf']:>13.2f} "
              f"{r['tcp/raw']:>8.2f} {r['tcp/raw=buf']:>12.2f}", flush=True)
        if args.phases:
            w, s, d = r["phases_ms"]
            print(f"{'':>6} tcp ms from the start: write_pages returned {w:.3f}, send returned {s:.3f}, "
                  f"message received {d:.3f}", flush=True)
        for k in met:
            met[k] &= mib < 16 or r[f"tcp/{k}"] >= 0.9
    for k, ok in met.items():
        print(f"tcp/{k} >= 0.9 for >= 16 MiB:", "met" if ok else "NOT met")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
