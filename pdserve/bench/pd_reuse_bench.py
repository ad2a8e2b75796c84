"""`pdserve bench pd-reuse`: a multi-turn chat in PD with decode-side KV reuse on and off, and colocated.

Starts a colocated server and three prefill + decode pairs (each pair its own prefill, so the
prefills' own caches see the same prompts): a decode with its prefix cache on (it reuses what
it holds of each turn's prompt), one with `--disable-prefix-cache` (every turn moves the whole
conversation), and one with reuse and `--disagg-local-prefill-max-tokens` (it prefills a turn
itself when little of it is new); all dp 1 with one torch thread. Each of `--chats` conversations runs `--turns`
turns one request at a time: the prompt is the conversation so far plus `--user-tokens` new
tokens, the answer `--answer-tokens` greedy tokens; each setup appends its own answer for the
next turn, as a real client does (in bf16 answers can differ between setups; "same" counts the
turns where a setup's answer equals colocated's). The same turn runs on the four setups back to
back. Per turn it prints median TTFT (streamed, first chunk)
of each setup, the KV pages each decode was sent and reused, bytes with reuse on and off, and
how many pages the turn's new tokens need (the target: pages sent within one page of that from
turn 2 on, and TTFT no worse than colocated with its prefix cache).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import httpx

from .pd_bench import _Proc


async def _stream(c: httpx.AsyncClient, url: str, body: dict) -> tuple[float, list[int], dict]:
    """POST /generate streaming -> (seconds to the first chunk, output ids, last meta_info)."""
    t0 = time.perf_counter()
    ttft, ids, meta = None, [], {}
    async with c.stream("POST", url + "/generate", json={**body, "stream": True}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if ttft is None:
                ttft = time.perf_counter() - t0
            ids = chunk.get("output_ids", ids)
            meta = chunk.get("meta_info", meta)
    return ttft or 0.0, ids, meta


async def _pd(c: httpx.AsyncClient, p: _Proc, d: _Proc, body: dict) -> tuple[float, list[int], dict]:
    pd = {**body, "bootstrap_host": "127.0.0.1", "bootstrap_port": p.bootstrap_port,
          "bootstrap_room": random.getrandbits(63)}
    prefill = asyncio.ensure_future(c.post(p.url + "/generate", json=pd))
    out = await _stream(c, d.url, pd)
    (await prefill).raise_for_status()
    return out


SETUPS = ("reuse", "no reuse", "reuse+local")


async def _run(a, colo: _Proc, pairs: dict[str, tuple[_Proc, _Proc]], page: int) -> None:
    rng = random.Random(a.seed)
    chats = [[rng.randrange(1000, 40000) for _ in range(a.system_tokens)] for _ in range(a.chats)]
    rows: dict[int, dict[str, list]] = {}
    async with httpx.AsyncClient(timeout=300) as c:
        for chat in chats:
            # each setup carries its own answers, as a real client does (in bf16 they can differ)
            convs = {name: list(chat) for name in ("colo", *pairs)}
            for turn in range(1, a.turns + 1):
                user = [rng.randrange(1000, 40000) for _ in range(a.user_tokens)]

                def body(name):
                    return {"input_ids": convs[name] + user, "sampling_params": {
                        "max_new_tokens": a.answer_tokens, "temperature": 0, "ignore_eos": True}}
                row = rows.setdefault(turn, {"colo": [], "new_pages": [], "same": [],
                                             **{f"{k} {s}": [] for k in ("ttft", "sent", "reused", "bytes")
                                                for s in SETUPS}})
                t, ids_colo, _ = await _stream(c, colo.url, body("colo"))
                row["colo"].append(t)
                same = True
                prompt_colo = convs["colo"] + user
                for name, (pre, dec) in pairs.items():
                    t, ids, meta = await _pd(c, pre, dec, body(name))
                    row[f"ttft {name}"].append(t)
                    local = meta.get("disaggregation") == "local"
                    row[f"sent {name}"].append(0 if local else meta.get("kv_transferred_pages", 0))
                    row[f"reused {name}"].append(meta.get("kv_reused_pages", 0))
                    row[f"bytes {name}"].append(meta.get("kv_bytes", 0) or 0)
                    same = same and ids == ids_colo
                    convs[name] += user + ids
                row["new_pages"].append(-(-len(prompt_colo) // page) - len(convs["colo"]) // page)
                row["same"].append(same)
                convs["colo"] = prompt_colo + ids_colo
    med = statistics.median
    print("TTFT (ms, median over chats; streamed, first chunk)")
    print(f"{'turn':>4} {'prompt':>7} {'colocated':>10} " + " ".join(f"{s:>12}" for s in SETUPS) + f" {'same':>5}")
    for turn, r in rows.items():
        plen = a.system_tokens + turn * a.user_tokens + (turn - 1) * a.answer_tokens
        print(f"{turn:>4} {plen:>7} {med(r['colo']) * 1000:>10.1f} "
              + " ".join(f"{med(r[f'ttft {s}']) * 1000:>12.1f}" for s in SETUPS)
              + f" {sum(r['same'])}/{len(r['same'])}")
    print("KV pages sent to the decode / reused from its cache (medians); new = pages the turn's new tokens need")
    print(f"{'turn':>4} {'new':>4} " + " ".join(f"{s + ' sent':>17} {'reused':>6}" for s in SETUPS)
          + f" {'KiB reuse':>10} {'KiB no reuse':>13}")
    for turn, r in rows.items():
        print(f"{turn:>4} {med(r['new_pages']):>4.0f} "
              + " ".join(f"{med(r[f'sent {s}']):>17.0f} {med(r[f'reused {s}']):>6.0f}" for s in SETUPS)
              + f" {med(r['bytes reuse']) / 1024:>10.0f} {med(r['bytes no reuse']) / 1024:>13.0f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="pdserve bench pd-reuse", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--chats", type=int, default=3)
    p.add_argument("--turns", type=int, default=5)
    p.add_argument("--system-tokens", type=int, default=200)
    p.add_argument("--user-tokens", type=int, default=64)
    p.add_argument("--answer-tokens", type=int, default=32)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--local-max", type=int, default=128, help="the reuse+local decode's threshold")
    p.add_argument("--split-cores", action="store_true",
                   help="prefills on --prefill-cores, decodes and colocated on --decode-cores")
    p.add_argument("--prefill-cores", default="0")
    p.add_argument("--decode-cores", default="1")
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args(argv)
    from ..core.envs import Envs
    from ..model_files.resolve import resolve_model

    model = resolve_model(a.model, Envs.read().cache_dir)
    common = ["--model", model, "--dtype", a.dtype, "--max-total-tokens", "32768", "--num-threads", "1",
              "--page-size", str(a.page_size)]
    # --split-cores: prefills on one core, decodes and the colocated server on the others, as on
    # separate hosts (a prefill leg the decode drops still computes until the drop arrives)
    pcores, dcores = (["--cpu-bind", a.prefill_cores], ["--cpu-bind", a.decode_cores]) if a.split_cores \
        else ([], [])
    colo = _Proc(["--role", "colocated", *common, *dcores])
    decode_args = {"reuse": [], "no reuse": ["--disable-prefix-cache"],
                   "reuse+local": ["--disagg-local-prefill-max-tokens", str(a.local_max)]}
    pairs = {name: (_Proc(["--role", "prefill", *common, *pcores]),
                    _Proc(["--role", "decode", *extra, *common, *dcores]))
             for name, extra in decode_args.items()}
    procs = [colo] + [x for pair in pairs.values() for x in pair]
    try:
        for x in procs:
            x.wait()
        print(f"model={model} page_size={a.page_size}; colocated, and three prefill+decode pairs (each its "
              f"own prefill): decode reuse on | decode --disable-prefix-cache | reuse on and "
              f"--disagg-local-prefill-max-tokens {a.local_max}; {a.chats} chats x {a.turns} turns: "
              f"{a.system_tokens} system + {a.user_tokens} user tokens per turn, {a.answer_tokens} answer "
              "tokens; 1 torch thread per worker")
        asyncio.run(_run(a, colo, pairs, a.page_size))
    finally:
        for x in procs:
            x.stop()


if __name__ == "__main__":
    main()
