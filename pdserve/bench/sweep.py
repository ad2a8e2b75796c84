"""`pdserve bench sweep`: colocated vs PD under rising load, and the PD handoff cost vs prompt length.

Runs one deployment at a time on free 127.0.0.1 ports (a colocated server; then prefill + decode
+ router), sends the same prompts at each load point with `bench serve`, probes single requests
of growing prompt length through /generate for TTFT and the handoff timings in meta_info, stops
every process by pid (also on Ctrl-C or SIGTERM), and writes sweep.json plus the plots of `plots.py`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import platform
import shlex
import signal
import sys
import tempfile
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import httpx

from ..core.config import add_dataclass_args, dataclass_from_args
from ..core.launcher import ProcessGroup, free_port, http_ok, stop_all
from ..core.pd_vocab import SERVED_BACKENDS
from .arrivals import ArrivalKind
from .datasets import TokenCounter, random_requests
from .serve import BenchConfig, BenchError
from .serve import run as run_bench

PERCENTILES = ("median", "p90", "p99")
HANDOFF_KEYS = ("bootstrap_room", "prefill_dp_rank", "decode_dp_rank", "dp_rank_path", "resolve_s",
                "prealloc_wait_s", "bootstrap_s", "waiting_s", "kv_bytes", "kv_transfer_s", "kv_gbps")


def _opt(help: str, choices: tuple | None = None, **kw):
    return field(metadata={"help": help, "choices": choices}, **kw)


@dataclass(frozen=True)
class SweepConfig:
    """One sweep; the CLI flags are generated from these fields."""

    model: str = _opt("local HF dir, .gguf file, or 'smollm2-135m'", default="smollm2-135m")
    out_dir: str = _opt("where sweep.json and the PNG plots go", default="docs/bench")
    deployments: str = _opt("which to run, in order (colocated, pd)", default="colocated,pd")
    rates: str = _opt("request rates (req/s) of the rate sweep; 'inf' = all at once", default="0.25,0.5,1,2,inf")
    arrival: str = _opt("arrivals at a rate: fixed intervals (steadier with few requests) or poisson",
                        tuple(k.value for k in ArrivalKind), default="fixed")
    concurrencies: str = _opt("max-concurrency points, each sent all at once", default="1,2,4,8,16")
    num_prompts: int = _opt("requests per load point (at least 2x the cap at a concurrency point)", default=8)
    input_len: int = _opt("prompt tokens of the load points", default=256)
    output_len: int = _opt("output tokens of the load points", default=32)
    probe_lens: str = _opt("prompt lengths (tokens) of the single-request probe",
                           default="128,256,512,1024,2048,4096")
    probe_output_len: int = _opt("output tokens of each probe request", default=1)
    probe_repeats: int = _opt("requests per probe length; the fastest is kept (least disturbed)", default=2)
    colocated_dp: int = _opt("DP workers of the colocated server", default=2)
    prefill_dp: int = _opt("DP workers of the prefill server", default=1)
    decode_dp: int = _opt("DP workers of the decode server", default=1)
    threads_per_worker: int = _opt("torch threads per worker (0 = cores / workers)", default=0)
    max_total_tokens: int = _opt("KV pool tokens per worker", default=16384)
    transfer_backend: str = _opt("KV transfer backend of the PD cluster", SERVED_BACKENDS, default="tcp")
    server_args: str = _opt("extra flags for every `pdserve serve`, e.g. '--dtype float32'", default="")
    seed: int = _opt("seed of the prompts and arrivals (load point i uses seed + i)", default=1)
    request_timeout: float = _opt("seconds one request may take", default=600.0)
    start_timeout: float = _opt("seconds a deployment may take to answer its first request", default=600.0)
    log_dir: str = _opt("server logs (default: a temp dir)", default="")
    no_plots: bool = _opt("write the JSON only", default=False)
    replot: str = _opt("run nothing: redraw the plots of this saved sweep.json into --out-dir", default="")

    def __post_init__(self) -> None:
        parse_rates(self.rates), parse_ints(self.concurrencies), parse_ints(self.probe_lens)
        ArrivalKind(self.arrival)
        unknown = set(self.deployment_names()) - set(DEPLOYMENTS)
        if unknown or not self.deployment_names():
            raise ValueError(f"--deployments takes colocated and/or pd, got {self.deployments!r}")
        if min(self.num_prompts, self.input_len, self.output_len, self.probe_output_len, self.probe_repeats) < 1:
            raise ValueError("num_prompts, input_len, output_len, probe_output_len and probe_repeats must be >= 1")

    def deployment_names(self) -> list[str]:
        return [d.strip() for d in self.deployments.split(",") if d.strip()]


@dataclass(frozen=True)
class LoadPoint:
    """One `bench serve` run: `num_prompts` arrivals at `rate` (inf = all at once) under a concurrency cap."""

    rate: float
    max_concurrency: int  # 0 = no cap
    num_prompts: int
    seed: int

    @property
    def label(self) -> str:
        return f"rate={self.rate:g}" + (f",conc={self.max_concurrency}" if self.max_concurrency else "")

    @property
    def json_rate(self) -> float | str:
        """The rate as strict JSON holds it: "inf" for all at once (as `bench serve` writes it)."""
        return "inf" if math.isinf(self.rate) else self.rate

    def to_json(self) -> dict:
        return {**dataclasses.asdict(self), "rate": self.json_rate}


def parse_rates(text: str) -> list[float]:
    """'0.5,1,inf' -> [0.5, 1.0, inf]; every rate > 0."""
    rates = [float(t) for t in text.split(",") if t.strip()]
    if not rates or any(not r > 0 for r in rates):
        raise ValueError(f"rates must be > 0 (or inf), got {text!r}")
    return rates


def parse_ints(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; every value >= 1. An empty text is an empty list."""
    values = [int(t) for t in text.split(",") if t.strip()]
    if any(v < 1 for v in values):
        raise ValueError(f"values must be >= 1, got {text!r}")
    return values


