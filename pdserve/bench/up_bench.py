"""`pdserve bench up`: `pdserve up` against a colocated server on the same cores, one after the other.

The workload is `pdserve bench serve --dataset multi-turn` with a shared system prompt:
`--conversations` chats that all open with the same `--system-len`-token system prompt, then a
`--first-len`-token first message and `--question-len`-token follow-ups; every turn resends the
history with the answers the system streamed back (`--output-len` tokens, greedy, EOS ignored),
and `--max-concurrency` chats are under way at once. Each system in turn (`--systems`, default
`up,colocated`) is started alone on this process's cores (`pdserve up` divides them between
its prefill and decode; the colocated server's DP workers split them; run the bench under
`taskset` to give both fewer), sent one unrelated warm-up prompt, its prefix caches flushed,
sent the workload, and stopped with every process it started before the next one starts;
`--repeats N` runs them N times in A B B A order and reports each over all its runs.

Prints per system: mean and p50 TTFT (also of first turns and of later turns), ITL p50 and p99,
output tok/s, prompt tokens reused (the `cached_tokens` the replies report: the prefill's cache
hits, or the decode's for a turn it prefilled itself), and for `pdserve up` how many turns its
decode prefilled itself and the KV pages it reused or was sent; then the up / colocated ratios
against the targets: mean TTFT <= 1.2x, ITL p99 <= 1x, reuse within 5 points. Exit status 0
when every request of every system succeeded (the targets are reported, not enforced).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import re
import shlex
import sys
import tempfile
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field

from ..core.cpu_binding import available_cpus
from ..core.launcher import LaunchError, ProcessGroup, free_port
from .metrics import RequestRecord, Summary, stats_ms, summarize
from .serve import BenchConfig, BenchError, run
from .serve import _finite as finite

TTFT_RATIO_TARGET = 1.2  # up's mean TTFT at most this times colocated's
ITL_P99_RATIO_TARGET = 1.0  # up's ITL p99 at most colocated's
REUSE_POINTS_TARGET = 5.0  # up's reused share of prompt tokens within this many points of colocated's
STOP_TIMEOUT_S = 60.0  # `pdserve up` gives each child 20 s after SIGTERM


def _http(url: str, timeout: float = 10.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""
    except (urllib.error.URLError, OSError):
        return 0, b""


def _start(cmd: list[str], log_path: str, name: str) -> ProcessGroup:
    """One process this bench started, in its own session, dying with the bench; stopped with
    SIGTERM to it alone (`pdserve up` then stops its own children), then SIGKILL to its group."""
    return ProcessGroup(cmd, name=name, log_path=log_path, term_group=False, die_with_parent=True)


class System:
    """A serving system under test: `start()` leaves it answering at `url`; `stop()` ends every
    process it started."""

    name = ""

    def __init__(self, a: argparse.Namespace, model_dir: str, log_dir: str):
        self.a, self.model_dir, self.log_dir = a, model_dir, log_dir
        self.child: ProcessGroup | None = None
        self.url = ""
        self.described = ""

    def common(self) -> list[str]:
        return ["--model", self.model_dir, "--dtype", self.a.dtype, "--max-total-tokens", str(self.a.max_total_tokens)]

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        if self.child is not None:
            self.child.stop(STOP_TIMEOUT_S)
            self.child = None

    def _wait(self, ready, what: str) -> None:
        try:
            self.child.wait_healthy(ready, self.a.start_timeout, what=what, poll_s=0.5)
        except LaunchError as e:
            raise BenchError(str(e)) from None

    def counters(self) -> dict[str, float]:
        """Counters read before and after the run (their difference is reported)."""
        return {}

    def rank_pages(self) -> dict[str, list[int]]:
        """Cached KV pages per DP rank of each server after the run."""
        return {}


class UpSystem(System):
    name = "up"

    def start(self) -> None:
        router, self.prefill_port, self.decode_port, bootstrap = (free_port() for _ in range(4))
        self.url = f"http://127.0.0.1:{router}"
        log_dir = os.path.join(self.log_dir, "up")
        os.makedirs(log_dir, exist_ok=True)
        extra = shlex.split(self.a.up_args)
        cmd = [sys.executable, "-m", "pdserve", "up", *self.common(), "--host", "127.0.0.1",
               "--port", str(router), "--prefill-port", str(self.prefill_port), "--decode-port",
               str(self.decode_port), "--bootstrap-port", str(bootstrap), "--log-dir", log_dir,
               "--start-timeout", str(self.a.start_timeout), *extra]
        self.described = "pdserve up " + " ".join(shlex.quote(x) for x in extra)
        self.child = _start(cmd, os.path.join(self.log_dir, "up.out"), "pdserve up")
        self._wait(lambda: "pdserve is up" in self.child.tail(200), "printing 'pdserve is up'")
        banner = re.search(r"pdserve up: starting (.*?); logs in", self.child.tail(200))
        if banner:
            self.described += f" ({banner.group(1)})"

    def counters(self) -> dict[str, float]:
        status, body = _http(f"http://127.0.0.1:{self.decode_port}/metrics")
        if status != 200:
            return {}
        return prometheus_counters(body.decode(errors="replace"), {
            "local": ("pdserve_disagg_decisions_total", {"role": "decode", "decision": "local"}),
            "remote": ("pdserve_disagg_decisions_total", {"role": "decode", "decision": "remote"}),
            "kv_pages_reused": ("pdserve_handoff_kv_pages_total", {"role": "decode", "kind": "reused"}),
            "kv_pages_transferred": ("pdserve_handoff_kv_pages_total", {"role": "decode", "kind": "transferred"}),
        })

    def rank_pages(self) -> dict[str, list[int]]:
        out = {}
        for role, port in (("prefill", self.prefill_port), ("decode", self.decode_port)):
            status, body = _http(f"http://127.0.0.1:{port}/server_info")
            if status == 200:
                out[role] = [w.get("cached_pages", 0) for w in json.loads(body).get("workers", [])]
        return out


class ColocatedSystem(System):
    name = "colocated"

    def start(self) -> None:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        extra = shlex.split(self.a.colocated_args)
        cmd = [sys.executable, "-m", "pdserve", "serve", "--role", "colocated", *self.common(),
               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", *extra]
        self.described = "pdserve serve --role colocated " + " ".join(shlex.quote(x) for x in extra)
        self.child = _start(cmd, os.path.join(self.log_dir, "colocated.log"), "the colocated server")
        self._wait(lambda: _http(self.url + "/health", 2.0)[0] == 200, self.url + "/health")

    def rank_pages(self) -> dict[str, list[int]]:
        status, body = _http(self.url + "/server_info")
        if status != 200:
            return {}
        return {"colocated": [w.get("cached_pages", 0) for w in json.loads(body).get("workers", [])]}


SYSTEMS = {s.name: s for s in (UpSystem, ColocatedSystem)}


def prometheus_counters(text: str, wanted: dict[str, tuple[str, dict[str, str]]]) -> dict[str, float]:
    """name -> value of the samples `wanted` names (metric, labels that must match), 0 if absent."""
    out = {name: 0.0 for name in wanted}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        m = re.match(r"([a-zA-Z_:][\w:]*)(\{(.*)\})?\s+(\S+)", line)
        if not m:
            continue
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(3) or ""))
        for name, (metric, want) in wanted.items():
            if m.group(1) == metric and all(labels.get(k) == v for k, v in want.items()):
                out[name] += float(m.group(4))
    return out


@dataclass
class SystemResult:
    name: str
    command: str
    summary: Summary
    ttft_first_turn_ms: float
    ttft_later_turns_ms: float
    counters: dict[str, float] = field(default_factory=dict)  # during the timed runs
    rank_pages: dict[str, list[int]] = field(default_factory=dict)  # after the last run
    loadavg: list[tuple[float, float]] = field(default_factory=list)  # per run: before, after

    @property
    def reused_pct(self) -> float:
        rate = self.summary.cache_hit_rate
        return math.nan if rate is None else 100.0 * rate


def workload(a: argparse.Namespace, url: str, model_dir: str) -> BenchConfig:
    return BenchConfig(
        url=url, backend="pdserve", dataset="multi-turn", multi_turn_conversations=a.conversations,
        multi_turn_turns=a.turns, multi_turn_first_len=a.first_len, multi_turn_question_len=a.question_len,
        multi_turn_system_len=a.system_len, random_output_len=a.output_len, max_concurrency=a.max_concurrency,
        request_rate=a.request_rate, seed=a.seed, tokenizer=model_dir, warmup_requests=0, flush_cache=True,
        disable_tqdm=True, request_timeout=a.request_timeout)


def warmup(a: argparse.Namespace, url: str, model_dir: str) -> BenchConfig:
    """One prompt of a first turn's length that shares nothing with the workload."""
    return BenchConfig(url=url, backend="pdserve", num_prompts=1, random_input_len=a.system_len + a.first_len,
                       random_output_len=a.output_len, seed=a.seed + 1, tokenizer=model_dir,
                       warmup_requests=0, disable_tqdm=True, request_timeout=a.request_timeout)


