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


# ---- the handoff machines are pure (disagg/handoff.py): no threads, sockets, HTTP, clocks
MACHINE_FORBIDDEN = {"threading", "socket", "httpx", "time", "asyncio", "zmq", "requests"}
# names of that list that a module a machine imports may still import, and why
MACHINE_ALLOWED = {
    "pdserve.disagg.handoff": {"time"},  # the default clock of a standalone Handoff; the machines pass times in
}
MACHINES = sorted(f"pdserve.disagg.{p.stem}" for p in (PKG / "disagg").glob("*_machine.py"))


def module_file(name: str) -> Path | None:
    """The file of pdserve module `name` (a package: its __init__.py); None for anything else."""
    rel = PKG.parent.joinpath(*name.split("."))
    for f in (rel.with_suffix(".py"), rel / "__init__.py"):
        if f.is_file():
            return f
    return None


def runtime_imports(path: Path) -> list[str]:
    """What a file imports when it runs: `if TYPE_CHECKING:` blocks left out, relative names
    resolved, and `from pkg import mod` counted as importing pkg.mod."""
    tree = ast.parse(path.read_text())
    parts = path.relative_to(PKG.parent).with_suffix("").parts
    typing_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                   and ast.unparse(node.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                   for stmt in node.body for n in ast.walk(stmt)}
    out = []
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*parts[: len(parts) - node.level], *([node.module] if node.module else [])])
            out.append(base)
            out.extend(f"{base}.{a.name}" for a in node.names if module_file(f"{base}.{a.name}"))
    return out


def machine_modules() -> dict[str, list[str]]:
    """Every pdserve module that importing a *_machine.py in disagg/ runs -> the import chain
    from that machine to it."""
    chains = {m: [m] for m in MACHINES}
    todo = list(MACHINES)
    while todo:
        mod = todo.pop()
        for name in runtime_imports(module_file(mod)):
            parts = name.split(".")
            for i in range(1, len(parts) + 1):  # a module and the packages above it
                sub = ".".join(parts[:i])
                if parts[0] == "pdserve" and sub not in chains and module_file(sub):
                    chains[sub] = [*chains[mod], sub]
                    todo.append(sub)
    return chains


def test_machines_and_their_parts_import_no_threads_sockets_http_or_clocks():
    chains = machine_modules()
    assert {"pdserve.disagg.decode_machine", "pdserve.disagg.prefill_machine",
            "pdserve.disagg.handoff", "pdserve.disagg.decode_events"} <= set(chains)
    bad = []
    for mod, chain in sorted(chains.items()):
        for name in runtime_imports(module_file(mod)):
            top = name.split(".")[0]
            if top in MACHINE_FORBIDDEN and top not in MACHINE_ALLOWED.get(mod, ()):
                bad.append(f"{module_file(mod).relative_to(PKG.parent)} imports {name}, and a handoff machine "
                           f"imports it: {' -> '.join(chain)}")
    assert not bad, "the machines must stay pure (no threads, sockets, HTTP or clocks):\n" + "\n".join(bad)


@pytest.mark.parametrize("module", MACHINES)
def test_machines_load_no_io_at_runtime(module):
    io = ("httpx", "zmq", "asyncio", "socket", "requests", "aiohttp")
    code = (f"import sys, importlib; importlib.import_module({module!r}); "
            f"print(sorted(m for m in {io!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"{module} loads {out.stdout.strip()}"


# ---- the worker's loop and colocated role run without torch: tests/harness/fake_worker.py runs
# them over a fake engine, and a fake worker process must start in a blink
def test_worker_loop_and_colocated_role_load_no_torch():
    modules = ["pdserve.worker.loop", "pdserve.worker.colocated", "pdserve.worker.pump", "pdserve.engine.step_io",
               "pdserve.engine.allocator", "pdserve.engine.prefix_cache", "pdserve.core.launcher"]
    code = f"import sys, importlib; [importlib.import_module(m) for m in {modules!r}]; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False", "one of them loads torch"
