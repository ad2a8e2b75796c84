"""The colocated role: each worker prefills and decodes its own requests."""

from __future__ import annotations

from ..core.errors import PDServeError
from ..core.messages import GenerateReq, TokenOutput
from .role import WorkerRole, engine_request, error_output


class ColocatedRole(WorkerRole):
    def on_generate(self, req: GenerateReq) -> list[TokenOutput]:
        try:
            self.engine.add(engine_request(req))
        except PDServeError as e:
            return [error_output(req.rid, e.status, e.message, e.type)]
        return []

    def on_abort(self, rid: str, reason: str) -> list[TokenOutput]:
        if self.engine.abort(rid):
            return [error_output(rid, 499, reason, "aborted")]
        return []
