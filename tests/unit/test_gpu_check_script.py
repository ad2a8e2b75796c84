"""scripts/gpu_check.sh on a machine it cannot check: a python without site-packages (`-S`)
that finds only a fake torch, and a fake nvidia-smi. It must say why nothing ran, in a
summary beside its logs, exit 2, and take seconds: no pip run that waits, no step started."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "gpu_check.sh"

pytestmark = pytest.mark.skipif(not (shutil.which("bash") and shutil.which("timeout")),
                                reason="needs bash and coreutils' timeout")

FAKE_TORCH = '''
import os
__version__ = "2.99.0+fake"
class version:
    cuda = "12.8" if os.environ.get("FAKE_CUDA") else None
class _T:
    def __init__(self, v): self.v = v
    def __mul__(self, k): return _T([x * k for x in self.v])
    def sum(self): return _T([sum(self.v)])
    def item(self): return self.v[0]
def ones(n, device=None): return _T([1] * n)
class cuda:
    @staticmethod
    def is_available(): return bool(os.environ.get("FAKE_CUDA"))
    @staticmethod
    def get_device_name(i): return "Fake H200"
'''


def _run(tmp_path: Path, cuda: bool, args: list[str]) -> tuple[int, float, dict]:
    bin_dir = tmp_path / "bin"
    (tmp_path / "faketorch" / "torch").mkdir(parents=True)
    (tmp_path / "faketorch" / "torch" / "__init__.py").write_text(FAKE_TORCH)
    bin_dir.mkdir()
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    smi = ('echo "Fake H200, 143771 MiB, 580.00"' if cuda else
           'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."; exit 9')
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/sh\n{smi}\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_CHECK_", "PYTHON", "FAKE_"))}
    env.update(PATH=f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}", PYTHONPATH=str(tmp_path / "faketorch"),
               GPU_CHECK_PYTHON=str(bin_dir / "python"), GPU_CHECK_WHEELS=str(tmp_path / "no-wheels"),
               PIP_NO_INDEX="1", TMPDIR=str(tmp_path), OUT=str(tmp_path / "out"))
    if cuda:
        env["FAKE_CUDA"] = "1"
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=60)
    took = time.monotonic() - t0
    out = Path(args[0]) if args else tmp_path / "out"
    files = {p.name: p.read_text() for p in out.iterdir()}
    assert proc.stdout.endswith(files["summary.txt"]), proc.stdout
    return proc.returncode, took, files


def _steps(summary: str) -> dict[str, str]:
    rows = [line.split(None, 4) for line in summary.splitlines()
            if line.startswith(("parity ", "engine ", "pd "))]
    return {r[0]: (r[1], r[4]) for r in rows}


def test_no_cuda_skips_every_step_and_exits_2(tmp_path):
    code, took, files = _run(tmp_path, cuda=False, args=[])  # results in $OUT
    summary = files["summary.txt"]
    assert code == 2, summary
    assert took < 20
    assert sorted(files) == ["env.log", "summary.txt"]
    assert summary.startswith("pdserve GPU check: NOTHING RAN (exit 2)")
    assert "gpu:     none: nvidia-smi failed (exit 9): NVIDIA-SMI has failed" in summary
    assert "torch:   2.99.0+fake (CUDA build: None)" in summary
    assert "cuda:    no CUDA: torch 2.99.0+fake is a CPU-only build" in summary
    assert "elapsed: " in summary
    steps = _steps(summary)
    assert set(steps) == {"parity", "engine", "pd"}
    assert all(status == "skipped" and "no CUDA" in why for status, why in steps.values()), steps
    assert "pip" not in files["env.log"]  # nothing to install can give this machine CUDA
    assert not list(tmp_path.glob("pdserve-gpu-check-work.*"))  # its temp dir is gone


def test_missing_modules_are_named_after_one_quick_install_try(tmp_path):
    results = tmp_path / "results"
    code, took, files = _run(tmp_path, cuda=True, args=[str(results)])
    summary = files["summary.txt"]
    assert code == 2, summary
    assert took < 20
    assert "gpu:     Fake H200, 143771 MiB, 580.00" in summary
    assert "cuda:    yes: Fake H200\n" in summary
    assert "install: pip install from the index (no " in summary
    assert "No module named pip" in files["env.log"]
    steps = _steps(summary)
    for name, needs in (("parity", ("pytest", "transformers", "gguf", "llguidance")),
                        ("engine", ("transformers", "gguf")), ("pd", ("fastapi", "uvicorn", "zmq"))):
        status, why = steps[name]
        assert status == "skipped" and why.startswith("missing python modules: "), (name, why)
        assert set(needs) <= set(why.split(": ", 1)[1].split()), (name, why)
        assert "torch" not in why.split(": ", 1)[1].split()  # the fake torch was found
