"""The prefill role: prefill each request, hold its KV pages, push them to the decode worker.

The engine runs the prompt with max_new_tokens=1 and holds the pages; PrefillSender pairs
them with the decode's kv_req and writes them; the pages are released when the sender
reports the room finished, and the front gets the first token (or the failure) then.
"""

from __future__ import annotations

from ..core.errors import PDServeError
from ..core.messages import GenerateReq, TokenOutput
from ..core.netaddr import local_connect_host
from ..disagg.bootstrap_client import BootstrapClient, bootstrap_addr
from ..disagg.bootstrap_table import RankInfo
from ..disagg.kv_sender import PrefillSender
from ..disagg.prefill_events import PrefillFacts
from ..engine.sequence import StepOutput
from ..transfer.base import Endpoint
from .colocated import ColocatedRole
from .pump import MessagePump
from .role import WorkerRole, engine_request, error_output, log_handoff, require_pd, start_backend, to_token_output

REGISTER_DEADLINE_S = 120.0
class PrefillRole(WorkerRole):
    def start(self) -> dict:
        cfg = self.ctx.cfg
        self.backend, self.local = start_backend(self.ctx)
        self.sender = PrefillSender(self.backend, self.dp_rank, self.local,
                                    bootstrap_timeout=self.ctx.pd.bootstrap_timeout,
                                    failed_ttl=self.ctx.pd.room_ttl, wake=self.ctx.wake)
        self.pump = MessagePump(self.backend, self.ctx.wake)
        self.local_role = ColocatedRole(self.ctx)  # requests without PD fields (health checks)
        self.rooms: dict[str, int] = {}  # rid -> room
        self.first: dict[str, StepOutput] = {}
        ep = self.local.endpoint
        info = RankInfo(dp_rank=self.dp_rank, dp_size=cfg.dp_size, rank_ip=ep["ip"], rank_port=ep["port"],
                        page_size=self.local.page_size, kv_cache_dtype=self.local.kv_dtype,
                        load_balance_method=cfg.load_balance_method,
                        fingerprint=self.local.fingerprint, endpoint=ep,
                        transfer_backend=self.local.backend)
        token = self.ctx.pd.bootstrap_token
        with BootstrapClient(timeout=5.0, token=token) as client:
            # a KV request naming another instance was resolved before a restart: refused at once
            self.sender.instance_id = client.register_rank(
                bootstrap_addr(local_connect_host(cfg.host), cfg.bootstrap_port), info,
                deadline_s=REGISTER_DEADLINE_S)
        return {"transfer_endpoint": ep}

    def on_generate(self, req: GenerateReq) -> list[TokenOutput]:
        if req.health_check:  # the front's /health_generate: this worker alone, no handoff
            return self.local_role.on_generate(req)
        try:
            require_pd(req, "prefill")
            room = req.pd.bootstrap_room
            if self.sender.holds(room):  # never fail or overwrite the live one
                return [error_output(req.rid, 400, f"bootstrap_room {room} is already in flight on "
                                     f"prefill dp_rank {self.dp_rank}", "invalid_request_error")]
            self.engine.add(engine_request(req, req.sampling.replace(max_new_tokens=1), hold_kv=True))
        except PDServeError as e:
            if req.pd is not None:  # a decode asking for this room must fail at once too
                self.sender.mark_failed(req.pd.bootstrap_room, e.message)
            return [error_output(req.rid, e.status, e.message, e.type)]
        self.rooms[req.rid] = req.pd.bootstrap_room
        self.sender.accept(req.pd.bootstrap_room, req.rid, len(req.input_ids), req.input_ids)
        return []

    def on_step(self, outs: list[StepOutput]) -> list[TokenOutput]:
        local = []
        for o in outs:
            room = self.rooms.get(o.rid)
            if room is None:
                local.append(to_token_output(o))  # a health check run here
                continue
            if not o.finished:
                continue
            self.first[o.rid] = o
            self.sender.prefill_done(room, o.held_pages or [], PrefillFacts(
                first_token=o.token_id, first_logprob=o.logprob, first_top_logprobs=o.top_logprobs,
                input_logprobs=o.input_logprobs, input_top_logprobs=o.input_top_logprobs,
                prompt_len=o.prompt_tokens, cached_tokens=o.cached_tokens))
        return local + self.poll()

    def on_abort(self, rid: str, reason: str) -> list[TokenOutput]:
        room = self.rooms.get(rid)
        if room is None:
            return self.local_role.on_abort(rid, reason)
        self.sender.fail(room, f"room {room}: prefill request aborted ({reason})")
        return self.poll()

    def on_room_failed(self, room: int, reason: str) -> None:
        self.sender.mark_failed(room, reason)

    def on_room_dropped(self, room: int, reason: str) -> None:
        self.sender.drop(room, reason)

    def on_room_routed(self, room: int, rank: int, endpoint: Endpoint) -> None:
        self.sender.room_routed(room, rank, endpoint)

    def poll(self) -> list[TokenOutput]:
        for sender, msg in self.pump.drain():
            self.sender.on_message(sender, msg)
        outs = []
        for done in self.sender.poll():
            log_handoff(done)
            self.rooms.pop(done.rid, None)
            first = self.first.pop(done.rid, None)
            self.engine.abort(done.rid)  # frees held pages, or stops a prefill still running
            if done.dropped:  # a success for the router: the decode serves the request itself
                outs.append(TokenOutput(done.rid, finished=True, meta=done.meta, timeline=done.stages,
                                        finish_reason={"type": "abort", "message": done.reason}))
            elif done.ok and first is not None:
                outs.append(to_token_output(first, done.meta, done.stages))
            else:
                outs.append(error_output(done.rid, 500, done.reason, "handoff_error", done.meta, done.stages))
        return outs

    def inflight_transfers(self) -> int:
        return self.sender.inflight()

    def stats_extra(self) -> dict:
        return {"preallocated_requests": self.sender.holding(), "handoff_states": self.sender.states(),
                "early_kv_reqs": len(self.sender.early), "doomed_rooms": len(self.sender.failed),
                "forwarded_kv_reqs": len(self.sender.forwarded)}

    def close(self) -> None:
        self.pump.close()
        self.sender.close()
        self.backend.close()
