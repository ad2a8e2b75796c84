"""The layering of docs/architecture.md (Processes), checked by reading every module's imports."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "pdserve"
STDLIB = set(sys.stdlib_module_names)

# layer -> pdserve subpackages it must not import (directly)
FORBIDDEN = {
    "core": {"engine", "transfer", "disagg", "worker", "server", "router", "model_files", "bench"},
    "engine": {"transfer", "disagg", "worker", "server", "router"},
    "transfer": {"engine", "disagg", "worker", "server", "router"},
    "disagg": {"engine", "worker", "server", "router"},
    "server": {"engine", "worker", "router", "transfer"},
    "router": {"engine", "worker", "server", "transfer", "disagg"},
    "model_files": {"engine", "worker", "server", "router", "transfer", "disagg"},
    "grammar": {"engine", "worker", "server", "router", "transfer", "disagg", "bench"},
}
NO_TORCH = {"core", "transfer", "disagg", "server", "router", "model_files", "grammar"}


def imports_of(path: Path) -> list[tuple[str, int]]:
    """(absolute module name, level) of every import in a file; relative ones resolved."""
    tree = ast.parse(path.read_text())
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((a.name, 0) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = list(parts[: len(parts) - node.level])
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((name, node.level))
    return out


def layer_files(layer: str):
    d = PKG / layer
    return sorted(d.rglob("*.py")) if d.is_dir() else []


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_layer_imports(layer):
    bad = []
    for f in layer_files(layer):
        for name, _ in imports_of(f):
            top = name.split(".")
            if top[0] == "pdserve" and len(top) > 1 and top[1] in FORBIDDEN[layer]:
                bad.append(f"{f.relative_to(PKG)} imports {name}")
            if layer in NO_TORCH and top[0] in ("torch", "transformers"):
                bad.append(f"{f.relative_to(PKG)} imports {name}")
            if layer == "core" and top[0] not in STDLIB and top[0] != "pdserve":
                bad.append(f"{f.relative_to(PKG)} imports non-stdlib {name}")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("module", ["pdserve.server.launch", "pdserve.router.app", "pdserve.disagg.bootstrap_server",
                                    "pdserve.transfer.tcp", "pdserve.model_files.resolve", "pdserve.cli"])
def test_no_torch_at_runtime(module):
    code = f"import sys, importlib; importlib.import_module({module!r}); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", f"{module} loads torch"
