"""How a worker's OpenMP threads wait between parallel regions: chosen by measuring (stdlib only).

Spinning threads answer the next region at once, which single-stream decode (hundreds of small
regions a step) needs on some CPUs (an Intel Xeon lost 40% with passive waits); a spinning thread
also keeps a core another process wants, which costs 2-7x beside a busy neighbour. So the front
runs engine/wait_probe.py once per candidate setting, in a subprocess on the worker's cores,
alone and beside a CPU-bound process, and keeps the fastest alone where the workers' spin governor
guards the busy case (a team as large as its cores), else the fastest alone among those that do
not fall behind beside the busy process (see pick), cached per CPU, threads and torch version like the
engine's plan.
A user's own OMP_WAIT_POLICY or GOMP_SPINCOUNT, or --cpu-wait-policy, is taken as given.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Literal, Mapping

from .host import HostInfo

log = logging.getLogger(__name__)

# libgomp: OMP_WAIT_POLICY=PASSIVE never spins, ACTIVE always does; unset, a waiting thread
# spins GOMP_SPINCOUNT times (default 300000) and then sleeps
CANDIDATES: dict[str, dict[str, str]] = {
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin:10000": {"GOMP_SPINCOUNT": "10000"},
    "spin:100000": {"GOMP_SPINCOUNT": "100000"},
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},
}
USER_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
PROBE_TIMEOUT_S = 90.0
VERSION = 3  # 2: unpinned neighbour in the probe, the BUSY_SLACK rule; 3: governed workers


def env_for(spec: str) -> dict[str, str]:
    """--cpu-wait-policy passive | active | spin:N -> the environment that asks libgomp for it."""
    if spec in CANDIDATES:
        return dict(CANDIDATES[spec])
    kind, _, count = spec.partition(":")
    if kind == "spin" and count.isdigit():
        return {"GOMP_SPINCOUNT": count}
    raise ValueError(f"--cpu-wait-policy {spec!r}: expected auto, passive, active or spin:N")


@dataclass(frozen=True)
class WaitChoice:
    policy: str  # a CANDIDATES key, spin:N, or "user" (the environment's own)
    env: dict[str, str]
    reason: str
    measured: dict[str, dict[str, float]] = field(default_factory=dict)  # policy -> quiet/busy ms

    def summary(self) -> dict[str, Any]:
        return {"policy": self.policy, "env": self.env, "reason": self.reason, "measured_ms": self.measured}


# a setting is kept only if beside a busy neighbour it is at most this much slower than the best
# there: on a 2-core Zen 5 VM spinning waits made single-stream decode 3.3x slower and a
# 1024-token prefill 2.1x slower beside one busy process, for 1.7x quiet decode speed
BUSY_SLACK = 1.10
GOVERNED = ("passive", "active")  # the candidates where the governor guards the busy case
GOVERNED_MARGIN = 1.10


def pick(measured: dict[str, dict[str, float]], governed: bool = False) -> tuple[str, str]:
    """(policy, why). governed: the workers' spin governor (engine/spin_governor.py) parks the
    team while idle and beside busy neighbours, so the fastest setting alone wins. Otherwise the
    fastest alone among those within BUSY_SLACK of the best beside a busy neighbour (quiet speed
    is not bought with a cliff under load)."""
    shown = ", ".join(f"{p} {m['quiet_ms']:.3g}/{m['busy_ms']:.3g} ms"
                      for p, m in sorted(measured.items(), key=lambda kv: kv[1]["quiet_ms"]))
    fastest = min(measured, key=lambda p: measured[p]["quiet_ms"])
    if governed:
        # alone, waits that never sleep answer at least as fast as any that do (a bounded spin
        # falls back to sleeping): active, unless passive measures clearly faster (SMT siblings)
        active, passive = measured.get("active"), measured.get("passive")
        clearly_faster = passive is not None and active is not None \
            and passive["quiet_ms"] < active["quiet_ms"] / GOVERNED_MARGIN
        best = "active" if active is not None and not clearly_faster else fastest
        return best, (f"{best}: fastest alone; the spin governor runs one thread while other"
                      f" processes use the cores (alone/busy without it: {shown})")
    bb = min(m["busy_ms"] for m in measured.values())
    ok = {p: m for p, m in measured.items() if m["busy_ms"] <= BUSY_SLACK * bb}
    best = min(ok, key=lambda p: ok[p]["quiet_ms"])
    why = (f"{best}: fastest alone of those within {BUSY_SLACK:.2f}x of the best beside a busy"
           f" neighbour (alone/busy: {shown})")
    if fastest != best:
        gain = measured[best]["quiet_ms"] / measured[fastest]["quiet_ms"]
        why += (f"; {fastest} would be {gain:.2f}x faster alone: --cpu-wait-policy {fastest}"
                " where the cores are the server's alone")
    return best, why


def governed(threads: int, cpus: list[int]) -> bool:
    """Whether workers of `threads` threads on `cpus` run the spin governor (engine/spin_governor.py
    governor_for: a team as large as its cores, of two threads or more)."""
    return threads >= 2 and threads >= len(cpus)


Probe = Callable[[dict[str, str], int, list[int]], dict[str, float]]


def run_probe(env: dict[str, str], threads: int, cpus: list[int]) -> dict[str, float]:
    """engine/wait_probe.py in a subprocess with `env` on top of ours (user's wait vars removed)."""
    base = {k: v for k, v in os.environ.items() if k not in USER_VARS}
    done = subprocess.run([sys.executable, "-m", "pdserve.engine.wait_probe", "--threads", str(threads),
                           "--cpus", ",".join(map(str, cpus))], env={**base, **env},
                          capture_output=True, text=True, timeout=PROBE_TIMEOUT_S)
    if done.returncode != 0:
        raise RuntimeError(f"wait probe failed ({done.returncode}): {done.stderr.strip()[-500:]}")
    found: dict[str, float] = json.loads(done.stdout.strip().splitlines()[-1])
    return found


def _key(host: HostInfo, threads: int) -> dict[str, Any]:
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = ""
    return {"cpu": host.model_name, "flags": sorted(host.isa_flags), "cores": host.cores,
            "threads": threads, "torch": torch_version, "candidates": sorted(CANDIDATES), "version": VERSION}


def resolve(spec: str, threads: int, cpus: list[int] | None, cache_dir: Path | None,
            current: Mapping[str, str], probe: Probe = run_probe, host: HostInfo | None = None,
            redo: bool = False) -> WaitChoice:
    """The wait setting for workers of `threads` threads on `cpus` (None: all of ours); redo:
    probe again even if a cached choice exists."""
    if spec != "auto":
        return WaitChoice(spec, env_for(spec), "forced by --cpu-wait-policy")
    own = {k: current[k] for k in USER_VARS if k in current}
    if own:
        return WaitChoice("user", {}, f"the environment's own {', '.join(f'{k}={v}' for k, v in own.items())}")
    if threads <= 1:
        return WaitChoice("passive", env_for("passive"), "one thread per worker: no region waits for another thread")
    host = host or HostInfo.read()
    cpus = cpus or sorted(os.sched_getaffinity(0))
    gov = governed(threads, cpus)
    key = {**_key(host, threads), "governed": gov}
    path = None
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        path = cache_dir / f"wait-{hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]}.json"
    with _locked(path):
        cached = None if redo else _load(path, key)
        if cached is not None:
            return cached
        measured, t0 = {}, time.monotonic()
        for name, env in CANDIDATES.items():
            if gov and name not in GOVERNED:
                continue
            try:
                measured[name] = probe(env, threads, cpus)
            except (OSError, RuntimeError, ValueError, subprocess.SubprocessError) as e:
                log.warning("wait policy %s: probe failed: %s", name, e)
        if not measured:
            return WaitChoice("passive", env_for("passive"), "probes failed: passive, the safe choice beside busy work")
        policy, why = pick(measured, gov)
        choice = WaitChoice(policy, env_for(policy), why, measured)
        log.info("wait policy measured in %.1f s: %s", time.monotonic() - t0, why)
        if path is not None:
            _store(path, key, choice)
        return choice


def _load(path: Path | None, key: dict[str, Any]) -> WaitChoice | None:
    if path is None:
        return None
    try:
        d = json.loads(path.read_text())
        if d["key"] != key:
            return None
        return WaitChoice(d["policy"], dict(d["env"]), d["reason"], d.get("measured_ms", {}))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _store(path: Path, key: dict[str, Any], choice: WaitChoice) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"key": key, **choice.summary()}, f, indent=1)
    os.replace(tmp, path)


class _locked:
    """An exclusive lock next to `path` while probing (servers starting together probe once),
    given up after PROBE_TIMEOUT_S x candidates (a stuck holder) with a warning."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self.f: IO[str] | None = None

    def __enter__(self) -> _locked:
        if self.path is None:
            return self
        self.f = open(str(self.path) + ".lock", "w")
        deadline = time.monotonic() + PROBE_TIMEOUT_S * len(CANDIDATES)
        while True:
            try:
                fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return self
            except BlockingIOError:
                if time.monotonic() > deadline:
                    log.warning("wait policy: %s.lock still held; probing without it", self.path)
                    return self
                time.sleep(0.1)

    def __exit__(self, *exc: object) -> Literal[False]:
        if self.f is not None:
            self.f.close()  # closing releases the lock
        return False
