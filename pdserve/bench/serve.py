"""`pdserve bench serve`: an online serving benchmark (like SGLang's bench_serving / vLLM's bench serve).

Sends prompts at a request rate and/or a concurrency cap, streams every reply to time TTFT,
ITL, TPOT and end-to-end latency, and reports throughput, goodput, failures and the prefix-cache
hits the server reports (the shared-prefix and multi-turn datasets exercise the cache).
Use it as a library with `await run(BenchConfig(...))` or from the CLI via `run_bench(args)`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from dataclasses import asdict, dataclass

import aiohttp
from tqdm import tqdm

from ..core.config import add_dataclass_args, dataclass_from_args
from .arrivals import ArrivalKind, arrival_offsets, gather_on_schedule
from .backends import BACKENDS, BackendOptions, endpoint_url, send_and_read
from .conversations import Conversation, make_conversations, run_conversations, turn_request
from .datasets import BenchRequest, TokenCounter, file_requests, random_requests, shared_prefix_requests
from .metrics import RequestRecord, Summary, format_summary, summarize
from .serve_config import CACHE_DATASETS, BenchConfig


class BenchError(RuntimeError):
    """The benchmark could not run (bad config, server unreachable, warmup failed)."""


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
    """The prompts of a single-request dataset (every one but multi-turn)."""
    if cfg.dataset == "file":
        return file_requests(cfg.dataset_path, cfg.num_prompts, cfg.seed, counter,
                             cfg.file_output_len)
    if cfg.dataset == "shared-prefix":
        return shared_prefix_requests(cfg.prefix_num_prefixes, cfg.prefix_suffixes_per_prefix,
                                      cfg.prefix_len, cfg.suffix_len, cfg.random_output_len,
                                      cfg.seed, counter)
    return random_requests(cfg.num_prompts, cfg.random_input_len, cfg.random_output_len,
                           cfg.random_range_ratio, cfg.seed, counter)


def load_conversations(cfg: BenchConfig, counter: TokenCounter) -> list[Conversation]:
    return make_conversations(cfg.multi_turn_conversations, cfg.multi_turn_turns,
                              cfg.multi_turn_first_len, cfg.multi_turn_question_len,
                              cfg.random_output_len, cfg.seed, counter, cfg.multi_turn_system_len)


def warmup_request(cfg: BenchConfig, first: BenchRequest, counter: TokenCounter) -> BenchRequest:
    """The first request; for the prefix-cache datasets a random prompt of its length instead,
    so warming up does not put a prefix that the run reuses in the cache."""
    if cfg.dataset not in CACHE_DATASETS:
        return first
    return random_requests(1, first.prompt_len, first.output_len, 1.0, cfg.seed + 1, counter)[0]


async def _model_name(session: aiohttp.ClientSession, cfg: BenchConfig, headers: dict) -> str:
    url = cfg.url.rstrip("/") + "/v1/models"
    try:
        async with session.get(url, headers=headers,
                               timeout=aiohttp.ClientTimeout(total=min(30.0, cfg.request_timeout))) as r:
            r.raise_for_status()
            return (await r.json())["data"][0]["id"]
    except (aiohttp.ClientError, asyncio.TimeoutError, KeyError, IndexError, ValueError) as e:
        raise BenchError(f"no --model given and {url} gave no model id: {e!r}") from None


@dataclass
class RunOutcome:
    records: list[RequestRecord]
    duration_s: float
    not_sent: int = 0  # multi-turn turns never sent (an earlier turn failed)


class _Runner:
    """Sends the requests on their arrival schedule under the concurrency cap."""

    def __init__(self, cfg: BenchConfig, session: aiohttp.ClientSession, opts: BackendOptions,
                 headers: dict, counter: TokenCounter):
        self.cfg, self.session, self.opts, self.headers, self.counter = cfg, session, opts, headers, counter
        self.backend = BACKENDS[cfg.backend]()
        self.url = endpoint_url(cfg.url, self.backend)
        self.inflight = 0
        self.max_inflight = 0

    async def send(self, index: int, req: BenchRequest) -> tuple[RequestRecord, str]:
        rec = RequestRecord(index=index, prompt_len=req.prompt_len, output_len_requested=req.output_len)
        return await send_and_read(self.session, self.url, self.backend, req, self.opts, rec,
                                   self.cfg.request_timeout, self.headers, self.counter)

    async def timed(self, t0: float, index: int, req: BenchRequest,
                    scheduled: float) -> tuple[RequestRecord, str]:
        """One request of the timed run, counted in flight; `scheduled` is its planned start."""
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            send_time = time.perf_counter() - t0
            rec, text = await self.send(index, req)
            rec.scheduled_time, rec.send_time = scheduled, send_time
            return rec, text
        finally:
            self.inflight -= 1

    async def warmup(self, req: BenchRequest) -> None:
        for i in range(self.cfg.warmup_requests):
            rec, _ = await self.send(-1 - i, req)
            if not rec.success:
                raise BenchError(f"warmup request to {self.url} failed: {rec.error}")

    def _offsets(self, n: int) -> list[float]:
        return arrival_offsets(n, self.cfg.request_rate, ArrivalKind(self.cfg.arrival), self.cfg.seed)

    async def run_all(self, requests: list[BenchRequest]) -> RunOutcome:
        cfg = self.cfg
        offsets = self._offsets(len(requests))
        sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
        bar = tqdm(total=len(requests), disable=cfg.disable_tqdm, desc="bench")
        t0 = time.perf_counter()

        async def one(i: int) -> RequestRecord:
            try:
                async with sem if sem is not None else contextlib.nullcontext():
                    return (await self.timed(t0, i, requests[i], offsets[i]))[0]
            finally:
                bar.update(1)

        try:
            records = await gather_on_schedule(offsets, t0, one)
        finally:
            bar.close()
        return RunOutcome(records, time.perf_counter() - t0)

    async def run_chats(self, convs: list[Conversation]) -> RunOutcome:
        """Multi-turn: the arrival schedule starts conversations; each turn waits for the last."""
        bar = tqdm(total=sum(len(c.questions) for c in convs), disable=self.cfg.disable_tqdm,
                   desc="bench")
        t0 = time.perf_counter()
        try:
            done = await run_conversations(
                convs, self._offsets(len(convs)), t0, lambda i, req, at: self.timed(t0, i, req, at),
                self.counter, self.cfg.max_concurrency, bar.update)
        finally:
            bar.close()
        return RunOutcome(done.records, time.perf_counter() - t0, done.not_sent)


async def _flush_cache(session: aiohttp.ClientSession, cfg: BenchConfig, headers: dict) -> None:
    """Empty the server's prefix cache: SGLang's and our route, then vLLM's."""
    problems = []
    for path in ("/flush_cache", "/reset_prefix_cache"):
        try:
            async with session.post(cfg.url.rstrip("/") + path, headers=headers,
                                    timeout=aiohttp.ClientTimeout(total=60)) as r:
                if r.status < 400:
                    return
                problems.append(f"{path}: {r.status}")
        except aiohttp.ClientError as e:
            problems.append(f"{path}: {e}")
    raise BenchError(f"could not flush the prefix cache of {cfg.url}: {'; '.join(problems)}")


async def run(cfg: BenchConfig) -> BenchResult:
    """Run one benchmark against a live server and return its result (also saved if cfg.output)."""
    counter = TokenCounter(cfg.tokenizer or None)
    convs = load_conversations(cfg, counter) if cfg.dataset == "multi-turn" else []
    requests = [] if convs else load_requests(cfg, counter)
    first = turn_request(convs[0], [], counter) if convs else requests[0]
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
        await runner.warmup(warmup_request(cfg, first, counter))
        if cfg.flush_cache:
            await _flush_cache(session, cfg, headers)
        outcome = await (runner.run_chats(convs) if convs else runner.run_all(requests))
    summary = summarize(outcome.records, outcome.duration_s, cfg.slo_targets(), runner.max_inflight,
                        not_sent=outcome.not_sent)
    result = BenchResult(cfg, summary, outcome.records, model)
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
