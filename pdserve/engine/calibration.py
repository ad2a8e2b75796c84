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
from typing import Callable

import torch

from ..core.host import HostInfo
from .attention import AttnBatch, paged_attention
from .cpu_plan import KERNEL_ATTENTION, PREFILL_BUCKETS, AttentionPath, AttentionPaths, CpuPlan, ElementwisePath
from .kv_pool import KVPool
from .linear import MatmulPath, available_paths, default_path, make_linear

log = logging.getLogger(__name__)

MARGIN = 0.05  # a challenger must be this much faster than the default to replace it
MATMUL_ROWS = (1, 16, 256)  # decode of one and of a batch, a prefill chunk
DECODE_SEQS, DECODE_KV = 16, 384
# new tokens of the measured prefill chunk per bucket: the cost per token at that KV length,
# at a size where our kernel tiles as it would for a 512-token chunk (a whole one is 1 s at 8k)
PREFILL_CHUNKS = (512, 256, 128)
REPEATS = 7
BUDGET_MS = 400.0  # per decision and size, after the warm-up run
SLOW_CUTOFF = 4.0  # a candidate this many times the best at a smaller size is not tried larger
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


# timings: decision key (e.g. "matmul@16", "prefill_attention@2048") -> candidate value -> ms
Timings = dict[str, dict[str, float]]


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


# ---- measuring -----------------------------------------------------------------------------------
def _time_ms(fns: dict[str, Callable[[], object]], budget_ms: float = BUDGET_MS) -> dict[str, float]:
    """Each fn run once to warm up (and to size the rounds), then round robin (drift hits all
    alike) as many rounds as fit budget_ms, 1 to REPEATS; the minimum of each, in ms: the
    least disturbed run, since what others do on the machine only ever adds time."""
    warm: dict[str, float] = {}
    for k, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        warm[k] = (time.perf_counter() - t0) * 1e3
    rounds = max(1, min(REPEATS, int(budget_ms / max(sum(warm.values()), 1e-3))))
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], (time.perf_counter() - t0) * 1e3)
    return best


def _survivors(cands: tuple, last: dict[str, float] | None) -> tuple:
    """The candidates measured last time and within SLOW_CUTOFF of the best there."""
    if not last:
        return cands
    best = min(last.values())
    return tuple(c for c in cands if c.value in last and last[c.value] <= best * SLOW_CUTOFF)


def measure_matmul(weights: list[tuple[torch.Tensor, torch.Tensor | None]], paths: tuple[MatmulPath, ...],
                   panel, g: torch.Generator) -> Timings:
    """One decoder layer's matmuls (its real weights) per path at each of MATMUL_ROWS."""
    lins = {p: [make_linear(p, w, b, panel) for w, b in weights] for p in paths}
    out: Timings = {}
    last = None
    for rows in MATMUL_ROWS:
        xs = [torch.randn(rows, w.shape[1], generator=g).to(w.dtype) for w, _ in weights]
        alive = _survivors(paths, last)
        last = _time_ms({p.value: (lambda ls=lins[p]: [lin(x) for lin, x in zip(ls, xs)])
                         for p in alive})
        out[f"matmul@{rows}"] = last
    return out


