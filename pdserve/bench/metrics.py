"""Per-request measurements and the run summary: percentiles, throughput, goodput under SLOs.

All times are seconds from time.perf_counter(); the summary reports milliseconds.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

SLO_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2e")


@dataclass
class RequestRecord:
    """What one request did. `itl` holds the gaps between consecutive content chunks."""

    index: int
    prompt_len: int
    output_len_requested: int
    scheduled_time: float = 0.0  # seconds after the run started, from the arrival schedule
    send_time: float = 0.0  # seconds after the run started, when it actually went out
    success: bool = False
    error: str = ""
    output_len: int = 0
    server_prompt_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens the server reported as prefix-cache hits
    conversation: int | None = None  # multi-turn: which conversation, and which turn of it
    turn: int | None = None
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    chunks: int = 0

    @property
    def tpot(self) -> float | None:
        """(e2e - ttft) / (output_len - 1); None with fewer than two output tokens."""
        if not self.success or self.output_len < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["tpot"] = self.tpot
        return d


@dataclass(frozen=True)
class Stats:
    """Distribution of one latency metric, in milliseconds."""

    count: int
    mean: float
    median: float
    p90: float
    p99: float
    std: float
    min: float
    max: float


@dataclass
class Summary:
    num_requests: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    input_throughput: float
    output_throughput: float
    total_token_throughput: float
    max_concurrency_seen: int
    output_len_mismatches: int
    goodput: float | None
    slo: dict[str, float]
    latency_ms: dict[str, Stats]
    errors: list[str]  # the first distinct error messages, each with its count
    # Prompt tokens of completed requests: the server's count where it reported one, else ours.
    total_prompt_tokens: int = 0
    cached_requests: int = 0  # completed requests whose reply reported cached prompt tokens
    total_cached_tokens: int | None = None  # None: no reply reported them (unknown, not 0)
    mean_cached_tokens: float | None = None
    cache_hit_rate: float | None = None  # cached / prompt tokens, over the reporting requests
    not_sent: int = 0  # multi-turn: turns skipped because an earlier turn of theirs failed


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        return math.nan
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats_ms(values_s: list[float]) -> Stats:
    """Stats of `values_s` (seconds) reported in milliseconds; NaN everywhere when empty."""
    ms = [v * 1000.0 for v in values_s]
    if not ms:
        nan = math.nan
        return Stats(0, nan, nan, nan, nan, nan, nan, nan)
    mean = sum(ms) / len(ms)
    std = math.sqrt(sum((v - mean) ** 2 for v in ms) / len(ms))
    return Stats(len(ms), mean, percentile(ms, 50), percentile(ms, 90), percentile(ms, 99),
                 std, min(ms), max(ms))


def parse_slo(text: str) -> dict[str, float]:
    """Parse 'ttft_ms=500,tpot_ms=50' into {'ttft_ms': 500.0, 'tpot_ms': 50.0}."""
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad SLO {part!r}: expected KEY=MS with KEY in {', '.join(SLO_KEYS)}")
        try:
            slo[key] = float(value)
        except ValueError:
            raise ValueError(f"bad SLO {part!r}: {value!r} is not a number") from None
        if slo[key] <= 0:
            raise ValueError(f"bad SLO {part!r}: must be > 0")
    return slo


def meets_slo(rec: RequestRecord, slo: dict[str, float]) -> bool:
    if not rec.success:
        return False
    checks = {
        "ttft_ms": [rec.ttft],
        "tpot_ms": [rec.tpot] if rec.tpot is not None else [],
        "itl_ms": rec.itl,
        "e2e_ms": [rec.e2e],
    }
    return all(v * 1000.0 <= limit for key, limit in slo.items() for v in checks[key])


def _prompt_tokens(rec: RequestRecord) -> int:
    return rec.server_prompt_tokens if rec.server_prompt_tokens is not None else rec.prompt_len


def _cache_fields(ok: list[RequestRecord]) -> dict:
    """Summary fields of the server-reported prefix-cache hits (None where nothing reported)."""
    hits = [r for r in ok if r.cached_tokens is not None]
    cached = sum(r.cached_tokens for r in hits)  # type: ignore[misc]
    prompt = sum(_prompt_tokens(r) for r in hits)
    return {"total_prompt_tokens": sum(_prompt_tokens(r) for r in ok), "cached_requests": len(hits),
            "total_cached_tokens": cached if hits else None,
            "mean_cached_tokens": cached / len(hits) if hits else None,
            "cache_hit_rate": cached / prompt if hits and prompt else None}


def summarize(records: list[RequestRecord], duration_s: float, slo: dict[str, float],
              max_concurrency_seen: int = 0, max_errors: int = 5, not_sent: int = 0) -> Summary:
    """Aggregate every record, failed ones included (they count in `failed` and `errors`);
    `not_sent` counts planned requests that never went out (multi-turn)."""
    ok = [r for r in records if r.success]
    in_tok = sum(r.prompt_len for r in ok)
    out_tok = sum(r.output_len for r in ok)
    dur = duration_s if duration_s > 0 else math.nan
    series = {
        "ttft": [r.ttft for r in ok],
        "tpot": [t for t in (r.tpot for r in ok) if t is not None],
        "itl": [g for r in ok for g in r.itl],
        "e2e": [r.e2e for r in ok],
    }
    counts = Counter(r.error for r in records if not r.success)
    errors = [f"{msg} (x{n})" for msg, n in list(counts.items())[:max_errors]]
    good = sum(meets_slo(r, slo) for r in ok) / dur if slo else None
    return Summary(
        num_requests=len(records), completed=len(ok), failed=len(records) - len(ok),
        duration_s=duration_s, total_input_tokens=in_tok, total_output_tokens=out_tok,
        request_throughput=len(ok) / dur, input_throughput=in_tok / dur,
        output_throughput=out_tok / dur, total_token_throughput=(in_tok + out_tok) / dur,
        max_concurrency_seen=max_concurrency_seen,
        output_len_mismatches=sum(r.output_len != r.output_len_requested for r in ok),
        goodput=good, slo=dict(slo),
        latency_ms={name: stats_ms(vals) for name, vals in series.items()},
        errors=errors, not_sent=not_sent, **_cache_fields(ok),
    )


def format_summary(s: Summary, title: str = "Serving Benchmark Result") -> str:
    """A plain-text table like SGLang's / vLLM's bench output."""
    w = 50
    lines = [f"{' ' + title + ' ':=^{w}}"]

    def row(label: str, value) -> None:
        if isinstance(value, float):
            value = f"{value:.2f}"
        lines.append(f"{label:<36}{value:>{w - 36}}")

    row("Successful requests:", s.completed)
    row("Failed requests:", s.failed)
    if s.not_sent:
        row("Turns not sent (conversation ended):", s.not_sent)
    row("Benchmark duration (s):", s.duration_s)
    row("Total input tokens:", s.total_input_tokens)
    row("Total generated tokens:", s.total_output_tokens)
    row("Total prompt tokens (server count):", s.total_prompt_tokens)
    na = "n/a"
    row("Total cached prompt tokens:", na if s.total_cached_tokens is None else s.total_cached_tokens)
    row("Mean cached prompt tokens:", na if s.mean_cached_tokens is None else s.mean_cached_tokens)
    row("Prefix cache hit rate:", na if s.cache_hit_rate is None else f"{100 * s.cache_hit_rate:.1f}%")
    if 0 < s.cached_requests < s.completed:
        row("Requests reporting cached tokens:", f"{s.cached_requests}/{s.completed}")
    row("Request throughput (req/s):", s.request_throughput)
    if s.goodput is not None:
        row("Request goodput (req/s):", s.goodput)
    row("Input token throughput (tok/s):", s.input_throughput)
    row("Output token throughput (tok/s):", s.output_throughput)
    row("Total token throughput (tok/s):", s.total_token_throughput)
    row("Max concurrency seen:", s.max_concurrency_seen)
    if s.output_len_mismatches:
        row("Outputs not of the asked length:", s.output_len_mismatches)
    names = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st)",
             "itl": "Inter-token Latency", "e2e": "End-to-end Latency"}
    for key in LATENCY_METRICS:
        st = s.latency_ms[key]
        lines.append(f"{' ' + names[key] + ' ':-^{w}}")
        for stat in ("mean", "median", "p90", "p99"):
            row(f"{stat.capitalize()} {key.upper()} (ms):", getattr(st, stat))
    if s.errors:
        lines.append(f"{' First errors ':-^{w}}")
        lines.extend(s.errors)
    lines.append("=" * w)
    return "\n".join(lines)