def load_points(rates: list[float], concurrencies: list[int], num_prompts: int, seed: int) -> list[LoadPoint]:
    """The rate sweep (no cap) then the concurrency sweep (all at once, >= 2 requests per slot so
    the cap is held for a while); point i gets seed + i, so every deployment sees the same
    prompts at the same point and no prompt repeats."""
    specs = [(r, 0, num_prompts) for r in rates] + [(math.inf, c, max(num_prompts, 2 * c)) for c in concurrencies]
    return [LoadPoint(r, c, n, seed + i) for i, (r, c, n) in enumerate(specs)]


def point_row(deployment: str, point: LoadPoint, summary: dict) -> dict:
    """One flat table row of a load point's `bench serve` summary (as JSON)."""
    row = {"deployment": deployment, "rate": point.json_rate,
           "max_concurrency": point.max_concurrency, "completed": summary["completed"],
           "failed": summary["failed"], "request_throughput": summary["request_throughput"],
           "output_throughput": summary["output_throughput"],
           "total_token_throughput": summary["total_token_throughput"]}
    for metric in ("ttft", "itl", "tpot", "e2e"):
        for p in PERCENTILES:
            row[f"{metric}_{p}_ms"] = summary["latency_ms"][metric][p]
    return row


def handoff_row(deployment: str, prompt_len: int, wall_s: float, meta: dict) -> dict:
    """The handoff breakdown of one probe, in milliseconds, as four parts that do not overlap:
    bootstrap (resolve rank + send kv_req, prealloc excluded), prealloc wait, waiting for the
    prefill (its queue and compute), and the KV transfer itself."""
    boot, pre, wait, xfer = (None if meta.get(k) is None else meta[k] * 1000.0
                             for k in ("bootstrap_s", "prealloc_wait_s", "waiting_s", "kv_transfer_s"))
    pre = pre or 0.0
    row = {"deployment": deployment, "prompt_len": prompt_len, "server_prompt_tokens": meta.get("prompt_tokens"),
           "ttft_ms": wall_s * 1000.0, "kv_bytes": meta.get("kv_bytes"),
           "handoff": {k: meta[k] for k in HANDOFF_KEYS if k in meta}}
    row["bootstrap_ms"] = None if boot is None else max(0.0, boot - pre)
    row["prealloc_wait_ms"] = pre if boot is not None else None
    row["prefill_wait_ms"] = None if wait is None else max(0.0, wait - (xfer or 0.0))
    row["transfer_ms"] = xfer
    return row


