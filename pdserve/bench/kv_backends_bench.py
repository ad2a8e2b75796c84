"""Loopback throughput of the mooncake, nixl and tcp transfer backends and a raw socket, in one run,
moving the KV cache of one prompt of the default model (SmolLM2-135M: 30 layers x K,V x 3 KV
heads x 64 dims, bf16, 16-token pages: 60 regions of 6 KiB pages).

Per prompt length, each round moves the prompt's pages (contiguous on the prefill side, in
shuffled runs of `--run-pages` on the decode side, as a fragmented decode pool hands them out)
with each backend, then a completion message; a round's time runs until the receiver has that
message. The raw socket moves the same byte count as one sendall into one buffer. Rounds are
interleaved, order rotating, so drift and other load hit every kind alike; prints median GB/s
and the medians of the paired (same round) ratios. A backend whose library is missing is
skipped with the reason.

    python -m pdserve.bench.kv_backends_bench [--tokens 128,512,2048,8192] [--repeats 7] [--backends tcp,nixl]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from ..core.kv_layout import KVLayout
from ..transfer import TransferBackend, create_backend, mooncake, nixl
from ..transfer.base import joint_runs
from .transfer_bench import RawLink, permuted_runs

MIB = 1 << 20
LAYERS, KV_HEADS, HEAD_DIM, DTYPE_BYTES, PAGE_TOKENS = 30, 3, 64, 2, 16
REGIONS = 2 * LAYERS
BACKENDS = ("mooncake", "nixl", "tcp")
PROBES = {"mooncake": mooncake.import_problem, "nixl": nixl.import_problem, "tcp": lambda: None}
RATIOS = (("mooncake", "tcp"), ("nixl", "tcp"), ("mooncake", "raw"), ("nixl", "raw"), ("tcp", "raw"))
PAGE_BYTES = PAGE_TOKENS * KV_HEADS * HEAD_DIM * DTYPE_BYTES


def pool(pages: int, seed: int | None) -> tuple[np.ndarray, KVLayout]:
    size = REGIONS * pages * PAGE_BYTES
    arr = np.zeros(size, np.uint8) if seed is None else np.random.default_rng(seed).integers(0, 256, size, np.uint8)
    return arr, KVLayout(arr.ctypes.data, REGIONS, pages, PAGE_BYTES, pages * PAGE_BYTES, PAGE_TOKENS, "bfloat16")


class BackendLink:
    """Sender and receiver backends of one kind, started over the two pools."""

    def __init__(self, kind: str, src: KVLayout, dst: KVLayout):
        self.kind = kind
        self.a: TransferBackend = create_backend(kind)
        self.b: TransferBackend = create_backend(kind)
        self.a.start(src)
        self.b_ep, self.b_layout = self.b.start(dst), dst

    def transfer(self, src_pages: list[int], dst_pages: list[int], tag: int) -> float:
        t0 = time.perf_counter()
        self.a.write_pages(self.b_ep, self.b_layout, src_pages, dst_pages)
        self.a.send(self.b_ep, {"done": tag})
        deadline = t0 + 120
        while not any(m.get("done") == tag for _, m in self.b.recv(1.0)):
            if time.perf_counter() > deadline:
                raise TimeoutError(f"{self.kind} round {tag}: no completion message within 120s")
        return time.perf_counter() - t0

    def close(self) -> None:
        self.a.close()
        self.b.close()


def bench_prompt(tokens: int, links: dict, raw: RawLink, src: np.ndarray, dsts: dict, args, rng) -> dict:
    n = -(-tokens // PAGE_TOKENS)
    nbytes = REGIONS * n * PAGE_BYTES
    src_pages = list(range(n))
    dst_pages = permuted_runs(args.dst_pages, args.run_pages, rng)[:n]
    for d in dsts.values():
        d[:] = 0
    kinds = [*links, "raw"]
    secs: dict[str, list[float]] = {k: [] for k in kinds}
    rounds = min(101, max(args.repeats, (256 * MIB) // nbytes))  # small prompts: more rounds
    for i in range(rounds + 1):  # round 0 warms up (page faults, connections, windows)
        order = kinds[i % len(kinds):] + kinds[:i % len(kinds)]
        for k in order:
            if k == "raw":
                t = raw.transfer(memoryview(src)[:nbytes])
            else:
                t = links[k].transfer(src_pages, dst_pages, i)
            if i:
                secs[k].append(t)
    shape_src, shape_dst = (REGIONS, args.src_pages, PAGE_BYTES), (REGIONS, args.dst_pages, PAGE_BYTES)
    for k in links:
        assert np.array_equal(dsts[k].reshape(shape_dst)[:, dst_pages], src.reshape(shape_src)[:, :n]), \
            f"{k}: bytes wrong"
    assert np.array_equal(dsts["raw"][:nbytes], src[:nbytes]), "raw: bytes wrong"
    out = {"tokens": tokens, "mib": nbytes / MIB, "writes": len(joint_runs(src_pages, dst_pages)) * REGIONS}
    out.update({k: nbytes / statistics.median(v) / 1e9 for k, v in secs.items()})
    for a, b in RATIOS:
        if a in secs and b in secs:  # time ratio b/a = throughput ratio a/b, per round
            out[f"{a}/{b}"] = statistics.median(tb / ta for ta, tb in zip(secs[a], secs[b]))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="128,256,512,1024,2048,4096,8192", help="prompt lengths")
    ap.add_argument("--repeats", type=int, default=7, help="rounds per prompt (at least 256 MiB worth)")
    ap.add_argument("--run-pages", type=int, default=16, help="consecutive decode pages per shuffled run")
    ap.add_argument("--backends", default=",".join(BACKENDS), help="transfer backends to compare with raw")
    args = ap.parse_args(argv)
    wanted = [b for b in args.backends.split(",") if b]
    if unknown := sorted(set(wanted) - set(BACKENDS)):
        ap.error(f"unknown backend(s) {', '.join(unknown)}; choose from {', '.join(BACKENDS)}")
    lengths = [int(t) for t in args.tokens.split(",")]
    args.src_pages = -(-max(lengths) // PAGE_TOKENS)
    args.dst_pages = 2 * args.src_pages  # the decode pool is larger: another region stride
    kinds = []
    for k in wanted:
        if problem := PROBES[k]():
            print(f"{k} skipped: {problem}")
        else:
            kinds.append(k)
    rng = np.random.default_rng(0)
    src, src_layout = pool(args.src_pages, seed=1)
    dsts, links = {}, {}
    try:
        for k in kinds:
            dsts[k], dst_layout = pool(args.dst_pages, seed=None)
            links[k] = BackendLink(k, src_layout, dst_layout)
        dsts["raw"] = np.zeros(src.nbytes, np.uint8)
        raw = RawLink(memoryview(dsts["raw"]))
        try:
            print(f"KV of one prompt, {REGIONS} regions x {PAGE_BYTES} B pages ({PAGE_TOKENS} tokens), decode pages "
                  f"in shuffled runs of {args.run_pages}, loopback, medians of >= {args.repeats} interleaved rounds")
            cols = [*kinds, "raw"]
            ratios = [f"{a}/{b}" for a, b in RATIOS if a in cols and b in cols]
            print(f"{'tokens':>6} {'MiB':>7} {'writes':>6} " + " ".join(f"{c + ' GB/s':>13}" for c in cols)
                  + " " + " ".join(f"{r:>12}" for r in ratios))
            for tokens in lengths:
                r = bench_prompt(tokens, links, raw, src, dsts, args, rng)
                print(f"{r['tokens']:>6} {r['mib']:>7.1f} {r['writes']:>6} "
                      + " ".join(f"{r[c]:>13.2f}" for c in cols) + " " + " ".join(f"{r[x]:>12.2f}" for x in ratios),
                      flush=True)
        finally:
            raw.close()
    finally:
        for link in links.values():
            link.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
