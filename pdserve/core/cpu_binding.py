"""Which CPU cores each DP worker's threads run on (`--cpu-bind`), as vLLM's
VLLM_CPU_OMP_THREADS_BIND: `auto` splits the cores this process may use among the ranks,
`none` leaves placement to the kernel, and an explicit list gives each rank its cores
(`0-3|4-7`, ranks separated by `|`). A bound worker is confined to its cores and runs one
torch thread per core; how its OpenMP threads wait is measured per CPU (core/wait_policy.py).
Threads are not pinned one by one: GOMP_CPU_AFFINITY put both compute threads of a server
worker on one core, so a worker is confined to its cores (set_process_cpus) and the kernel
places its threads."""

from __future__ import annotations

import os


class CpuBindError(ValueError):
    """A --cpu-bind value that names no cores, too few ranks, or cores this process lacks."""


def parse_cpus(text: str) -> list[int]:
    """`0-3,6` -> [0, 1, 2, 3, 6]."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise CpuBindError(f"bad CPU list {text!r}: expected e.g. 0-3,6") from None
        if a < 0 or b < a:
            raise CpuBindError(f"bad CPU range {part!r} in {text!r}")
        cpus.extend(range(a, b + 1))
    if not cpus:
        raise CpuBindError(f"CPU list {text!r} names no CPU")
    return cpus


def available_cpus() -> list[int]:
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def rank_cpus(spec: str, dp_rank: int, dp_size: int, cpus: list[int] | None = None) -> list[int] | None:
    """The cores of one rank, or None (no binding). `auto`: the available cores split into
    dp_size equal runs (fewer cores than ranks: rank r gets core r mod cores)."""
    cpus = available_cpus() if cpus is None else cpus
    if spec == "none":
        return None
    if spec == "auto":
        per = len(cpus) // dp_size
        if per == 0:
            return [cpus[dp_rank % len(cpus)]]
        return cpus[dp_rank * per:(dp_rank + 1) * per]
    parts = spec.split("|")
    if len(parts) != dp_size:
        raise CpuBindError(f"--cpu-bind {spec!r} gives {len(parts)} rank(s) for dp_size {dp_size} "
                           "(one CPU list per rank, separated by |)")
    mine = parse_cpus(parts[dp_rank])
    missing = sorted(set(mine) - set(cpus))
    if missing:
        raise CpuBindError(f"--cpu-bind names CPUs {missing} this process may not use (it has {cpus})")
    return mine


def threads_for(num_threads: int, cpus: list[int] | None, dp_size: int) -> int:
    """Torch threads of one worker: --num-threads, else its bound cores, else cores / dp_size."""
    if num_threads > 0:
        return num_threads
    if cpus:
        return len(cpus)
    return max(1, len(available_cpus()) // max(1, dp_size))


def set_process_cpus(cpus: list[int] | None) -> None:
    """Confine this process (and the threads it starts later) to `cpus`; call before torch."""
    if cpus:
        os.sched_setaffinity(0, cpus)


def split_among_servers(dp_sizes: list[int], cpus: list[int] | None = None) -> list[str]:
    """--cpu-bind specs for several servers on one machine (`pdserve up`): every worker gets
    its own cores where there are enough (in proportion, at least one each), else one core
    each, dealt round robin."""
    cpus = available_cpus() if cpus is None else cpus
    total = sum(dp_sizes)
    per = max(1, len(cpus) // total)
    specs, k = [], 0
    for dp in dp_sizes:
        ranks = []
        for _ in range(dp):
            mine = [cpus[(k + i) % len(cpus)] for i in range(per)]
            k += per
            ranks.append(",".join(map(str, mine)))
        specs.append("|".join(ranks))
    return specs
