"""What a worker does differently per server role, behind one small interface, and what the
roles share.

The worker loop (loop.py) is the same for every role; it hands requests, aborts and engine
step outputs to its `WorkerRole` and sends back whatever TokenOutputs the role returns. Every
role builds engine requests and outputs with the helpers here; the prefill and decode roles
also start their transfer backend here (with the facts a KvReq is checked against), require the
PD fields and log each finished handoff.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ..core.config import ServerConfig
from ..core.envs import Envs
from ..core.errors import BadRequest
from ..core.log_format import fields
from ..core.messages import ErrorInfo, GenerateReq, TokenOutput
from ..core.netaddr import AddressError, check_reachable
from ..core.pd_settings import PDSettings
from ..core.sampling import SamplingParams
from ..disagg.local_facts import LocalFacts
from ..engine.step_io import EngineRequest, StepOutput
from ..transfer.base import Endpoint, TransferBackend
from ..transfer.registry import backend_class

if TYPE_CHECKING:  # the engine loads torch; roles (and tests' fake engines) only call it
    from ..engine.engine import Engine

log = logging.getLogger("pdserve.handoff")


@dataclass
class RoleContext:
    """What every role is built from."""

    engine: Engine
    dp_rank: int
    cfg: ServerConfig
    envs: Envs
    model_cfg: Any  # model_files.hf_config.ModelConfig
    wake: Callable[[], None]  # thread-safe: make the worker loop turn now
    pd: PDSettings = field(init=False)  # the PD switches and deadlines, from cfg and envs once

    def __post_init__(self) -> None:
        self.pd = PDSettings.of(self.cfg, self.envs)


class WorkerRole(ABC):
    """Contract: every GenerateReq accepted by on_generate eventually yields exactly one
    finished TokenOutput (success, error or abort), and every KV page the role takes is
    returned to the engine by then. Methods run on the worker loop's thread only."""

    def __init__(self, ctx: RoleContext):
        self.ctx = ctx
        self.engine = ctx.engine
        self.dp_rank = ctx.dp_rank

    def start(self) -> dict:
        """Called once before serving; returns extra WorkerReady info."""
        return {}

    @abstractmethod
    def on_generate(self, req: GenerateReq) -> list[TokenOutput]:
        ...

    @abstractmethod
    def on_abort(self, rid: str, reason: str) -> list[TokenOutput]:
        ...

    def on_room_failed(self, room: int, reason: str) -> None:
        """The front rejected `room` (prefill only): answer decodes that ask for it at once."""

    def on_room_dropped(self, room: int, reason: str) -> None:
        """The room's decode prefilled it itself (prefill only): end it without a transfer."""

    def on_room_routed(self, room: int, rank: int, endpoint: Endpoint) -> None:
        """The front sent `room`, homed on this rank, to `rank` (prefill only): forward its KV
        request there."""

    def on_step(self, outs: list[StepOutput]) -> list[TokenOutput]:
        return [to_token_output(o) for o in outs]

    def poll(self) -> list[TokenOutput]:
        """Progress background work (transfers); called every loop turn."""
        return []

    def busy(self) -> bool:
        """True while background work needs the loop to keep turning without blocking."""
        return False

    def inflight_transfers(self) -> int:
        return 0

    def stats_extra(self) -> dict:
        return {}

    def close(self) -> None:
        pass


def to_token_output(o: StepOutput, meta: dict | None = None,
                    timeline: dict[str, float] | None = None) -> TokenOutput:
    return TokenOutput(
        rid=o.rid,
        token_ids=[] if o.token_id is None else [o.token_id],
        token_logprobs=None if o.logprob is None else [o.logprob],
        top_logprobs=None if o.top_logprobs is None else [o.top_logprobs],
        finished=o.finished,
        finish_reason=o.finish_reason,
        prompt_tokens=o.prompt_tokens,
        cached_tokens=o.cached_tokens,
        input_logprobs=o.input_logprobs,
        input_top_logprobs=o.input_top_logprobs,
        meta=meta or {},
        timeline=timeline or {},
    )


def engine_request(req: GenerateReq, sampling: SamplingParams | None = None,
                   hold_kv: bool = False) -> EngineRequest:
    """The engine's view of a front request (its own sampling params, or `sampling`)."""
    return EngineRequest(req.rid, req.input_ids, sampling or req.sampling, req.return_logprob, hold_kv,
                         req.top_logprobs, req.prompt_logprobs)


def error_output(rid: str, status: int, message: str, type_: str = "invalid_request_error",
                 meta: dict | None = None, timeline: dict[str, float] | None = None) -> TokenOutput:
    return TokenOutput(rid=rid, finished=True,
                       finish_reason={"type": "abort", "message": message},
                       error=ErrorInfo(status, message, type_), meta=meta or {}, timeline=timeline or {})


# ---- what the prefill and decode roles share: the transfer backend, the PD fields, a log line

def start_backend(ctx: RoleContext) -> tuple[TransferBackend, LocalFacts]:
    """Start this worker's backend over its KV pool; -> (backend, local facts for kv_req checks)."""
    cls = backend_class(ctx.cfg.transfer_backend)
    backend = cls(**cls.env_options(ctx.envs))
    layout = ctx.engine.pool.layout()
    port = ctx.cfg.transfer_port + ctx.dp_rank if ctx.cfg.transfer_port else 0
    endpoint = backend.start(layout, host=ctx.cfg.host, port=port, advertise=ctx.cfg.advertise_host)
    try:  # a decode or prefill elsewhere will connect to what we advertise: prove it answers
        if backend.networked:
            check_reachable(endpoint["ip"], endpoint["port"],
                            f"the {ctx.cfg.transfer_backend} transfer endpoint of dp_rank {ctx.dp_rank}")
    except AddressError:
        backend.close()
        raise
    return backend, LocalFacts.of(ctx.cfg.transfer_backend, layout, ctx.model_cfg.fingerprint(), endpoint)


def require_pd(req: GenerateReq, role: str) -> None:
    if req.pd is None:
        raise BadRequest(f"request {req.rid}: a {role} server needs bootstrap_host, bootstrap_port "
                         "and bootstrap_room")
    # max_new_tokens 0 is served too: the prefill still samples a first token, which the decode
    # drops (Engine.add_prefilled), e.g. for an echo of the prompt's logprobs


def log_handoff(done) -> None:
    """One line per finished handoff (disagg.handoff.HandoffDone): room, ranks, timings, cause."""
    extra = fields(room=done.room, rid=done.rid, **{k: v for k, v in done.meta.items() if k != "bootstrap_room"})
    if done.dropped:  # the decode prefilled the room itself: an outcome, not a failure
        log.info("handoff dropped", extra={**extra, "reason": done.reason})
    elif done.ok:
        log.info("handoff ok", extra=extra)
    else:
        log.warning("handoff failed", extra={**extra, "reason": done.reason})