@dataclass
class Run:
    """One timed run of one system."""

    records: list[RequestRecord]
    duration_s: float
    max_inflight: int
    counters: dict[str, float]
    rank_pages: dict[str, list[int]]
    loadavg: tuple[float, float]  # this machine's 1-minute load average before and after


def _loadavg() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return math.nan


def measure(system: System, a: argparse.Namespace) -> Run:
    """Start the system, warm it up, run the workload, stop it (always)."""
    try:
        system.start()
        warm = asyncio.run(run(warmup(a, system.url, system.model_dir)))
        if warm.summary.failed:
            raise BenchError(f"{system.name}: the warm-up request failed: {warm.summary.errors}")
        before, load0 = system.counters(), _loadavg()
        res = asyncio.run(run(workload(a, system.url, system.model_dir)))
        after, load1 = system.counters(), _loadavg()
        pages = system.rank_pages()
    finally:
        system.stop()
    return Run(res.records, res.summary.duration_s, res.summary.max_concurrency_seen,
               {k: after[k] - before.get(k, 0.0) for k in after}, pages, (load0, load1))


def combine(name: str, command: str, runs: list[Run]) -> SystemResult:
    """One result over every run of a system: their requests together, their durations summed."""
    records = [r for run_ in runs for r in run_.records]
    summary = summarize(records, sum(r.duration_s for r in runs), {}, max(r.max_inflight for r in runs))
    ok = [r for r in records if r.success]
    counters: dict[str, float] = {}
    for run_ in runs:
        for k, v in run_.counters.items():
            counters[k] = counters.get(k, 0.0) + v
    return SystemResult(name, command, summary, stats_ms([r.ttft for r in ok if r.turn == 0]).mean,
                        stats_ms([r.ttft for r in ok if r.turn]).mean, counters, runs[-1].rank_pages,
                        [run_.loadavg for run_ in runs])