class Deployment(ABC):
    """Server processes on 127.0.0.1 that answer /generate at the URL `start()` returns.

    Contract: `start()` returns only once one short /generate succeeded, or raises naming the
    process that died (with its log's tail) or the missed deadline; `stop()` ends every process
    it started, by process-group id so their DP workers go too, and is safe to call twice and
    after a failed start."""

    def __init__(self, cfg: SweepConfig, model_dir: str):
        self.cfg, self.model_dir = cfg, model_dir
        self.log_dir = cfg.log_dir or tempfile.mkdtemp(prefix="pdserve-sweep-")
        os.makedirs(self.log_dir, exist_ok=True)
        self.groups: list[ProcessGroup] = []

    @abstractmethod
    def describe(self) -> str: ...

    @abstractmethod
    def _launch(self, deadline: float) -> str:
        """Spawn the processes, wait for their /health, return the entry URL."""

    def start(self) -> str:
        deadline = time.monotonic() + self.cfg.start_timeout
        url = self._launch(deadline)
        body = {"text": "warm up", "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}
        self._wait(url + "/generate", deadline, lambda u: _post_ok(u, body))
        return url

    def _serve(self, name: str, role: str, dp: int, workers: int, extra: list[str]) -> str:
        port = free_port()
        threads = self.cfg.threads_per_worker or max(1, (os.cpu_count() or 1) // workers)
        self._spawn(name, ["serve", "--role", role, "--model", self.model_dir, "--host", "127.0.0.1",
                           "--port", str(port), "--dp-size", str(dp), "--num-threads", str(threads),
                           "--max-total-tokens", str(self.cfg.max_total_tokens), "--log-level", "warning",
                           *extra, *shlex.split(self.cfg.server_args)])
        return f"http://127.0.0.1:{port}"

    def _spawn(self, name: str, args: list[str]) -> None:
        self.groups.append(ProcessGroup([sys.executable, "-m", "pdserve", *args], name=name,
                                        log_path=os.path.join(self.log_dir, f"{name}.log")))

    def pids(self) -> list[int]:
        return [g.pid for g in self.groups]

    def _wait(self, url: str, deadline: float, ok=http_ok) -> None:
        """Until `url` answers 200 by the deadline; any process of this deployment that exits
        first fails the wait, naming itself with the end of its log."""
        def ready() -> bool:
            for g in self.groups:
                g.check_running(" while starting")
            return ok(url)
        self.groups[-1].wait_healthy(ready, deadline - time.monotonic(), what=url, poll_s=0.5)

    def stop(self) -> None:
        stop_all(reversed(self.groups), grace_s=20.0)  # by group: the DP workers too
        self.groups = []


def _post_ok(url: str, body: dict) -> bool:
    try:
        return httpx.post(url, json=body, timeout=60).status_code == 200
    except httpx.HTTPError:
        return False


class ColocatedDeployment(Deployment):
    """One colocated server: each DP worker prefills and decodes its own requests."""

    def describe(self) -> str:
        return f"colocated dp={self.cfg.colocated_dp}"

    def _launch(self, deadline: float) -> str:
        url = self._serve("colocated", "colocated", self.cfg.colocated_dp, self.cfg.colocated_dp, [])
        self._wait(url + "/health", deadline)
        return url


class PDDeployment(Deployment):
    """A prefill server, a decode server and the PD router in front of them."""

    def describe(self) -> str:
        c = self.cfg
        return f"prefill dp={c.prefill_dp} + decode dp={c.decode_dp} + router, {c.transfer_backend}"

    def _launch(self, deadline: float) -> str:
        c, bootstrap = self.cfg, free_port()
        workers, backend = c.prefill_dp + c.decode_dp, ["--transfer-backend", c.transfer_backend]
        prefill = self._serve("prefill", "prefill", c.prefill_dp, workers,
                              ["--bootstrap-port", str(bootstrap), *backend])
        decode = self._serve("decode", "decode", c.decode_dp, workers, backend)
        self._wait(prefill + "/health", deadline)
        self._wait(decode + "/health", deadline)
        port = free_port()
        self._spawn("router", ["router", "--pd-disaggregation", "--host", "127.0.0.1", "--port", str(port),
                               "--prefill", prefill, str(bootstrap), "--decode", decode])
        url = f"http://127.0.0.1:{port}"
        self._wait(url + "/health", deadline)
        return url


DEPLOYMENTS: dict[str, type[Deployment]] = {"colocated": ColocatedDeployment, "pd": PDDeployment}


def probe(url: str, deployment: str, lengths: list[int], cfg: SweepConfig, counter: TokenCounter) -> list[dict]:
    """Non-streamed /generate requests, one at a time, `probe_repeats` per prompt length; the wall
    time is the TTFT when they ask for one token. Keeps the fastest repeat, with every TTFT seen."""
    rows = []
    for i, n in enumerate(lengths):
        samples = []
        for rep in range(cfg.probe_repeats):
            req = random_requests(1, n, cfg.probe_output_len, 1.0, cfg.seed + 1000 + 100 * i + rep, counter)[0]
            body = {"text": req.prompt, "sampling_params": {"max_new_tokens": cfg.probe_output_len,
                                                            "temperature": 0.0, "ignore_eos": True}}
            t0 = time.perf_counter()
            r = httpx.post(url + "/generate", json=body, timeout=cfg.request_timeout)
            wall = time.perf_counter() - t0
            if r.status_code != 200:
                raise BenchError(f"{deployment} probe of {n} prompt tokens: HTTP {r.status_code}: {r.text[:300]}")
            samples.append(handoff_row(deployment, req.prompt_len, wall, r.json().get("meta_info") or {}))
        best = min(samples, key=lambda row: row["ttft_ms"])
        rows.append({**best, "ttft_samples_ms": [row["ttft_ms"] for row in samples]})
    return rows


async def run_points(url: str, deployment: str, points: list[LoadPoint], cfg: SweepConfig,
                     tokenizer: str) -> list[dict]:
    runs = []
    for point in points:
        bench = BenchConfig(url=url, backend="pdserve", num_prompts=point.num_prompts,
                            random_input_len=cfg.input_len, random_output_len=cfg.output_len,
                            random_range_ratio=1.0, tokenizer=tokenizer, seed=point.seed,
                            request_rate=point.rate, arrival=cfg.arrival,
                            max_concurrency=point.max_concurrency,
                            warmup_requests=int(point is points[0]), request_timeout=cfg.request_timeout,
                            disable_tqdm=True)
        result = (await run_bench(bench)).to_json()
        row = point_row(deployment, point, result["summary"])
        print(f"  {deployment:<9} {point.label:<16} ok={row['completed']}/{point.num_prompts} "
              f"TTFT p50={row['ttft_median_ms'] or math.nan:.0f}ms ITL p50={row['itl_median_ms'] or math.nan:.1f}ms "
              f"{row['output_throughput']:.1f} out tok/s", flush=True)
        runs.append({"deployment": deployment, "point": point.to_json(), "row": row,
                     "summary": result["summary"], "requests": result["requests"]})
    return runs


def machine_info() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "gpu": "none used (CPU run)",
            "load_avg_1m_at_start": os.getloadavg()[0]}  # other work on the machine skews the figures


def sweep(cfg: SweepConfig, model_dir: str) -> dict:
    """Run every deployment in turn and return the whole result (JSON-ready)."""
    points = load_points(parse_rates(cfg.rates), parse_ints(cfg.concurrencies), cfg.num_prompts, cfg.seed)
    counter = TokenCounter(model_dir)
    out: dict = {"machine": machine_info(), "config": dataclasses.asdict(cfg), "model_dir": model_dir,
                 "runs": [], "table": [], "lengths": []}
    t0 = time.monotonic()
    for name in cfg.deployment_names():
        dep = DEPLOYMENTS[name](cfg, model_dir)
        try:
            print(f"starting {name} ({dep.describe()}) ...", flush=True)
            url = dep.start()
            pids = ",".join(str(pid) for pid in dep.pids())
            print(f"  {name} ready at {url} (pids {pids}) after {time.monotonic() - t0:.0f}s", flush=True)
            runs = asyncio.run(run_points(url, name, points, cfg, model_dir))
            out["runs"] += runs
            out["table"] += [r["row"] for r in runs]
            out["lengths"] += probe(url, name, parse_ints(cfg.probe_lens), cfg, counter)
        finally:
            dep.stop()
    out["wall_s"] = time.monotonic() - t0
    out["machine"]["load_avg_1m_at_end"] = os.getloadavg()[0]
    return out


def write_outputs(result: dict, out_dir: str, plots: bool = True) -> list[str]:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "sweep.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1, allow_nan=False)
    if not plots:
        return [path]
    from .plots import write_plots

    return [path, *write_plots(result, out_dir)]


def _raise_interrupt(signum, frame):
    raise KeyboardInterrupt


def _replot(path: str, out_dir: str) -> list[str]:
    from .plots import write_plots

    with open(path, encoding="utf-8") as f:
        return write_plots(json.load(f), out_dir)


def main(argv: list[str] | None = None) -> int:
    """CLI entry: 0 when every request succeeded, 1 when some failed, 2 on a bad config or setup."""
    p = argparse.ArgumentParser(prog="pdserve bench sweep", description=__doc__.splitlines()[0])
    add_dataclass_args(p, SweepConfig)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)  # stop the servers on SIGTERM too
    try:
        cfg = dataclass_from_args(SweepConfig, p.parse_args(argv))
        if cfg.replot:
            paths = _replot(cfg.replot, cfg.out_dir)
        else:
            from ..core.envs import Envs
            from ..model_files.resolve import resolve_model

            result = sweep(cfg, resolve_model(cfg.model, Envs.read().cache_dir))
            paths = write_outputs(result, cfg.out_dir, plots=not cfg.no_plots)
    except (ValueError, BenchError, RuntimeError, OSError, httpx.HTTPError) as e:
        print(f"pdserve bench sweep: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("pdserve bench sweep: interrupted; every server stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    print("\n".join(f"wrote {path}" for path in paths))
    if cfg.replot:
        return 0
    print(f"sweep took {result['wall_s']:.0f}s")
    return 0 if all(row["failed"] == 0 for row in result["table"]) else 1


if __name__ == "__main__":
    sys.exit(main())
