"""`pdserve bench cache-parity`: how far greedy output with the prefix cache agrees with a cache-off
run of the same engine, on the default model in bfloat16 (float32 is equal, and tested).

In bf16 a token's logits depend slightly on how its prompt was split into steps (the matmul
shapes change), so a reused prefix can flip a near-tie. This counts, over prompts sharing
prefixes that end on and off a page boundary, how many outputs are identical and where the
others first differ.
"""

from __future__ import annotations

import argparse
import random
import statistics


def _outputs(engine, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], int]:
    """One prompt at a time (so each can reuse the ones before) -> (outputs, cached tokens)."""
    from ..core.sampling import SamplingParams
    from ..engine.sequence import EngineRequest

    sp = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    outs, cached = [], 0
    for i, p in enumerate(prompts):
        engine.add(EngineRequest(f"parity-{i}", p, sp))
        toks = []
        while engine.has_work():
            for o in engine.step():
                if o.token_id is not None:
                    toks.append(o.token_id)
                if o.finished:
                    cached += o.cached_tokens
        outs.append(toks)
    return outs, cached


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="pdserve bench cache-parity", description=__doc__)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--prefixes", type=int, default=4)
    p.add_argument("--per-prefix", type=int, default=8)
    p.add_argument("--prefix-len", type=int, default=300)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)

    from ..core.config import ServerConfig
    from ..core.envs import Envs
    from ..model_files.resolve import resolve_model
    from ..worker.setup import build_engine

    model_dir = resolve_model(a.model, Envs.read().cache_dir)
    rng = random.Random(a.seed)
    engines = {}
    for cache in (False, True):
        cfg = ServerConfig(model=model_dir, dtype=a.dtype, num_threads=a.threads, max_total_tokens=65536,
                           disable_prefix_cache=not cache)
        engines[cache] = build_engine(cfg, model_dir)[0]
    vocab = engines[True].cfg.vocab_size
    page = engines[True].cfg.page_size
    prompts = []
    for k in range(a.prefixes):
        prefix = [rng.randrange(100, vocab) for _ in range(a.prefix_len + k)]  # on and off a page edge
        prompts += [prefix + [rng.randrange(100, vocab) for _ in range(rng.randint(1, 40))]
                    for _ in range(a.per_prefix)]
    off, _ = _outputs(engines[False], prompts, a.new_tokens)
    on, cached = _outputs(engines[True], prompts, a.new_tokens)
    same = sum(x == y for x, y in zip(on, off))
    firsts = [next(i for i, (s, t) in enumerate(zip(x, y)) if s != t) for x, y in zip(on, off) if x != y]
    print(f"{a.dtype}, page {page}: {same}/{len(prompts)} outputs identical with the cache on and off "
          f"({cached} of {sum(map(len, prompts))} prompt tokens reused)")
    if firsts:
        print(f"the others first differ at output token {min(firsts)}..{max(firsts)} "
              f"(median {statistics.median(firsts)}) of {a.new_tokens}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