def run_systems(names: list[str], repeats: int, make, measure_one) -> list[SystemResult]:
    """Each system `repeats` times, the order reversed every time (A B B A: a change in the
    machine's other load hits both alike); one result per system over all its runs."""
    runs: dict[str, list[Run]] = {n: [] for n in names}
    commands: dict[str, str] = {}
    for rep in range(repeats):
        for name in (names if rep % 2 == 0 else names[::-1]):
            system = make(name)
            runs[name].append(measure_one(system))
            commands[name] = system.described
            load = runs[name][-1].loadavg
            print(f"  {name} (run {rep + 1}, load average {load[0]:.1f} -> {load[1]:.1f}): {system.described}",
                  flush=True)
    return [combine(n, commands[n], runs[n]) for n in names]


def _ratio(num: float, den: float) -> float:
    return num / den if den and math.isfinite(num) and math.isfinite(den) else math.nan


def comparison(up: SystemResult, colo: SystemResult) -> dict:
    """up / colocated ratios and whether each target is met."""
    lat_u, lat_c = up.summary.latency_ms, colo.summary.latency_ms
    out = {
        "mean_ttft": _ratio(lat_u["ttft"].mean, lat_c["ttft"].mean),
        "median_ttft": _ratio(lat_u["ttft"].median, lat_c["ttft"].median),
        "itl_p50": _ratio(lat_u["itl"].median, lat_c["itl"].median),
        "itl_p99": _ratio(lat_u["itl"].p99, lat_c["itl"].p99),
        "output_throughput": _ratio(up.summary.output_throughput, colo.summary.output_throughput),
        "reused_points": up.reused_pct - colo.reused_pct,
    }
    out["targets_met"] = {
        "mean_ttft": out["mean_ttft"] <= TTFT_RATIO_TARGET,
        "itl_p99": out["itl_p99"] <= ITL_P99_RATIO_TARGET,
        "reused": out["reused_points"] >= -REUSE_POINTS_TARGET,
    }
    return out


