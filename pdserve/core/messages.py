"""Typed messages between an HTTP front and its DP worker processes.

Fronts and workers exchange these dataclasses over ZMQ (pickled; see worker/pump.py).
Front -> worker: GenerateReq, AbortReq, StatsReq, ShutdownReq, RoomFailedNotice, RoomRoutedNotice,
RoomDroppedNotice.
Worker -> front: WorkerReady once, then OutputBatch per engine step and WorkerStats on demand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .logprobs import PromptLogprobs, TopLogprobs
from .pd_vocab import DEFAULT_BOOTSTRAP_PORT
from .sampling import SamplingParams


@dataclass(frozen=True)
class PDParams:
    """The PD fields of one request item (one room), the one type every layer uses: as the
    client sent them (host and room may be missing: a colocated server ignores them) and, once
    a PD front checked them, as its worker gets them. `prefill_dp_rank` is
    `disagg_prefill_dp_rank`."""

    bootstrap_host: str | None = None
    bootstrap_port: int = DEFAULT_BOOTSTRAP_PORT
    bootstrap_room: int | None = None
    prefill_dp_rank: int | None = None


@dataclass
class GenerateReq:
    rid: str
    input_ids: list[int]
    sampling: SamplingParams
    return_logprob: bool = False
    pd: PDParams | None = None
    arrival_time: float = 0.0
    dispatch_reason: str = ""  # why the front picked this rank (for timelines and logs)
    top_logprobs: int = 0  # alternatives with every returned logprob (return_logprob)
    prompt_logprobs: PromptLogprobs = PromptLogprobs.WITH_RETURN_LOGPROB
    health_check: bool = False  # the front's /health_generate: the worker runs it alone, never as PD


@dataclass(frozen=True)
class AbortReq:
    rid: str
    reason: str = "aborted by client"


@dataclass(frozen=True)
class RoomFailedNotice:
    """Prefill front -> the worker a room implies: the room was rejected (e.g. a
    follow_bootstrap_room conflict), so a decode contacting this worker for it fails at once."""

    room: int
    reason: str


@dataclass(frozen=True)
class RoomDroppedNotice:
    """Prefill front -> every worker: the room's decode prefilled it itself; the worker holding
    the room (now or when its request arrives) ends it with a success and no KV transfer."""

    room: int
    reason: str


@dataclass(frozen=True)
class RoomRoutedNotice:
    """Prefill front -> the room's home rank (room % dp_size) when the room went to another
    rank: a decode's KV request reaching the home is forwarded to `rank` at `endpoint`."""

    room: int
    rank: int
    endpoint: dict[str, Any]


@dataclass(frozen=True)
class StatsReq:
    req_id: int
    flush_cache: bool = False  # empty the prefix cache first (POST /flush_cache)


@dataclass(frozen=True)
class ShutdownReq:
    pass


@dataclass(frozen=True)
class ErrorInfo:
    """A request failure: HTTP status, message naming room/ranks/cause, error type."""

    status: int
    message: str
    type: str = "internal_error"


@dataclass
class TokenOutput:
    """New tokens of one request since its last output; `finished` closes the request."""

    rid: str
    token_ids: list[int] = field(default_factory=list)
    token_logprobs: list[float] | None = None
    top_logprobs: list[TopLogprobs] | None = None  # one list of alternatives per token, when asked
    finished: bool = False
    finish_reason: dict[str, Any] | None = None  # {"type": "stop"|"length"|"abort", "matched": ...}
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV was reused (prefix cache), with every output
    input_logprobs: list[float | None] | None = None  # first output only, when asked
    input_top_logprobs: list[TopLogprobs | None] | None = None  # with input_logprobs, when asked
    error: ErrorInfo | None = None
    meta: dict[str, Any] = field(default_factory=dict)  # extra meta_info, e.g. handoff timings
    timeline: dict[str, float] = field(default_factory=dict)  # worker stages: core.timeline name -> time.time()


@dataclass
class OutputBatch:
    dp_rank: int
    outputs: list[TokenOutput]


@dataclass
class WorkerStats:
    req_id: int
    dp_rank: int
    total_pages: int
    free_pages: int
    cached_pages: int
    running_requests: int
    waiting_requests: int
    inflight_transfers: int
    extra: dict[str, Any] = field(default_factory=dict)

    def is_idle(self) -> bool:
        return (
            self.free_pages + self.cached_pages == self.total_pages
            and self.running_requests == 0
            and self.waiting_requests == 0
            and self.inflight_transfers == 0
        )


@dataclass(frozen=True)
class WorkerReady:
    dp_rank: int
    total_pages: int
    page_size: int
    max_context: int
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerFailed:
    """Sent instead of WorkerReady when start-up fails (bad model path, out of memory...)."""

    dp_rank: int
    message: str
