"""KV transfer throughput between two hosts: the tcp, mooncake and nixl backends and a raw socket.

`pdserve bench kv-remote serve --host B` runs the receiving side on host B (decode pools, one
backend of each kind, a raw socket); `pdserve bench kv-remote run --peer B:PORT --host A` on host
A moves one prompt's KV (the default model's layout, as `pdserve bench kv`) to it, each backend
and the raw socket in turn, rounds interleaved. A round runs from the first byte sent until the
receiver's acknowledgement arrives (a message back over the same backend; 9 bytes for raw), so
every kind pays the same extra one-way trip. Bytes are checked by digest after each prompt.
Prints median GB/s, the medians of the paired (same round) ratios against raw, and each side's
process CPU seconds per GB moved (the receiver's read at its acknowledgement): CPU per byte
moves less with other load than wall-clock rates do on a shared machine.
scripts/bench_kv_netns.sh runs both sides in two network namespaces joined by a veth bridge.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import socket
import statistics
import struct
import threading
import time

import msgspec
import numpy as np

from ..core.kv_layout import KVLayout
from ..transfer import create_backend
from .kv_backends_bench import BACKENDS, PAGE_BYTES, PAGE_TOKENS, PROBES, REGIONS, pool
from .transfer_bench import permuted_runs

MIB = 1 << 20
ROUND_DEADLINE_S = 120.0


def _backend(kind: str):
    """A backend by bench kind: a backend name, or `tcp:N` for the tcp backend with
    sockbuf_bytes=N (its socket buffers to another host; 0 = the kernel's autotuning)."""
    name, _, sockbuf = kind.partition(":")
    return create_backend(name, sockbuf_bytes=int(sockbuf)) if sockbuf else create_backend(name)


def _send_json(f, obj) -> None:
    f.write((json.dumps(obj) + "\n").encode())
    f.flush()


def _recv_json(f):
    line = f.readline()
    if not line:
        raise ConnectionError("control connection closed")
    return json.loads(line)


def _digest(arr: np.ndarray, pages: list[int], page_count: int) -> str:
    return hashlib.blake2b(np.ascontiguousarray(arr.reshape(REGIONS, page_count, PAGE_BYTES)[:, pages]).data,
                           digest_size=16).hexdigest()


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    while view:
        n = sock.recv_into(view)
        if not n:
            raise ConnectionError("raw peer closed")
        view = view[n:]


# ---- receiving side ---------------------------------------------------------------------------
def serve(host: str, port: int) -> None:
    with socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET) as lst:
        print(f"kv-remote receiver on {lst.getsockname()[0]}:{lst.getsockname()[1]}", flush=True)
        while True:  # the first connection that sends a set-up line (probes just close)
            ctl, _ = lst.accept()
            f = ctl.makefile("rwb")
            line = f.readline()
            if line:
                setup = json.loads(line)
                break
            ctl.close()
    dst_pages, kinds = setup["dst_pages"], setup["kinds"]
    pools, backends, stop = {}, {}, threading.Event()
    raw_lst = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        for k in kinds:
            pools[k], layout = pool(dst_pages, seed=None)
            backends[k] = _backend(k)
            backends[k].start(layout, host=host)
        threads = [threading.Thread(target=_acker, args=(backends[k], stop), daemon=True) for k in kinds]
        for t in threads:
            t.start()
        _send_json(f, {"endpoints": {k: b.endpoint for k, b in backends.items()},
                       "layouts": {k: msgspec.to_builtins(b.layout) for k, b in backends.items()},
                       "raw_port": raw_lst.getsockname()[1]})
        raw, _ = raw_lst.accept()
        raw_buf = np.zeros(REGIONS * dst_pages * PAGE_BYTES, np.uint8)
        raw_t = threading.Thread(target=_raw_acker, args=(raw, raw_buf, stop), daemon=True)
        raw_t.start()
        while (req := _recv_json(f))["op"] == "digest":
            if req["kind"] == "raw":
                got = hashlib.blake2b(raw_buf[:req["nbytes"]].data, digest_size=16).hexdigest()
            else:
                got = _digest(pools[req["kind"]], req["pages"], dst_pages)
            _send_json(f, {"digest": got})
    finally:
        stop.set()
        for b in backends.values():
            b.close()
        raw_lst.close()
        ctl.close()


