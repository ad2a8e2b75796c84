"""`pdserve bench chaos`: a load generator runs for a bounded time against a router in front of
two prefill and two decode servers while a seeded schedule breaks them: it SIGKILLs a DP worker
or a whole server (restarted on the same ports after `--down-s`), SIGSTOPs a prefill's workers
for `--stall-s` (its prefills and transfers stall), or cuts every router<->server connection of
one server (a TcpProxy sits in front of each). One fault every `--fault-every-s` seconds on
average, one at a time; with `--overlap` cuts and stalls go on while a killed server restarts
(at most one server is down).

Every request's outcome is one of: ok (complete, and equal to the fault-free greedy answer
computed before the faults began), wrong (a 200 whose answer differs or is cut short), error
(an HTTP error or an error event, with its message), hung (no end within `--request-timeout-s`).
Migrations are read from the router's metrics. Afterwards every server must come back healthy
with no page held (stranded pages), and the open fds and threads of the router and of every server
process that lived through the run must be flat, and their RSS within --rss-slack-mib.
"""

from __future__ import annotations

import argparse
import asyncio
import enum
import json
import os
import random
import re
import signal
import statistics
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import httpx

from .chaos_cluster import ChaosCluster, ChaosServer, proc_fds, proc_rss_kb

WORDS = ("the quick brown fox jumps over a lazy dog while seven small birds sing near the old river "
         "bank and one tired cat sleeps under a warm red blanket").split()
KINDS = ("generate", "generate-stream", "chat-stream")
IDLE_CLOSE_S = 8.0  # longer than any idle connection the cluster keeps open
SHORT_DEADLINES = {  # --short-deadlines: a broken handoff ends in seconds, not minutes
    "PDSERVE_BOOTSTRAP_TIMEOUT": "8", "PDSERVE_WAITING_TIMEOUT": "20", "PDSERVE_DP_RANK_QUERY_TIMEOUT": "10",
    "PDSERVE_TOPOLOGY_TIMEOUT": "5", "PDSERVE_HEARTBEAT_INTERVAL": "0.5", "PDSERVE_HEARTBEAT_MAX_FAILURE": "2",
    "PDSERVE_ROOM_TTL": "5", "PDSERVE_KV_QUARANTINE_TIMEOUT": "10"}


class Fault(str, enum.Enum):
    KILL_WORKER = "kill_worker"  # SIGKILL one DP worker: its server goes unhealthy, then restarts
    KILL_SERVER = "kill_server"  # SIGKILL a server's whole process group, then restart it
    STALL = "stall"  # SIGSTOP a prefill's workers for --stall-s, then SIGCONT
    CUT = "cut"  # break every router<->server connection of one server


class Outcome(str, enum.Enum):
    OK = "ok"
    WRONG = "wrong"
    ERROR = "error"
    HUNG = "hung"


@dataclass
class Result:
    kind: str
    outcome: Outcome
    seconds: float
    detail: str = ""


@dataclass
class FaultEvent:
    at_s: float
    fault: Fault
    target: str
    healed_s: float = 0.0


@dataclass
class Report:
    duration_s: float
    requests: int
    outcomes: dict[str, int]
    migrated: int
    success_rate: float
    error_seconds_median: float
    error_seconds_max: float
    error_samples: list[str]
    error_kinds: dict[str, int]  # errors by message, with ids, rooms, ports and numbers masked
    wrong_samples: list[str]
    faults: list[dict]
    stranded_pages: int
    unhealthy_servers: list[str]
    router_growth: dict[str, int]
    # every server process (front or DP worker) alive from the first third to the end: how many,
    # and the most any of them grew in fds, threads and RSS
    survivor_growth: dict[str, int]
    flat: bool
    ok: bool = field(default=False)


