"""What the prefill and decode roles share: their transfer backend and compatibility facts."""

from __future__ import annotations

import logging

from ..core.errors import BadRequest
from ..core.log_format import fields
from ..core.messages import GenerateReq
from ..transfer.base import TransferBackend, layout_to_dict
from ..transfer.registry import backend_class
from .role import RoleContext

log = logging.getLogger("pdserve.handoff")


def start_backend(ctx: RoleContext) -> tuple[TransferBackend, dict]:
    """Start this worker's backend over its KV pool; -> (backend, local facts for kv_req checks)."""
    cls = backend_class(ctx.cfg.transfer_backend)
    backend = cls(**cls.env_options(ctx.envs))
    layout = ctx.engine.pool.layout()
    endpoint = backend.start(layout, host=ctx.cfg.host)
    local = {
        "backend": ctx.cfg.transfer_backend,
        "page_size": layout.page_size,
        "kv_dtype": layout.dtype,
        "fingerprint": ctx.model_cfg.fingerprint(),
        "layout": layout_to_dict(layout),
        "endpoint": endpoint,
    }
    return backend, local


def require_pd(req: GenerateReq, role: str) -> None:
    if req.pd is None:
        raise BadRequest(f"request {req.rid}: a {role} server needs bootstrap_host, bootstrap_port "
                         "and bootstrap_room")
    if req.sampling.max_new_tokens < 1:
        raise BadRequest(f"request {req.rid}: max_new_tokens must be >= 1 for a disaggregated request")


def log_handoff(done) -> None:
    """One line per finished handoff (disagg.handoff.HandoffDone): room, ranks, timings, cause."""
    extra = fields(room=done.room, rid=done.rid, **{k: v for k, v in done.meta.items() if k != "bootstrap_room"})
    if done.ok:
        log.info("handoff ok", extra=extra)
    else:
        log.warning("handoff failed", extra={**extra, "reason": done.reason})