def _acker(backend, stop: threading.Event) -> None:
    while not stop.is_set():
        for sender, msg in backend.recv(0.5):
            if "done" in msg:
                backend.send(sender, {"ack": msg["done"], "cpu": time.process_time()})


def _raw_acker(sock: socket.socket, buf: np.ndarray, stop: threading.Event) -> None:
    view = memoryview(buf)
    try:
        while not stop.is_set():
            hdr = bytearray(8)
            _recv_exact(sock, memoryview(hdr))
            _recv_exact(sock, view[:int.from_bytes(hdr, "little")])
            sock.sendall(b"k" + struct.pack("!d", time.process_time()))
    except OSError:
        pass


# ---- sending side -----------------------------------------------------------------------------
class Sender:
    def __init__(self, peer: str, host: str, kinds: list[str], src_pages: int, dst_pages: int):
        phost, _, pport = peer.rpartition(":")
        self.src, src_layout = pool(src_pages, seed=1)
        self.src_pages, self.dst_pages = src_pages, dst_pages
        self.ctl = socket.create_connection((phost.strip("[]"), int(pport)), timeout=30)
        self.f = self.ctl.makefile("rwb")
        _send_json(self.f, {"dst_pages": dst_pages, "kinds": kinds})
        info = _recv_json(self.f)
        self.peers = info["endpoints"]
        self.layouts = {k: msgspec.convert(d, KVLayout) for k, d in info["layouts"].items()}  # as a KvReq's
        self.backends = {}
        for k in kinds:
            self.backends[k] = _backend(k)
            self.backends[k].start(src_layout, host=host)
        self.raw = socket.create_connection((phost.strip("[]"), info["raw_port"]), timeout=30)
        self.raw.settimeout(ROUND_DEADLINE_S)

    def round(self, kind: str, src: list[int], dst: list[int], tag: int) -> tuple[float, float, float]:
        """(seconds, this process's CPU seconds, the receiver's process CPU clock at its ack)."""
        t0, c0 = time.perf_counter(), time.process_time()
        if kind == "raw":
            nbytes = REGIONS * len(src) * PAGE_BYTES
            self.raw.sendall(nbytes.to_bytes(8, "little"))
            self.raw.sendall(memoryview(self.src)[:nbytes])
            ack = bytearray(9)
            _recv_exact(self.raw, memoryview(ack))
            if ack[:1] != b"k":
                raise ConnectionError("raw receiver sent a bad acknowledgement")
            return time.perf_counter() - t0, time.process_time() - c0, struct.unpack("!d", ack[1:])[0]
        b = self.backends[kind]
        b.write_pages(self.peers[kind], self.layouts[kind], src, dst)
        b.send(self.peers[kind], {"done": tag})
        while not (acks := [m for _, m in b.recv(1.0) if m.get("ack") == tag]):
            if time.perf_counter() - t0 > ROUND_DEADLINE_S:
                raise TimeoutError(f"{kind} round {tag}: no acknowledgement within {ROUND_DEADLINE_S}s")
        return time.perf_counter() - t0, time.process_time() - c0, acks[0]["cpu"]

    def check(self, kind: str, src: list[int], dst: list[int]) -> None:
        """The receiver's digest of what landed equals ours of what was sent."""
        nbytes = REGIONS * len(src) * PAGE_BYTES
        _send_json(self.f, {"op": "digest", "kind": kind, "pages": dst, "nbytes": nbytes})
        got = _recv_json(self.f)["digest"]
        want = hashlib.blake2b(self.src[:nbytes].data, digest_size=16).hexdigest() if kind == "raw" \
            else _digest(self.src, src, self.src_pages)
        if got != want:
            raise AssertionError(f"{kind}: the bytes that landed differ from those sent")

    def close(self) -> None:
        try:
            _send_json(self.f, {"op": "close"})
        except OSError:
            pass
        for b in self.backends.values():
            b.close()
        self.raw.close()
        self.ctl.close()


