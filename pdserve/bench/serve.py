"""`pdserve bench serve`: an online serving benchmark (like SGLang's bench_serving / vLLM's bench serve).

Sends prompts at a request rate and/or a concurrency cap, streams every reply to time TTFT,
ITL, TPOT and end-to-end latency, and reports throughput, goodput and failures.
Use it as a library with `await run(BenchConfig(...))` or from the CLI via `run_bench(args)`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field

import aiohttp
from tqdm import tqdm

from ..core.config import add_dataclass_args, dataclass_from_args
from .arrivals import ArrivalKind, arrival_offsets
from .backends import BACKENDS, BackendOptions, endpoint_url, send_request
from .datasets import BenchRequest, TokenCounter, file_requests, random_requests
from .metrics import RequestRecord, Summary, format_summary, parse_slo, summarize


class BenchError(RuntimeError):
    """The benchmark could not run (bad config, server unreachable, warmup failed)."""


def _opt(help: str, choices: tuple | None = None, **kw):
    return field(metadata={"help": help, "choices": choices}, **kw)


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark run; the CLI flags are generated from these fields."""

    url: str = _opt("server base URL", default="http://127.0.0.1:30000")
    backend: str = _opt("server API", tuple(BACKENDS), default="pdserve")
    model: str = _opt("model name for OpenAI APIs (default: first of /v1/models)", default="")
    dataset: str = _opt("prompt source", ("random", "file"), default="random")
    dataset_path: str = _opt("JSON/JSONL file for --dataset file", default="")
    num_prompts: int = _opt("number of requests", default=1000)
    random_input_len: int = _opt("max prompt tokens of random prompts", default=1024)
    random_output_len: int = _opt("max output tokens of random prompts", default=128)
    random_range_ratio: float = _opt(
        "lengths are uniform in [len * ratio, len]; 1.0 = fixed lengths", default=1.0)
    file_output_len: int = _opt("override output tokens of file prompts (0 = from data)", default=0)
    tokenizer: str = _opt("local tokenizer.json or its dir for token counts (default: words)",
                          default="")
    seed: int = _opt("seed for prompts and arrivals", default=1)
    request_rate: float = _opt("requests per second (inf = all at once)", default=math.inf)
    arrival: str = _opt("arrival process at --request-rate", tuple(k.value for k in ArrivalKind),
                        default="poisson")
    max_concurrency: int = _opt("max requests in flight (0 = no cap)", default=0)
    temperature: float = _opt("sampling temperature", default=0.0)
    disable_ignore_eos: bool = _opt("let the model stop at EOS (output lengths vary)", default=False)
    slo: str = _opt("goodput SLOs, e.g. ttft_ms=500,tpot_ms=50 (keys: ttft_ms tpot_ms itl_ms e2e_ms)",
                    default="")
    warmup_requests: int = _opt("requests sent (and checked) before timing starts", default=1)
    request_timeout: float = _opt("seconds one request may take before it counts as failed",
                                  default=600.0)
    api_key: str = _opt("Bearer token", default="")
    extra_body: str = _opt("JSON object merged into every request body", default="")
    output: str = _opt("write config, summary and per-request records to this JSON file",
                       default="")
    disable_tqdm: bool = _opt("no progress bar", default=False)

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown backend {self.backend!r}; choose from {', '.join(BACKENDS)}")
        if self.dataset == "file" and not self.dataset_path:
            raise ValueError("--dataset file needs --dataset-path")
        if self.num_prompts < 1 or self.max_concurrency < 0 or self.warmup_requests < 0:
            raise ValueError("num_prompts must be >= 1, max_concurrency and warmup_requests >= 0")
        if not self.request_rate > 0 or not self.request_timeout > 0:
            raise ValueError("request_rate and request_timeout must be > 0")
        ArrivalKind(self.arrival)
        parse_slo(self.slo)
        self.extra_body_dict()

    def slo_targets(self) -> dict[str, float]:
        return parse_slo(self.slo)

    def extra_body_dict(self) -> dict:
        if not self.extra_body:
            return {}
        body = json.loads(self.extra_body)
        if not isinstance(body, dict):
            raise ValueError("--extra-body must be a JSON object")
        return body


@dataclass
class BenchResult:
    config: BenchConfig
    summary: Summary
    records: list[RequestRecord]
    model: str = ""  # the model name sent (found through /v1/models when not configured)

    def to_json(self) -> dict:
        config = asdict(self.config)
        if config["api_key"]:
            config["api_key"] = "<redacted>"
        return _finite({"config": config, "model": self.model, "summary": asdict(self.summary),
                        "requests": [r.to_json() for r in self.records]})

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_json(), f, indent=1, allow_nan=False)


