"""Grammar library choice: xgrammar vs llguidance over the default model's vocabulary.

For one JSON schema: tokenizer setup time, grammar compile time (cold, distinct schemas so no
cache helps), and the per-token cost of computing the next-token bitmask then consuming the
token, walking the tokens of a valid answer. Also whether importing the library imports torch
(the server and router must not). Usage (xgrammar is not a dependency of pdserve):

    .venv/bin/pip install xgrammar   # pulls triton too
    .venv/bin/python scripts/grammar_lib_bench.py [--model DIR] [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
ANSWER = json.dumps({"name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
                     "tags": ["math", "engines", "poetry"], "address": {"city": "London", "zip": "W1"},
                     "active": True})


def schema_variant(k: int) -> str:
    s = json.loads(json.dumps(SCHEMA))
    s["properties"][f"extra{k}"] = {"type": "string"}  # distinct text: no compile cache hit
    return json.dumps(s)


def imports_torch(module: str) -> bool:
    code = f"import sys, {module}; print('torch' in sys.modules)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() == "True"


def bench_llguidance(model_dir: str, ids: list[int], repeat: int, eos: int) -> dict:
    import llguidance
    import numpy as np
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    t = time.perf_counter()
    tok = llguidance.LLTokenizer(open(os.path.join(model_dir, "tokenizer.json")).read(), eos_token=eos)
    setup = time.perf_counter() - t
    compiles, per_token = [], []
    for k in range(repeat):
        t = time.perf_counter()
        g = llguidance.LLMatcher.grammar_from_json_schema(schema_variant(k))
        m = llguidance.LLMatcher(tok, g)
        fill_mask = allocate_token_bitmask(1, tok.vocab_size)
        fill_next_token_bitmask(m, fill_mask)  # the first mask is part of being ready
        compiles.append(time.perf_counter() - t)
        assert not m.is_error(), m.get_error()
        t = time.perf_counter()
        for tid in ids:
            fill_next_token_bitmask(m, fill_mask)
            assert (int(fill_mask[0, tid // 32]) >> (tid % 32)) & 1, f"token {tid} masked out"
            assert m.consume_token(tid), m.get_error()
        per_token.append((time.perf_counter() - t) / len(ids))
        fill_next_token_bitmask(m, fill_mask)
        assert (int(fill_mask[0, eos // 32]) >> (eos % 32)) & 1 and m.is_accepting()
    del np
    return {"setup_s": setup, "compile_s": statistics.median(compiles),
            "per_token_us": 1e6 * statistics.median(per_token)}


def bench_xgrammar(model_dir: str, ids: list[int], repeat: int, eos: int) -> dict:
    import xgrammar as xgr
    from transformers import PreTrainedTokenizerFast

    t = time.perf_counter()
    hf = PreTrainedTokenizerFast(tokenizer_file=os.path.join(model_dir, "tokenizer.json"))
    info = xgr.TokenizerInfo.from_huggingface(hf, stop_token_ids=[eos])
    compiler = xgr.GrammarCompiler(info, max_threads=2)
    setup = time.perf_counter() - t
    compiles, per_token = [], []
    for k in range(repeat):
        t = time.perf_counter()
        cg = compiler.compile_json_schema(schema_variant(k))
        m = xgr.GrammarMatcher(cg)
        mask = xgr.allocate_token_bitmask(1, info.vocab_size)
        m.fill_next_token_bitmask(mask)
        compiles.append(time.perf_counter() - t)
        t = time.perf_counter()
        for tid in ids:
            m.fill_next_token_bitmask(mask)
            assert (int(mask[0, tid // 32]) >> (tid % 32)) & 1, f"token {tid} masked out"
            assert m.accept_token(tid)
        per_token.append((time.perf_counter() - t) / len(ids))
    return {"setup_s": setup, "compile_s": statistics.median(compiles),
            "per_token_us": 1e6 * statistics.median(per_token)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/pdserve/smollm2-135m-instruct"))
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(a.model, "tokenizer.json"))
    ids = tok.encode(ANSWER, add_special_tokens=False).ids
    cfg = json.load(open(os.path.join(a.model, "config.json")))
    eos = cfg["eos_token_id"] if isinstance(cfg["eos_token_id"], int) else cfg["eos_token_id"][0]
    print(f"vocab {tok.get_vocab_size()}, answer {len(ids)} tokens, schema {len(json.dumps(SCHEMA))} chars")
    for name, fn in (("llguidance", bench_llguidance), ("xgrammar", bench_xgrammar)):
        try:
            r = fn(a.model, ids, a.repeat, eos)
        except ImportError as e:  # xgrammar is not a dependency: pip install xgrammar to compare
            print(f"{name:11s} not installed ({e})")
            continue
        print(f"{name:11s} imports torch: {imports_torch(name)!s:5s}  tokenizer setup {r['setup_s'] * 1e3:7.1f} ms  "
              f"compile+first mask {r['compile_s'] * 1e3:7.2f} ms  mask+consume {r['per_token_us']:7.1f} us/token")


if __name__ == "__main__":
    main()