def _f(x: float, fmt: str = ".0f") -> str:
    return "n/a" if x is None or not math.isfinite(x) else format(x, fmt)


def format_results(results: list[SystemResult], cmp: dict | None) -> str:
    head = (f"{'system':<15}{'mean TTFT':>10}{'p50 TTFT':>10}{'turn 1':>8}{'turns 2+':>9}{'ITL p50':>9}"
            f"{'ITL p99':>9}{'out tok/s':>10}{'reused':>8}{'failed':>7}")
    lines = [head, "-" * len(head)]
    for r in results:
        lat = r.summary.latency_ms
        lines.append(f"{r.name:<15}{_f(lat['ttft'].mean):>10}{_f(lat['ttft'].median):>10}"
                     f"{_f(r.ttft_first_turn_ms):>8}{_f(r.ttft_later_turns_ms):>9}{_f(lat['itl'].median, '.1f'):>9}"
                     f"{_f(lat['itl'].p99, '.1f'):>9}{_f(r.summary.output_throughput, '.1f'):>10}"
                     f"{_f(r.reused_pct, '.1f') + '%':>8}{r.summary.failed:>7}")
    lines.append("(TTFT and ITL in ms; reused: prompt tokens the replies report as cached)")
    if cmp is not None:
        lines.append(f"{'up/colocated':<15}{_f(cmp['mean_ttft'], '.2f') + 'x':>10}"
                     f"{_f(cmp['median_ttft'], '.2f') + 'x':>10}"
                     f"{'':>17}{_f(cmp['itl_p50'], '.2f') + 'x':>9}{_f(cmp['itl_p99'], '.2f') + 'x':>9}"
                     f"{_f(cmp['output_throughput'], '.2f') + 'x':>10}{_f(cmp['reused_points'], '+.1f') + 'pt':>8}")
        met = cmp["targets_met"]
        word = {True: "met", False: "NOT met"}
        lines.append(f"targets: mean TTFT <= {TTFT_RATIO_TARGET}x colocated: {_f(cmp['mean_ttft'], '.2f')}x "
                     f"({word[met['mean_ttft']]}); ITL p99 <= colocated: {_f(cmp['itl_p99'], '.2f')}x "
                     f"({word[met['itl_p99']]}); reused within {REUSE_POINTS_TARGET:g} points: "
                     f"{_f(cmp['reused_points'], '+.1f')} ({word[met['reused']]})")
    for r in results:
        c = r.counters
        if c:
            turns = int(c.get("local", 0) + c.get("remote", 0))
            lines.append(f"{r.name}: decode prefilled {int(c.get('local', 0))} of {turns} turns itself; KV pages "
                         f"reused from its cache {int(c.get('kv_pages_reused', 0))}, sent by the prefill "
                         f"{int(c.get('kv_pages_transferred', 0))}")
        if r.rank_pages:
            lines.append(f"{r.name}: cached pages per DP rank after the run: "
                         + "; ".join(f"{k} {v}" for k, v in r.rank_pages.items()))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench up", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto", help="both systems' --dtype")
    p.add_argument("--max-total-tokens", type=int, default=32768, help="KV pool tokens per worker, both systems")
    p.add_argument("--conversations", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-len", type=int, default=256, help="tokens of the system prompt every chat shares")
    p.add_argument("--first-len", type=int, default=128, help="tokens of each chat's first message")
    p.add_argument("--question-len", type=int, default=32, help="tokens of each later message")
    p.add_argument("--output-len", type=int, default=32, help="tokens of each answer")
    p.add_argument("--max-concurrency", type=int, default=3, help="chats under way at once")
    p.add_argument("--request-rate", type=float, default=math.inf, help="chat starts per second (inf: at once)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--systems", default="up,colocated", help="which systems, in this order (up, colocated)")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every system this many times, the order reversed each time (A B B A ...: a "
                        "change in the machine's other load hits both alike); each system's figures are "
                        "over all its runs' requests")
    p.add_argument("--up-args", default="", help="more `pdserve up` flags, as one string")
    p.add_argument("--colocated-args", default="", help="more `pdserve serve --role colocated` flags, as one string")
    p.add_argument("--start-timeout", type=float, default=600.0)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--log-dir", default="", help="the systems' logs (default: a new temp dir)")
    p.add_argument("--output", default="", help="write every summary and the ratios to this JSON file")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    names = [n.strip() for n in a.systems.split(",") if n.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if not names or unknown or len(set(names)) != len(names):
        print(f"pdserve bench up: error: --systems takes {', '.join(SYSTEMS)} (each once), got {a.systems!r}",
              file=sys.stderr)
        return 2
    if a.repeats < 1:
        print("pdserve bench up: error: --repeats must be >= 1", file=sys.stderr)
        return 2
    from ..core.envs import Envs
    from ..model_files.resolve import ModelNotFound, resolve_model

    try:
        workload(a, "http://127.0.0.1:1", "")  # a bad workload flag fails before anything starts
        model_dir = resolve_model(a.model, Envs.read().cache_dir)
    except (ModelNotFound, ValueError) as e:
        print(f"pdserve bench up: error: {e}", file=sys.stderr)
        return 2
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="pdserve-bench-up-")
    os.makedirs(log_dir, exist_ok=True)
    print(f"pdserve bench up: {a.conversations} chats x {a.turns} turns (system prompt {a.system_len} tokens, "
          f"first message {a.first_len}, questions {a.question_len}, answers {a.output_len}), "
          f"{a.max_concurrency} in flight; model {model_dir}, dtype {a.dtype}; cores {available_cpus()}; "
          f"logs in {log_dir}", flush=True)
    try:
        results = run_systems(names, a.repeats, lambda name: SYSTEMS[name](a, model_dir, log_dir),
                              lambda system: measure(system, a))
    except (BenchError, OSError) as e:
        print(f"pdserve bench up: error: {e}", file=sys.stderr)
        return 2
    by_name = {r.name: r for r in results}
    cmp = comparison(by_name["up"], by_name["colocated"]) if {"up", "colocated"} <= by_name.keys() else None
    print(format_results(results, cmp), flush=True)
    if a.output:
        with open(a.output, "w", encoding="utf-8") as f:
            json.dump(finite({"args": vars(a), "model_dir": model_dir, "cores": available_cpus(),
                              "systems": {r.name: {**asdict(r), "reused_pct": r.reused_pct} for r in results},
                              "up_vs_colocated": cmp}), f, indent=1, allow_nan=False)
        print(f"results written to {a.output}")
    return 0 if all(r.summary.failed == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