# ---- requests ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    kind: str
    prompt: str
    max_new: int

    def body(self) -> tuple[str, dict]:
        if self.kind == "chat-stream":
            return "/v1/chat/completions", {
                "messages": [{"role": "user", "content": self.prompt}],
                "max_tokens": self.max_new, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        return "/generate", {"text": self.prompt, "stream": self.kind == "generate-stream",
                             "sampling_params": {"max_new_tokens": self.max_new, "temperature": 0,
                                                 "ignore_eos": True}}


async def _answer(c: httpx.AsyncClient, url: str, job: Job) -> tuple[int, object, str]:
    """(HTTP status, the answer: output ids or text, an error message or "")."""
    path, body = job.body()
    if not body["stream"]:
        r = await c.post(url + path, json=body)
        if r.status_code != 200:
            return r.status_code, None, r.text[:300]
        out = r.json()
        return 200, (out.get("output_ids"), out.get("meta_info", {}).get("completion_tokens")), ""
    async with c.stream("POST", url + path, json=body) as r:
        if r.status_code != 200:
            return r.status_code, None, (await r.aread()).decode(errors="replace")[:300]
        text, ids, done, usage = [], None, False, None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                break
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return 200, None, json.dumps(chunk["error"])[:300]
            if job.kind == "chat-stream":
                for ch in chunk.get("choices") or []:
                    text.append((ch.get("delta") or {}).get("content") or "")
                usage = chunk.get("usage") or usage
            else:
                ids = chunk.get("output_ids", ids)
        if not done:
            return 200, None, "the stream ended without [DONE]"
        if job.kind == "chat-stream":
            return 200, ("".join(text), (usage or {}).get("completion_tokens")), ""
        return 200, (ids, len(ids or [])), ""


async def _one(c: httpx.AsyncClient, url: str, job: Job, ref, timeout: float) -> Result:
    t0 = time.monotonic()
    try:
        status, got, err = await asyncio.wait_for(_answer(c, url, job), timeout)
    except asyncio.TimeoutError:
        return Result(job.kind, Outcome.HUNG, time.monotonic() - t0, "no end within the request timeout")
    except (httpx.HTTPError, ValueError) as e:
        return Result(job.kind, Outcome.ERROR, time.monotonic() - t0, f"{type(e).__name__}: {e}"[:300])
    dt = time.monotonic() - t0
    if err:
        return Result(job.kind, Outcome.ERROR, dt, f"{status}: {err}")
    if ref is not None and got != ref:
        return Result(job.kind, Outcome.WRONG, dt, f"{job.kind} {job.prompt[:30]!r}: {got!r} != {ref!r}"[:400])
    return Result(job.kind, Outcome.OK, dt)


# ---- faults -----------------------------------------------------------------------------------
class FaultRunner(threading.Thread):
    """Applies the seeded schedule to the cluster until `stop` is set. A killed server restarts
    before the next fault, or with --overlap in the background while cuts and stalls go on
    elsewhere; at most one server is down at a time, so the cluster keeps a prefill and a decode."""

    KILLS = (Fault.KILL_WORKER, Fault.KILL_SERVER)

    def __init__(self, cluster: ChaosCluster, a, t0: float):
        super().__init__(name="chaos-faults", daemon=True)
        self.cluster, self.a, self.t0 = cluster, a, t0
        self.rng = random.Random(a.seed)
        self.stop = threading.Event()
        self.events: list[FaultEvent] = []
        self.error: BaseException | None = None
        self.down: ChaosServer | None = None  # the server restarting now
        self.restarts: list[threading.Thread] = []

    def run(self) -> None:
        try:
            kinds = [Fault(k) for k in self.a.faults.split(",")]
            while not self.stop.wait(self.rng.uniform(0.5, 1.5) * self.a.fault_every_s):
                down = self.down
                allowed = [k for k in kinds if down is None or k not in self.KILLS]
                if not allowed:
                    continue
                fault = self.rng.choice(allowed)
                pool = [s for s in self.cluster.servers if s is not down
                        and (fault is not Fault.STALL or s.role == "prefill")]
                target = self.rng.choice(pool)
                ev = FaultEvent(round(time.monotonic() - self.t0, 2), fault, target.name)
                self.events.append(ev)
                self._apply(fault, target, ev)
            for t in self.restarts:
                t.join(self.a.start_timeout + self.a.down_s + 10)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            self.error = e

    def _healed(self, ev: FaultEvent) -> None:
        ev.healed_s = round(time.monotonic() - self.t0, 2)

    def _apply(self, fault: Fault, s: ChaosServer, ev: FaultEvent) -> None:
        if fault is Fault.CUT:
            s.proxy.cut()
            return self._healed(ev)
        if fault is Fault.STALL:
            pids = s.worker_pids()
            for pid in pids:
                os.kill(pid, signal.SIGSTOP)
            time.sleep(self.a.stall_s)
            for pid in pids:
                os.kill(pid, signal.SIGCONT)
            return self._healed(ev)
        if fault is Fault.KILL_WORKER:
            pids = s.worker_pids()
            if pids:
                os.kill(self.rng.choice(pids), signal.SIGKILL)
        else:
            s.group.signal(signal.SIGKILL)
        self.down = s
        if not self.a.overlap:  # one fault at a time: the schedule waits for the restart
            return self._restart(s, ev)
        t = threading.Thread(target=self._restart, args=(s, ev), name=f"chaos-restart-{s.name}", daemon=True)
        self.restarts.append(t)
        t.start()

    def _restart(self, s: ChaosServer, ev: FaultEvent) -> None:
        try:
            time.sleep(self.a.down_s)
            s.stop()
            s.start()
            s.wait_ready(self.a.start_timeout)
            self._healed(ev)
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            self.error = e
        finally:
            self.down = None


# ---- the run ----------------------------------------------------------------------------------
def _jobs(a) -> list[Job]:
    rng = random.Random(a.seed + 1)
    return [Job(KINDS[i % len(KINDS)], " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 40))),
                rng.randint(a.min_tokens, a.max_tokens)) for i in range(a.distinct_prompts)]


def _migrations(url: str) -> int:
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return 0
    total = 0.0
    for line in text.splitlines():
        m = re.match(r'pdserve_router_migrations_total\{([^}]*)\} ([0-9.e+]+)', line)
        if m and 'outcome="' in m.group(1) and 'outcome="failed"' not in m.group(1):
            total += float(m.group(2))
    return int(total)


def _proc_sample(pid: int) -> dict[str, int]:
    """Open fds, threads and RSS of one process."""
    threads = len(os.listdir(f"/proc/{pid}/task")) if os.path.isdir(f"/proc/{pid}/task") else 0
    return {"fds": proc_fds(pid), "threads": threads, "rss_kb": proc_rss_kb(pid)}


def _server_samples(cluster: ChaosCluster) -> dict[int, dict[str, int]]:
    """pid -> sample, for every server front and DP worker now alive."""
    return {pid: _proc_sample(pid) for srv in cluster.servers for pid in srv.pids()}


def _survivor_growth(third: dict[int, dict], end: dict[int, dict]) -> dict[str, int]:
    alive = [pid for pid in third if pid in end]
    out = {"processes": len(alive)}
    for k in ("fds", "threads", "rss_kb"):
        out[f"max_{k}"] = max((end[pid][k] - third[pid][k] for pid in alive), default=0)
    return out


async def _load(cluster: ChaosCluster, a, jobs: list[Job], refs: dict, end: float, third: dict) -> list[Result]:
    results: list[Result] = []
    rng = random.Random(a.seed + 2)
    t_third = time.monotonic() + (end - time.monotonic()) / 3
    limits = httpx.Limits(max_connections=a.concurrency * 2, max_keepalive_connections=a.concurrency)
    async with httpx.AsyncClient(timeout=None, limits=limits) as c:
        async def client():
            while time.monotonic() < end:
                job = rng.choice(jobs)
                results.append(await _one(c, cluster.router_url, job, refs[job], a.request_timeout_s))
                if not third and time.monotonic() >= t_third:
                    third.update(_proc_sample(cluster.router.proc.pid), servers=_server_samples(cluster))
        await asyncio.gather(*(client() for _ in range(a.concurrency)))
    return results


async def _references(cluster: ChaosCluster, a, jobs: list[Job]) -> dict:
    refs = {}
    async with httpx.AsyncClient(timeout=a.request_timeout_s) as c:
        for job in jobs:
            status, got, err = await _answer(c, cluster.router_url, job)
            if err or got is None:
                raise RuntimeError(f"the fault-free reference for {job} failed: {status} {err}")
            refs[job] = got
    return refs


def _settle(cluster: ChaosCluster, timeout: float) -> tuple[int, list[str]]:
    """Wait for every server healthy and idle; (pages still held, servers not healthy)."""
    deadline = time.monotonic() + timeout
    while True:
        unhealthy = [s.name for s in cluster.servers if not s.healthy()]
        held = [s.held_pages() for s in cluster.servers]
        if not unhealthy and all(h == 0 for h in held):
            return 0, []
        if time.monotonic() > deadline:
            return sum(max(h, 0) for h in held), unhealthy
        time.sleep(0.3)


def _growth_once_idle(cluster: ChaosCluster, third: dict, a) -> tuple[dict, dict, bool]:
    """(router growth, survivor growth, flat) since the first third, sampled again every 0.5 s
    for up to IDLE_CLOSE_S while not flat: idle keep-alive connections (the router's 4 s, the
    bootstrap client's 5 s) and a restarted peer's old transfer connections close within that,
    a leak does not."""
    deadline = time.monotonic() + IDLE_CLOSE_S
    while True:
        end_sample = _proc_sample(cluster.router.proc.pid)
        growth = {k: end_sample[k] - third.get(k, end_sample[k]) for k in end_sample}
        survivors = _survivor_growth(third.get("servers", {}), _server_samples(cluster))
        flat = all(g <= a.fd_slack for g in (growth["fds"], growth["threads"], survivors["max_fds"],
                                             survivors["max_threads"])) \
            and max(growth["rss_kb"], survivors["max_rss_kb"]) <= a.rss_slack_mib * 1024
        if flat or time.monotonic() > deadline:
            return growth, survivors, flat
        time.sleep(0.5)


def run(a) -> Report:
    log_dir = a.log_dir or tempfile.mkdtemp(prefix="pdserve-chaos-")
    os.makedirs(log_dir, exist_ok=True)
    server_args = ["--model", a.model, *a.server_args.split()]
    router_flags = ["--health-check-interval-secs", "1", *a.router_args.split()]
    if a.migration_limit >= 0:
        router_flags += ["--migration-limit", str(a.migration_limit)]
    env = dict(SHORT_DEADLINES) if a.short_deadlines else {}
    cluster = ChaosCluster.start(server_args, router_flags, log_dir, env, a.start_timeout)
    try:
        jobs = _jobs(a)
        refs = asyncio.run(_references(cluster, a, jobs))
        migrated0 = _migrations(cluster.router_url)
        t0 = time.monotonic()
        faults = FaultRunner(cluster, a, t0)
        faults.start()
        third: dict = {}
        results = asyncio.run(_load(cluster, a, jobs, refs, t0 + a.duration_s, third))
        faults.stop.set()
        faults.join(timeout=a.start_timeout + a.down_s + a.stall_s + 30)
        if faults.error:
            raise RuntimeError(f"the fault schedule failed: {faults.error!r}")
        duration = time.monotonic() - t0
        stranded, unhealthy = _settle(cluster, a.settle_s)
        growth, survivors, flat = _growth_once_idle(cluster, third, a)
        migrated = _migrations(cluster.router_url) - migrated0
    finally:
        cluster.close()
    counts = Counter(r.outcome.value for r in results)
    errs = [r for r in results if r.outcome is Outcome.ERROR]
    n = len(results)
    report = Report(
        duration_s=round(duration, 1), requests=n, outcomes={o.value: counts.get(o.value, 0) for o in Outcome},
        migrated=migrated, success_rate=round(counts.get("ok", 0) / n, 4) if n else 0.0,
        error_seconds_median=round(statistics.median([r.seconds for r in errs]), 2) if errs else 0.0,
        error_seconds_max=round(max([r.seconds for r in errs]), 2) if errs else 0.0,
        error_samples=sorted({r.detail[:160] for r in errs})[:8],
        error_kinds=dict(Counter(error_kind(r.detail) for r in errs).most_common(10)),
        wrong_samples=[r.detail for r in results if r.outcome is Outcome.WRONG][:5],
        faults=[asdict(e) for e in faults.events], stranded_pages=stranded, unhealthy_servers=unhealthy,
        router_growth=growth, survivor_growth=survivors, flat=flat)
    report.ok = (report.outcomes["hung"] == 0 and report.outcomes["wrong"] == 0 and stranded == 0
                 and not unhealthy and flat and report.success_rate >= a.min_success)
    return report


_NOISE = re.compile(r"[0-9a-f]{32}|\[[0-9, ]+\]|\d+")


def error_kind(detail: str) -> str:
    """An error's message with what differs between requests masked, so like errors count together."""
    return _NOISE.sub("#", detail)[:150]


def print_report(r: Report) -> None:
    print(f"chaos: {r.duration_s} s, {len(r.faults)} faults "
          f"({dict(Counter(f['fault'].value if isinstance(f['fault'], Fault) else f['fault'] for f in r.faults))})")
    print(f"requests {r.requests}: " + ", ".join(f"{k} {v}" for k, v in r.outcomes.items())
          + f"; migrated {r.migrated}; success {r.success_rate:.2%}")
    print(f"errors ended in median {r.error_seconds_median} s, max {r.error_seconds_max} s")
    for kind, count in r.error_kinds.items():
        print(f"  {count:5d} x {kind}")
    for s in r.error_samples:
        print(f"  error: {s}")
    for s in r.wrong_samples:
        print(f"  wrong: {s}")
    print(f"stranded pages {r.stranded_pages}; unhealthy after the run {r.unhealthy_servers or 'none'}; "
          f"growth after the first third: router {r.router_growth}, the most of any server process alive "
          f"throughout {r.survivor_growth} ({'flat' if r.flat else 'NOT flat'})")
    print("PASS" if r.ok else "FAIL")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve bench chaos", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m", help="model (name or directory) for every server")
    p.add_argument("--server-args", default="--dtype float32 --num-threads 1 --max-total-tokens 4096",
                   help="more `pdserve serve` flags for every server")
    p.add_argument("--router-args", default="", help="more `pdserve router` flags")
    p.add_argument("--migration-limit", type=int, default=2, help="the router's; -1: its default")
    p.add_argument("--duration-s", type=float, default=120.0)
    p.add_argument("--fault-every-s", type=float, default=4.0, help="mean gap between faults")
    p.add_argument("--faults", default=",".join(f.value for f in Fault),
                   help="comma-separated fault kinds to draw from (repeat one to weigh it)")
    p.add_argument("--down-s", type=float, default=1.0, help="a killed server stays down this long")
    p.add_argument("--stall-s", type=float, default=1.5)
    p.add_argument("--overlap", action="store_true",
                   help="cuts and stalls go on while a killed server restarts (double faults)")
    p.add_argument("--concurrency", type=int, default=6)
    p.add_argument("--distinct-prompts", type=int, default=24)
    p.add_argument("--min-tokens", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--request-timeout-s", type=float, default=60.0)
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--settle-s", type=float, default=60.0)
    p.add_argument("--fd-slack", type=int, default=8,
                   help="fds/threads the router, or a server process, may add after the first third")
    p.add_argument("--rss-slack-mib", type=float, default=64,
                   help="RSS the router, or a server process, may add after the first third")
    p.add_argument("--min-success", type=float, default=0.99)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--short-deadlines", action=argparse.BooleanOptionalAction, default=True,
                   help="servers run with handoff deadlines of seconds (SHORT_DEADLINES)")
    p.add_argument("--log-dir", default="")
    p.add_argument("--json", default="", help="also write the report here")
    return p


def main(argv=None) -> None:
    a = build_parser().parse_args(argv)
    r = run(a)
    print_report(r)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(asdict(r), f, indent=1, default=str)
    raise SystemExit(0 if r.ok else 1)


if __name__ == "__main__":
    main()
