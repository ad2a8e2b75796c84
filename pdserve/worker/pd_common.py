"""What the prefill and decode roles share: their transfer backend and compatibility facts."""

from __future__ import annotations

import logging

from ..core.errors import BadRequest
from ..core.log_format import fields
from ..core.messages import GenerateReq
from ..core.netaddr import AddressError, check_reachable
from ..disagg.local_facts import LocalFacts
from ..transfer.base import TransferBackend
from ..transfer.registry import backend_class
from .role import RoleContext

log = logging.getLogger("pdserve.handoff")


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
