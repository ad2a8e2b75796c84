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


UP_DP = 2  # `pdserve up`'s prefill and decode DP size where each worker can have a core of its own


def up_layout(prefill_dp: int | None, decode_dp: int | None,
              cpus: list[int] | None = None) -> tuple[int, int, str, str]:
    """(prefill dp, decode dp, prefill --cpu-bind, decode --cpu-bind) for `pdserve up`. A DP size
    left unset is UP_DP where every worker of the two servers gets a core of its own, else 1: with
    fewer cores than workers a prefill and a decode worker share a core, and each prefill chunk
    slows the decode's steps. On the 2-core dev VM, multi-turn chats (`pdserve bench up`), dp 1 +
    1 with a core each against dp 2 + 2 on shared cores, quiet: mean TTFT 1.29x vs 1.42x
    colocated's, ITL p99 0.54x vs 0.79x, prompt tokens reused -4.1 vs -4.9 points; under other
    load 1.08x vs 1.17x, 0.47x vs 0.61x, -4.1 vs -6.5 (docs/benchmarks.md, "`pdserve up`
    against colocated"). With both unset and fewer than
    2 * UP_DP cores the prefill gets the first core and the decode the rest (1 core: they share
    it); sizes given are split by split_among_servers."""
    cpus = available_cpus() if cpus is None else cpus
    fits = len(cpus) >= 2 * UP_DP
    p_dp = prefill_dp if prefill_dp is not None else (UP_DP if fits else 1)
    d_dp = decode_dp if decode_dp is not None else (UP_DP if fits else 1)
    if prefill_dp is None and decode_dp is None and not fits:
        first = ",".join(map(str, cpus[:1]))
        return p_dp, d_dp, first, ",".join(map(str, cpus[1:])) or first
    p_spec, d_spec = split_among_servers([p_dp, d_dp], cpus)
    return p_dp, d_dp, p_spec, d_spec
