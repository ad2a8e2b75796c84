"""`pdserve bench long-arrival`: what a long prompt arriving does to requests already decoding.

In one engine (the default model, in-process), N requests decode; after a few steps a long
prompt arrives. Prints, from the arrival until the long prompt's first token: the decoding
requests' inter-token gaps (median, max), the tokens they produced, and the long prompt's
TTFT. With prefill-first scheduling the decodes stop for the whole prefill; with mixed steps
they advance every step.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench long-arrival", description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--decoding", type=int, default=4)
    p.add_argument("--long-len", type=int, default=4000)
    p.add_argument("--chunked-prefill-size", type=int, default=512)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)

    from ..core.config import ServerConfig
    from ..core.envs import Envs
    from ..core.sampling import SamplingParams
    from ..engine.sequence import EngineRequest
    from ..model_files.resolve import resolve_model
    from ..worker.setup import build_engine

    model_dir = resolve_model(a.model, Envs.read().cache_dir)
    cfg = ServerConfig(model=model_dir, dtype="bfloat16", num_threads=a.threads, max_total_tokens=65536,
                       chunked_prefill_size=a.chunked_prefill_size, disable_prefix_cache=True)
    engine = build_engine(cfg, model_dir)[0]
    rng = random.Random(0)
    gaps_med, gaps_max, ttfts, during = [], [], [], []
    for rep in range(a.repeats):
        sp = SamplingParams(max_new_tokens=2000, temperature=0.0, ignore_eos=True)
        decs = [f"d{rep}-{i}" for i in range(a.decoding)]
        for rid in decs:
            engine.add(EngineRequest(rid, [rng.randrange(100, 40000) for _ in range(64)], sp))
        for _ in range(5):  # all decoding
            engine.step()
        long = EngineRequest(f"long{rep}", [rng.randrange(100, 40000) for _ in range(a.long_len)],
                             SamplingParams(max_new_tokens=1, temperature=0.0))
        last = {rid: time.perf_counter() for rid in decs}
        gaps: list[float] = []
        t0 = time.perf_counter()
        engine.add(long)
        done = False
        n = 0
        while not done:
            outs = engine.step()
            now = time.perf_counter()
            for o in outs:
                if o.rid == long.rid:
                    done = True
                elif o.rid in last:
                    gaps.append(now - last[o.rid])
                    last[o.rid] = now
                    n += 1
        ttfts.append(time.perf_counter() - t0)
        gaps.extend(time.perf_counter() - t for t in last.values())  # the gap still open at the end
        gaps_med.append(statistics.median(gaps))
        gaps_max.append(max(gaps))
        during.append(n)
        for rid in decs:
            engine.abort(rid)
    print(f"{a.decoding} decoding, a {a.long_len}-token prompt arrives (chunks of {a.chunked_prefill_size}); "
          f"medians of {a.repeats}:")
    print(f"  long prompt TTFT {statistics.median(ttfts) * 1000:.0f} ms")
    print(f"  decode gaps while it prefills: median {statistics.median(gaps_med) * 1000:.0f} ms, "
          f"max {statistics.median(gaps_max) * 1000:.0f} ms; {statistics.median(during):.0f} tokens decoded meanwhile")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
