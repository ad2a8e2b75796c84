"""`pdserve bench kernels` runs end to end and prints a torch/ours row per case and a row per
long-prompt length (a smoke test: timings are never checked; the kernels' answers at long
prompts are checked in test_cpu_paged_attention and, at 8000 tokens, test_long_context_e2e)."""

from __future__ import annotations

import pytest

from pdserve.bench import kernels_bench
from pdserve.engine.cpu_kernels import AVX512_BF16_CPU, cpu_flags

LONG_PROMPTS = ("1024", "2048")  # two lengths run every step of the table; longer ones only take longer


@pytest.mark.skipif(not AVX512_BF16_CPU <= cpu_flags(), reason="no AVX-512 BF16 CPU here")
def test_bench_kernels_prints_every_case(kernel_cache_dir, capsys):
    kernels_bench.main(["--repeats", "1", "--threads", "1", "--cache-dir", kernel_cache_dir,
                        "--long-prompts", ",".join(LONG_PROMPTS)])
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.endswith("x")]
    assert len(rows) == 2 + 6
    assert all(float(r.split()[-1].rstrip("x")) > 0 for r in rows)
    long_rows = [line.split() for line in lines if line.split()[:1] and line.split()[0] in LONG_PROMPTS]
    assert [r[0] for r in long_rows] == list(LONG_PROMPTS)
    assert all(float(x) > 0 for r in long_rows for x in r[2:])