def _finite(obj):
    """Make floats strict JSON: NaN (no data) becomes None, infinities the strings "inf"/"-inf"."""
    if isinstance(obj, float):
        if math.isnan(obj):
            return None
        return obj if math.isfinite(obj) else ("inf" if obj > 0 else "-inf")
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def load_requests(cfg: BenchConfig, counter: TokenCounter) -> list[BenchRequest]:
    if cfg.dataset == "file":
        return file_requests(cfg.dataset_path, cfg.num_prompts, cfg.seed, counter,
                             cfg.file_output_len)
    return random_requests(cfg.num_prompts, cfg.random_input_len, cfg.random_output_len,
                           cfg.random_range_ratio, cfg.seed, counter)


async def _model_name(session: aiohttp.ClientSession, cfg: BenchConfig, headers: dict) -> str:
    url = cfg.url.rstrip("/") + "/v1/models"
    try:
        async with session.get(url, headers=headers,
                               timeout=aiohttp.ClientTimeout(total=min(30.0, cfg.request_timeout))) as r:
            r.raise_for_status()
            return (await r.json())["data"][0]["id"]
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, ValueError) as e:
        raise BenchError(f"no --model given and {url} gave no model id: {e!r}") from None


class _Runner:
    """Sends the requests on their arrival schedule under the concurrency cap."""

    def __init__(self, cfg: BenchConfig, session: aiohttp.ClientSession, opts: BackendOptions,
                 headers: dict, counter: TokenCounter):
        self.cfg, self.session, self.opts, self.headers, self.counter = cfg, session, opts, headers, counter
        self.backend = BACKENDS[cfg.backend]()
        self.url = endpoint_url(cfg.url, self.backend)
        self.inflight = 0
        self.max_inflight = 0

    async def send(self, index: int, req: BenchRequest) -> RequestRecord:
        rec = RequestRecord(index=index, prompt_len=req.prompt_len, output_len_requested=req.output_len)
        return await send_request(self.session, self.url, self.backend, req, self.opts, rec,
                                  self.cfg.request_timeout, self.headers, self.counter)

    async def warmup(self, req: BenchRequest) -> None:
        for i in range(self.cfg.warmup_requests):
            rec = await self.send(-1 - i, req)
            if not rec.success:
                raise BenchError(f"warmup request to {self.url} failed: {rec.error}")

    async def run_all(self, requests: list[BenchRequest]) -> tuple[list[RequestRecord], float]:
        cfg = self.cfg
        offsets = arrival_offsets(len(requests), cfg.request_rate, ArrivalKind(cfg.arrival), cfg.seed)
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        bar = tqdm(total=len(requests), disable=cfg.disable_tqdm, desc="bench")
        t0 = time.perf_counter()

        async def one(i: int, req: BenchRequest) -> RequestRecord:
            if sem is not None:
                await sem.acquire()
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)
            try:
                send_time = time.perf_counter() - t0
                rec = await self.send(i, req)
                rec.scheduled_time, rec.send_time = offsets[i], send_time
                return rec
            finally:
                self.inflight -= 1
                if sem is not None:
                    sem.release()
                bar.update(1)

        tasks = []
        try:
            for i, req in enumerate(requests):
                delay = t0 + offsets[i] - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(i, req)))
            records = list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()
            bar.close()
        return records, time.perf_counter() - t0


async def run(cfg: BenchConfig) -> BenchResult:
    """Run one benchmark against a live server and return its result (also saved if cfg.output)."""
    counter = TokenCounter(cfg.tokenizer or None)
    requests = load_requests(cfg, counter)
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=cfg.request_timeout)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        model = cfg.model
        if not model and cfg.backend != "pdserve":
            model = await _model_name(session, cfg, headers)
        opts = BackendOptions(model=model, temperature=cfg.temperature,
                              ignore_eos=not cfg.disable_ignore_eos, extra_body=cfg.extra_body_dict())
        runner = _Runner(cfg, session, opts, headers, counter)
        await runner.warmup(requests[0])
        records, duration = await runner.run_all(requests)
    summary = summarize(records, duration, cfg.slo_targets(), runner.max_inflight)
    result = BenchResult(cfg, summary, records, model)
    if cfg.output:
        result.save(cfg.output)
    return result


def add_bench_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_dataclass_args(parser, BenchConfig)
    return parser


def build_bench_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pdserve bench serve", description=__doc__.splitlines()[0])
    return add_bench_args(parser)


def run_bench(args: argparse.Namespace) -> int:
    """CLI entry: 0 when every request succeeded, 1 when some failed, 2 on a bad config or setup."""
    try:
        cfg = dataclass_from_args(BenchConfig, args)
        result = asyncio.run(run(cfg))
    except (ValueError, OSError, BenchError) as e:
        print(f"pdserve bench serve: error: {e}", file=sys.stderr)
        return 2
    print(format_summary(result.summary))
    if cfg.output:
        print(f"results written to {cfg.output}")
    return 0 if result.summary.failed == 0 else 1


def main(argv: list[str] | None = None) -> int:
    return run_bench(build_bench_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
