"""Measure, then choose: which matmul, attention and norm/RoPE paths are fastest on this CPU.

The same code is fast on one CPU and slow on another (oneDNN's bf16 matmul needs AVX-512;
our tiled attention kernel lost 3x to torch's on an AMX Xeon and won 2x on an AMD EPYC), so a
worker measures each candidate path that exists here on its own model's shapes, a few seconds
at first start, and keeps the choices (`CpuPlan`) in a cache keyed by what could change them:
CPU model, ISA flags, threads, torch version, our kernel sources and the model's shapes. A
forced choice (a `--cpu-*` flag) is never measured and always wins.

`decide` is pure: given timings it picks, per decision, the fastest candidate, keeping the
default unless another is at least MARGIN faster (noise must not flip a choice), and says why.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..core.host import HostInfo
from .calibration_measure import MATMUL_ROWS, Timings, measure
from .cpu_matmul import MatmulKernels
from .cpu_plan import KERNEL_ATTENTION, PREFILL_BUCKETS, AttentionPath, CpuPlan, ElementwisePath
from .linear import MatmulPath, available_paths, default_path

log = logging.getLogger(__name__)

MARGIN = 0.05  # a challenger must be this much faster than the default to replace it
PLAN_VERSION = 1
LOCK_TIMEOUT_S = 300.0  # another worker measuring the same key takes seconds, not minutes


@dataclass(frozen=True)
class Candidates:
    """The paths that exist here, default first in each."""

    matmul: tuple[MatmulPath, ...]
    decode_attention: tuple[AttentionPath, ...]
    prefill_attention: tuple[AttentionPath, ...]
    elementwise: tuple[ElementwisePath, ...]


@dataclass(frozen=True)
class Forced:
    """Choices fixed by flags (None: measure)."""

    matmul: MatmulPath | None = None
    decode_attention: AttentionPath | None = None
    prefill_attention: AttentionPath | None = None
    elementwise: ElementwisePath | None = None

    def all_set(self) -> bool:
        return None not in (self.matmul, self.decode_attention, self.prefill_attention, self.elementwise)




def _pick(times: dict[str, float], default: str) -> tuple[str, str]:
    """(choice, reason): the fastest, unless the default is within MARGIN of it."""
    best = min(times, key=times.get)
    shown = ", ".join(f"{k} {v:.3g} ms" for k, v in sorted(times.items(), key=lambda kv: kv[1]))
    if best != default and default in times and times[default] <= times[best] * (1 + MARGIN):
        return default, f"{default} kept: within {MARGIN:.0%} of {best} ({shown})"
    return best, f"{best} fastest ({shown})"


def _forced_or(forced, available: tuple, name: str):
    if forced is not None and forced not in available:
        raise ValueError(f"--cpu-{name.replace('_', '-')} {forced.value} is not available here "
                         f"(available: {', '.join(a.value for a in available)})")
    return forced


def decide(timings: Timings, cands: Candidates, forced: Forced = Forced()) -> CpuPlan:
    """The plan from measured timings; forced choices win, a decision with one candidate needs
    no timing. Matmuls take one path for every row count: the one with the smallest mean of
    its time over the best time at each measured row count."""
    reasons: dict[str, str] = {}

    def one(name: str, enum_cls, available: tuple, keys: list[str]):
        f = _forced_or(getattr(forced, name), available, name)
        if f is not None:
            reasons[name] = f"{f.value}: forced by --cpu-{name.replace('_', '-')}"
            return f
        if len(available) == 1:
            reasons[name] = f"{available[0].value}: the only path here"
            return available[0]
        measured = [timings[k] for k in keys if k in timings]
        if not measured:
            reasons[name] = f"{available[0].value}: default (not measured)"
            return available[0]
        if len(measured) == 1:
            choice, why = _pick(measured[0], available[0].value)
        else:  # mean slowdown against the best at each size
            score = {c.value: statistics.fmean(t[c.value] / min(t.values()) for t in measured)
                     for c in available if all(c.value in t for t in measured)}
            choice, why = _pick(score, available[0].value)
            why = why.replace(" ms", "x") + " (mean time over the best at rows " + \
                ", ".join(k.split("@")[1] for k in keys if k in timings) + ")"
        reasons[name] = why
        return enum_cls(choice)

    matmul = one("matmul", MatmulPath, cands.matmul, [f"matmul@{r}" for r in MATMUL_ROWS])
    decode = one("decode_attention", AttentionPath, cands.decode_attention, ["decode_attention"])
    prefill = []
    for limit in PREFILL_BUCKETS:
        p = one("prefill_attention", AttentionPath, cands.prefill_attention, [f"prefill_attention@{limit}"])
        reasons[f"prefill_attention@{limit}"] = reasons.pop("prefill_attention")
        prefill.append(p)
    elementwise = one("elementwise", ElementwisePath, cands.elementwise, ["elementwise"])
    return CpuPlan(matmul, decode, tuple(prefill), elementwise, reasons, timings)


# ---- the cache -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanKey:
    """What a plan depends on; its hash names the cache file."""

    host: HostInfo
    threads: int
    torch_version: str
    kernels: str  # hash of our C sources
    model: tuple  # shapes and dtype
    candidates: Candidates
    version: int = PLAN_VERSION

    def as_json(self) -> dict:
        return {"cpu": self.host.model_name, "flags": sorted(self.host.isa_flags),
                "cores": self.host.cores, "threads": self.threads, "torch": self.torch_version,
                "kernels": self.kernels, "model": list(self.model), "version": self.version,
                "candidates": {k: [c.value for c in v] for k, v in self.candidates.__dict__.items()}}

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.as_json(), sort_keys=True).encode()).hexdigest()[:20]


def kernel_sources_hash() -> str:
    h = hashlib.sha256()
    for src in sorted(Path(__file__).parent.glob("cpu_*.c")):
        h.update(src.name.encode() + src.read_bytes())
    return h.hexdigest()[:16]


@dataclass
class PlanCache:
    """JSON files under cache_root/calibration, one per PlanKey; a lock file per key so that
    workers starting together measure once and the others wait and read."""

    root: Path
    waited_s: float = field(default=0.0, init=False)

    def path(self, key: PlanKey) -> Path:
        return self.root / f"{key.digest()}.json"

    def load(self, key: PlanKey) -> CpuPlan | None:
        try:
            d = json.loads(self.path(key).read_text())
            if d.get("key") != key.as_json():
                return None
            return CpuPlan.from_json(d["plan"])
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def store(self, key: PlanKey, plan: CpuPlan) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump({"key": key.as_json(), "plan": plan.to_json(),
                       "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, f, indent=1)
        os.replace(tmp, self.path(key))

    @contextlib.contextmanager
    def locked(self, key: PlanKey, timeout_s: float = LOCK_TIMEOUT_S):
        """Held while measuring; past timeout_s (a stuck holder) go on without it, logged."""
        self.root.mkdir(parents=True, exist_ok=True)
        path = self.root / f"{key.digest()}.lock"
        with open(path, "w") as f:
            t0 = time.monotonic()
            while True:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held = True
                    break
                except BlockingIOError:
                    if time.monotonic() - t0 > timeout_s:
                        log.warning("cpu plan: %s still locked after %.0f s; measuring without it",
                                    path, timeout_s)
                        held = False
                        break
                    time.sleep(0.1)
            self.waited_s = time.monotonic() - t0
            try:
                yield
            finally:
                if held:
                    fcntl.flock(f, fcntl.LOCK_UN)


# ---- putting it together -------------------------------------------------------------------------
def candidates_for(dtype: torch.dtype, device: str, kernel, kernels: MatmulKernels, fused) -> Candidates:
    """What exists for a model of this dtype here, default first (linear.default_path, our
    attention kernel, our fused ops): with no measurement the plan is the defaults."""
    paths = available_paths(dtype, device, kernels)
    first = default_path(dtype, device, kernels)
    matmul = (first,) + tuple(p for p in paths if p is not first)
    cpu_half = torch.device(device).type == "cpu" and dtype in (torch.bfloat16, torch.float16)
    torch_paths = (AttentionPath.TORCH, AttentionPath.TORCH_FP32) if cpu_half else (AttentionPath.TORCH,)
    decode = ((AttentionPath.KERNEL,) if kernel is not None else ()) + torch_paths
    prefill = (KERNEL_ATTENTION if kernel is not None else ()) + torch_paths
    elementwise = (ElementwisePath.FUSED, ElementwisePath.TORCH) if fused is not None else (ElementwisePath.TORCH,)
    return Candidates(matmul, decode, prefill, elementwise)


def _needs(cands: Candidates, forced: Forced) -> set[str]:
    """The decisions to measure: more than one candidate and not forced."""
    return {name for name in ("matmul", "decode_attention", "prefill_attention", "elementwise")
            if getattr(forced, name) is None and len(getattr(cands, name)) > 1}


def model_signature(model) -> tuple:
    c = model.cfg
    return (c.architecture, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads,
            c.head_dim, c.vocab_size, str(model.dtype).removeprefix("torch."), c.moe is not None)


def plan_for(model, device: str, kernel, kernels: MatmulKernels, fused, forced: Forced, mode: str,
             cache: PlanCache | None, threads: int) -> CpuPlan:
    """The plan for this worker. mode: `auto` (the cached plan for this key, else measure and
    cache it), `redo` (measure and replace the cached one) or `off` (the defaults). Forced
    choices are applied on top of a cached plan's timings, so they never need a new measurement."""
    cands = candidates_for(model.dtype, device, kernel, kernels, fused)
    which = _needs(cands, forced)
    if not which:
        return decide({}, cands, forced)
    if mode == "off" or cache is None:
        return _annotate(decide({}, cands, forced), "calibration off (--cpu-calibration off)")
    key = PlanKey(HostInfo.read(), threads, torch.__version__, kernel_sources_hash(),
                  model_signature(model), cands)
    with cache.locked(key):
        cached = cache.load(key) if mode == "auto" else None
        if cached is not None:
            log.info("cpu plan: cached %s", cache.path(key))
            return decide(cached.measured_ms, cands, forced)
        t0 = time.monotonic()
        timings = measure(model, kernel, kernels, fused, cands, _needs(cands, Forced()))
        plan = decide(timings, cands)
        cache.store(key, plan)
        log.info("cpu plan: measured in %.1f s -> %s (%s)", time.monotonic() - t0,
                 cache.path(key), json.dumps(plan.reasons))
    return decide(timings, cands, forced)


def _annotate(plan: CpuPlan, why: str) -> CpuPlan:
    reasons = {k: (v if "forced" in v or "only path" in v else f"{v}; {why}") for k, v in plan.reasons.items()}
    return CpuPlan(plan.matmul, plan.decode_attention, plan.prefill_attention, plan.elementwise, reasons)