def _attention_case(pool: KVPool, q, k, v, lens, new, paths: AttentionPaths, decode: bool):
    rows, at = [], 0
    ps = pool.page_size
    for n in lens:
        rows.append(list(range(at, at + -(-n // ps))))
        at += len(rows[-1])
    kernel, cd = paths.for_step(decode, max(lens))

    def run():
        batch = AttnBatch.build(lens, new, rows, ps, kernel=kernel, compute_dtype=cd)
        return paged_attention(q, k, v, 0, batch, pool)
    return run


def measure_attention(hq: int, hkv: int, d: int, dtype: torch.dtype, kernel, decode_paths: tuple,
                      prefill_paths: tuple, g: torch.Generator) -> Timings:
    """One layer's attention: a decode step of DECODE_SEQS sequences, and for each prefill
    bucket one chunk of PREFILL_CHUNKS new tokens whose KV reaches the bucket's limit."""
    top = PREFILL_BUCKETS[-1]
    pool = KVPool(1, -(-(top + DECODE_SEQS * DECODE_KV) // 16) + DECODE_SEQS + 1, 16, hkv, d, dtype)
    pool.buffer.copy_(torch.randn(pool.buffer.shape, generator=g).to(dtype))

    def qkv(t):
        return (torch.randn(t, hq, d, generator=g).to(dtype), torch.randn(t, hkv, d, generator=g).to(dtype),
                torch.randn(t, hkv, d, generator=g).to(dtype))

    def plan(path: AttentionPath) -> AttentionPaths:
        p = CpuPlan(MatmulPath.TORCH, path, (path,) * len(PREFILL_BUCKETS), ElementwisePath.TORCH)
        return AttentionPaths(p, kernel)

    out: Timings = {}
    if len(decode_paths) > 1:
        lens = [DECODE_KV + i * 7 for i in range(DECODE_SEQS)]
        q, k, v = qkv(DECODE_SEQS)
        out["decode_attention"] = _time_ms({
            p.value: _attention_case(pool, q, k, v, lens, [1] * DECODE_SEQS, plan(p), True)
            for p in decode_paths})
    if len(prefill_paths) > 1:
        last = None
        for limit, new in zip(PREFILL_BUCKETS, PREFILL_CHUNKS):
            q, k, v = qkv(new)
            alive = _survivors(prefill_paths, last)
            last = _time_ms({p.value: _attention_case(pool, q, k, v, [limit], [new], plan(p), False)
                             for p in alive})
            out[f"prefill_attention@{limit}"] = last
    return out


def measure_elementwise(fused, torch_ops, hidden: int, hq: int, hkv: int, d: int,
                        g: torch.Generator) -> Timings:
    """rms_norm, add + rms_norm and RoPE at 32 and 512 rows, our fused ops against torch's."""
    cases = []
    for rows in (32, 512):
        x = torch.randn(rows, hidden, generator=g).bfloat16()
        delta = torch.randn(rows, hidden, generator=g).bfloat16()
        w = torch.randn(hidden, generator=g).bfloat16()
        qk = torch.randn(rows, hq + hkv, d, generator=g).bfloat16()
        cos = torch.randn(rows, 1, d // 2, generator=g).bfloat16()
        sin = torch.randn(rows, 1, d // 2, generator=g).bfloat16()
        cases.append((x, delta, w, qk, cos, sin))

    def run(ops):
        def fn():
            for x, delta, w, qk, cos, sin in cases:
                ops.rms_norm(x, w, 1e-5)
                ops.add_rms_norm(x.clone(), delta, w, 1e-5)
                ops.rope(qk, cos, sin)
        return fn
    return {"elementwise": _time_ms({ElementwisePath.FUSED.value: run(fused),
                                       ElementwisePath.TORCH.value: run(torch_ops)})}


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
def candidates_for(dtype: torch.dtype, device: str, kernel, panel, fused) -> Candidates:
    """What exists for a model of this dtype here, default first (linear.default_path, our
    attention kernel, our fused ops): with no measurement the plan is the defaults."""
    paths = available_paths(dtype, device, panel)
    first = default_path(dtype, device, panel)
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


def measure(model, kernel, panel, fused, cands: Candidates, which: set[str], seed: int = 0) -> Timings:
    """Timings for the decisions in `which`, on the model's own shapes (and layer 0's weights)."""
    g = torch.Generator().manual_seed(seed)
    cfg, out = model.cfg, {}
    if "matmul" in which:
        layer = model.layers[0]
        weights = [(lin.weight, lin.bias) for lin in (layer.qkv, layer.o) + (
            (layer.gate_up, layer.down) if layer.moe is None else ())]
        out.update(measure_matmul(weights, cands.matmul, panel, g))
    if which & {"decode_attention", "prefill_attention"}:
        out.update(measure_attention(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, model.dtype, kernel,
            cands.decode_attention if "decode_attention" in which else (),
            cands.prefill_attention if "prefill_attention" in which else (), g))
    if "elementwise" in which:
        out.update(measure_elementwise(fused, model.torch_ops, cfg.hidden_size, cfg.num_heads,
                                       cfg.num_kv_heads, cfg.head_dim, g))
    return out


def model_signature(model) -> tuple:
    c = model.cfg
    return (c.architecture, c.hidden_size, c.intermediate_size, c.num_heads, c.num_kv_heads,
            c.head_dim, c.vocab_size, str(model.dtype).removeprefix("torch."), c.moe is not None)


def plan_for(model, device: str, kernel, panel, fused, forced: Forced, mode: str,
             cache: PlanCache | None, threads: int) -> CpuPlan:
    """The plan for this worker. mode: `auto` (the cached plan for this key, else measure and
    cache it), `redo` (measure and replace the cached one) or `off` (the defaults). Forced
    choices are applied on top of a cached plan's timings, so they never need a new measurement."""
    cands = candidates_for(model.dtype, device, kernel, panel, fused)
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
        timings = measure(model, kernel, panel, fused, cands, _needs(cands, Forced()))
        plan = decide(timings, cands)
        cache.store(key, plan)
        log.info("cpu plan: measured in %.1f s -> %s (%s)", time.monotonic() - t0,
                 cache.path(key), json.dumps(plan.reasons))
    return decide(timings, cands, forced)


def _annotate(plan: CpuPlan, why: str) -> CpuPlan:
    reasons = {k: (v if "forced" in v or "only path" in v else f"{v}; {why}") for k, v in plan.reasons.items()}
    return CpuPlan(plan.matmul, plan.decode_attention, plan.prefill_attention, plan.elementwise, reasons)
