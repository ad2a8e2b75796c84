"""`pdserve bench calibrate` on a tiny bf16 model: it names the host, the wait setting and each
engine choice with its reason, and a server started afterwards reads the very plan it stored."""

from __future__ import annotations

import subprocess
import sys

import pytest
from tiny_model import make_tiny_model

pytestmark = pytest.mark.e2e


def test_calibrate_prints_each_choice_and_why(tmp_path):
    model = make_tiny_model(str(tmp_path / "tiny"))
    env = {"PDSERVE_CACHE_DIR": str(tmp_path / "cache"), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-m", "pdserve", "bench", "calibrate", "--model", model, "--dtype", "bfloat16",
           "--num-threads", "1", "--cpu-wait-policy", "passive"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    out = done.stdout
    assert out.startswith("host: ") and "OpenMP waits: passive" in out and "forced by --cpu-wait-policy" in out
    for line in ("matmul", "decode attention", "prefill attention, KV 1-512", "norms and RoPE", "why:"):
        assert line in out, out
    assert "matmul: " in out and "elementwise: " in out
    stored = list((tmp_path / "cache" / "calibration").glob("*.json"))
    assert stored, "the plan was not cached"
    again = subprocess.run([*cmd, "--mode", "auto"], capture_output=True, text=True, timeout=300, env=env)
    assert again.returncode == 0 and again.stdout.split("engine plan")[1] == out.split("engine plan")[1]