def run(args) -> None:
    lengths = [int(t) for t in args.tokens.split(",")]
    kinds = []
    for k in [b for b in args.backends.split(",") if b]:
        name, _, sockbuf = k.partition(":")
        if name not in BACKENDS or (sockbuf and (name != "tcp" or not sockbuf.isdigit())):
            raise SystemExit(f"unknown backend {k}; choose from {', '.join(BACKENDS)} or tcp:SOCKBUF_BYTES")
        if problem := PROBES[name]():
            print(f"{k} skipped: {problem}")
        else:
            kinds.append(k)
    src_pages = -(-max(lengths) // PAGE_TOKENS)
    dst_pages = 2 * src_pages
    rng = np.random.default_rng(0)
    s = Sender(args.peer, args.host, kinds, src_pages, dst_pages)
    try:
        cols = [*kinds, "raw"]
        print(f"KV of one prompt to {args.peer}, {REGIONS} regions x {PAGE_BYTES} B pages, decode pages in "
              f"shuffled runs of {args.run_pages}, medians of >= {args.repeats} interleaved rounds")
        print(f"{'tokens':>6} {'MiB':>7} " + " ".join(f"{c + ' GB/s':>13}" for c in cols) + " "
              + " ".join(f"{k + '/raw':>12}" for k in kinds) + "   CPU s/GB sender|receiver: "
              + " ".join(f"{c:>13}" for c in cols))
        for tokens in lengths:
            n = -(-tokens // PAGE_TOKENS)
            nbytes = REGIONS * n * PAGE_BYTES
            src, dst = list(range(n)), permuted_runs(dst_pages, args.run_pages, rng)[:n]
            rounds = min(101, max(args.repeats, (256 * MIB) // nbytes))
            secs: dict[str, list[float]] = {k: [] for k in cols}
            cpu: dict[str, list[tuple[float, float]]] = {k: [] for k in cols}
            rx_clock = None  # the receiver's CPU clock at the previous acknowledgement
            for i in range(rounds + 1):  # round 0 warms up
                for k in cols[i % len(cols):] + cols[:i % len(cols)]:
                    t, tx_cpu, rx_at = s.round(k, src, dst, i)
                    if i:
                        secs[k].append(t)
                        cpu[k].append((tx_cpu, rx_at - rx_clock))
                    rx_clock = rx_at
            for k in cols:
                s.check(k, src, dst)
            gbs = {k: nbytes / statistics.median(v) / 1e9 for k, v in secs.items()}
            ratios = {k: statistics.median(tr / tk for tk, tr in zip(secs[k], secs["raw"])) for k in kinds}
            per_gb = {k: "|".join(f"{statistics.median(c[j] for c in v) / nbytes * 1e9:.2f}" for j in (0, 1))
                      for k, v in cpu.items()}
            print(f"{tokens:>6} {nbytes / MIB:>7.1f} " + " ".join(f"{gbs[c]:>13.2f}" for c in cols) + " "
                  + " ".join(f"{ratios[k]:>12.2f}" for k in kinds) + "                            "
                  + " ".join(f"{per_gb[c]:>13}" for c in cols), flush=True)
    finally:
        s.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="pdserve bench kv-remote", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="side", required=True)
    sv = sub.add_parser("serve", help="the receiving side")
    sv.add_argument("--host", required=True, help="address to bind (the backends' too)")
    sv.add_argument("--port", type=int, default=17999)
    rn = sub.add_parser("run", help="the sending side")
    rn.add_argument("--peer", required=True, help="the receiver's HOST:PORT")
    rn.add_argument("--host", required=True, help="this side's address (its backends bind it)")
    rn.add_argument("--tokens", default="1024,4096,8192,16384", help="prompt lengths")
    rn.add_argument("--repeats", type=int, default=9)
    rn.add_argument("--run-pages", type=int, default=16)
    rn.add_argument("--backends", default=",".join(BACKENDS),
                    help="kinds to compare with raw; tcp:N is the tcp backend with N-byte socket buffers "
                         "to another host (e.g. tcp,tcp:4194304 puts the default beside 4 MiB)")
    args = ap.parse_args(argv)
    if args.side == "serve":
        serve(args.host, args.port)
    else:
        run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
