"""`pdserve bench kernels` runs end to end and prints a torch/ours row per case (a smoke test:
timings are never checked)."""

from __future__ import annotations

import pytest

from pdserve.bench import kernels_bench
from pdserve.engine.cpu_kernels import AVX512_BF16_CPU, cpu_flags


@pytest.mark.skipif(not AVX512_BF16_CPU <= cpu_flags(), reason="no AVX-512 BF16 CPU here")
def test_bench_kernels_prints_every_case(tmp_path, capsys):
    kernels_bench.main(["--repeats", "1", "--threads", "1", "--cache-dir", str(tmp_path)])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.endswith("x")]
    assert len(rows) == 2 + 6
    assert all(float(r.split()[-1].rstrip("x")) > 0 for r in rows)
