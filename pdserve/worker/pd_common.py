"""What the prefill and decode roles share: their transfer backend and compatibility facts."""

from __future__ import annotations

from ..core.errors import BadRequest
from ..core.messages import GenerateReq
from ..transfer.base import TransferBackend, layout_to_dict
from ..transfer.registry import create_backend
from .role import RoleContext


def start_backend(ctx: RoleContext) -> tuple[TransferBackend, dict]:
    """Start this worker's backend over its KV pool; -> (backend, local facts for kv_req checks)."""
    backend = create_backend(ctx.cfg.transfer_backend)
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
