"""The decode role: receive each request's KV from its prefill worker, then decode it.

Built once at start: the PrefillLink (everything about the prefill servers: rank resolution,
endpoints, heartbeats, /fail_room and /drop_room), the DecodeReceiver on it (the handoffs: it
reserves pages through the engine and waits for the KV), and a ColocatedRole for the requests
this decode runs alone (health checks, prompts it prefills itself). On success the request joins
the engine's running batch from the prefill's first token. A failed room whose prefill may still
write its pages (quarantined) is answered at once, but its pages stay reserved in the engine
until the receiver releases them.
"""

from __future__ import annotations

from typing import Protocol

from ..core.errors import PDServeError
from ..core.logprobs import PromptLogprobs
from ..core.messages import GenerateReq, TokenOutput
from ..disagg.bootstrap_client import bootstrap_addr
from ..disagg.decode_events import Reservation
from ..disagg.decode_rooms import HandoffQueue
from ..disagg.kv_receiver import DecodeReceiver, ReceiverLimits
from ..disagg.prefill_link import LinkSettings, PrefillLink
from .admission import GenerationReserve, PoolArithmetic
from .colocated import ColocatedRole
from .pump import MessagePump
from .role import WorkerRole, engine_request, error_output, log_handoff, require_pd, start_backend, to_token_output

TRANSFER_IO_TIMEOUT_S = 60.0  # the io_timeout of the built-in backends (tcp, nixl, mooncake's control path)


class Deadlines(Protocol):
    """What `quarantine_timeout` reads: a PDSettings (or the Envs it was built from)."""

    @property
    def kv_quarantine_timeout(self) -> float: ...

    @property
    def bootstrap_timeout(self) -> float: ...


def quarantine_timeout(pd: Deadlines, backend: object) -> float:
    """How long the pages of a room whose prefill went unheard stay held: PDSERVE_KV_QUARANTINE_TIMEOUT,
    else longer than that prefill may still write (its room starts a write within its bootstrap
    deadline or fails; a write stalled for the backend's io timeout fails)."""
    if pd.kv_quarantine_timeout:
        return pd.kv_quarantine_timeout
    return pd.bootstrap_timeout + float(getattr(backend, "io_timeout", TRANSFER_IO_TIMEOUT_S))


class DecodeRole(WorkerRole):
    def start(self) -> dict:
        pd, cfg = self.ctx.pd, self.ctx.cfg
        self.backend, self.local = start_backend(self.ctx)
        self.pending: dict[int, GenerateReq] = {}  # room -> request, until its KV arrived
        self.rooms: dict[str, int] = {}  # rid -> room
        self.quarantined: dict[int, str] = {}  # room -> rid: answered, its pages still reserved
        self.link = PrefillLink(LinkSettings.of(pd))  # all this decode knows of each prefill
        self.receiver = DecodeReceiver(
            self.backend, self.dp_rank, self.local, link=self.link, reserve=self._reserve, wake=self.ctx.wake,
            limits=ReceiverLimits(waiting_timeout=pd.waiting_timeout,
                                  quarantine=quarantine_timeout(pd, self.backend),
                                  queue=HandoffQueue(cfg.max_queued_handoffs, cfg.handoff_queue_timeout)))
        self.pool_math = PoolArithmetic(self.engine, self.local.page_size,
                                        GenerationReserve(cfg.num_reserved_decode_tokens))
        self.pump = MessagePump(self.backend, self.ctx.wake)
        self.local_role = ColocatedRole(self.ctx)  # health checks and prompts this decode prefills
        self.local_max = cfg.disagg_local_prefill_max_tokens
        self.overload = cfg.disagg_prefill_overload_tokens
        self.local_meta: dict[str, dict] = {}  # rid -> meta for the first output of a local prefill
        return {"transfer_endpoint": self.local.endpoint}

    def _reserve(self, rid: str, prompt_len: int) -> Reservation | None:
        """Pages for a room's prompt, reusing what this decode's prefix cache holds of it, if
        they and the generation reserves fit (worker/admission.py); None: it waits its turn."""
        req = self.pending[self.rooms[rid]]
        reserved = self.receiver.with_pages()
        held = {q.rid: (len(q.input_ids), q.sampling.max_new_tokens)
                for room, q in self.pending.items() if room in reserved}
        return self.pool_math.admit(rid, req.input_ids, req.sampling.max_new_tokens, held)

    def on_generate(self, req: GenerateReq) -> list[TokenOutput]:
        if req.health_check:  # the front's /health_generate: this worker alone, no handoff
            return self.local_role.on_generate(req)
        try:
            require_pd(req, "decode")
            self.engine.validate(engine_request(req))
            room = req.pd.bootstrap_room
            if room in self.pending:
                raise PDServeError(f"bootstrap_room {room} is already in flight on decode dp_rank "
                                   f"{self.dp_rank}")
            if room in self.quarantined or req.rid in self.quarantined.values():
                raise PDServeError(f"bootstrap_room {room} / request id {req.rid}: an earlier handoff "
                                   f"with that room or id still holds KV pages on decode dp_rank "
                                   f"{self.dp_rank} (quarantined: its prefill may still write them)")
        except PDServeError as e:
            status = 400 if e.status == 500 else e.status
            return [error_output(req.rid, status, e.message, e.type)]
        why = self._prefill_here_because(req)
        if why is not None:
            return self._prefill_here(req, *why)
        self.pending[room] = req
        self.rooms[req.rid] = room
        self.receiver.accept(room, req.rid, bootstrap_addr(req.pd.bootstrap_host, req.pd.bootstrap_port),
                             len(req.input_ids), req.pd.prefill_dp_rank)
        return []

    def _prefill_here_because(self, req: GenerateReq) -> tuple[int, str] | None:
        """(missing tokens, why) when this decode should prefill `req` itself, else None."""
        if not (self.local_max or self.overload):
            return None
        missing = len(req.input_ids) - self.engine.cached_prefix_tokens(req.input_ids)
        if self.local_max and missing <= self.local_max:
            return missing, (f"{missing} prompt tokens not in its cache, --disagg-local-prefill-max-tokens "
                             f"{self.local_max}")
        load = self.link.load_tokens(bootstrap_addr(req.pd.bootstrap_host, req.pd.bootstrap_port)) \
            if self.overload else None
        if load is not None and load > self.overload:
            return missing, (f"the prefill reported {load} prompt tokens in flight, "
                             f"--disagg-prefill-overload-tokens {self.overload}")
        return None

    def _prefill_here(self, req: GenerateReq, missing: int, why: str) -> list[TokenOutput]:
        """Conditional disaggregation: this decode computes the prompt itself (only `missing`
        tokens are not in its prefix cache) and tells the prefill at once to drop the room, so
        that it stops computing it (sending the notice after the first token instead measured no
        faster here; docs/benchmarks.md, "Conditional disaggregation")."""
        room = req.pd.bootstrap_room
        out = self.local_role.on_generate(req)
        if out:  # refused by the engine: the prefill leg must not wait for us either
            return out
        self.local_meta[req.rid] = {"disaggregation": "local", "bootstrap_room": room,
                                    "decode_dp_rank": self.dp_rank, "local_prefill_tokens": missing,
                                    "local_prefill_reason": why}
        reason = f"decode dp_rank {self.dp_rank} prefilled it ({why})"
        self.link.drop_room(bootstrap_addr(req.pd.bootstrap_host, req.pd.bootstrap_port), room, reason)
        return []

    def on_abort(self, rid: str, reason: str) -> list[TokenOutput]:
        if rid in self.quarantined.values():  # answered already; its pages wait for the receiver
            return []
        room = self.rooms.get(rid)
        if room is not None and room in self.pending:
            self.receiver.abort(room, f"room {room}: decode request aborted ({reason})")
            return self.poll()
        self.rooms.pop(rid, None)
        self.local_meta.pop(rid, None)
        if self.engine.abort(rid):
            return [error_output(rid, 499, reason, "aborted")]
        return []

    def on_step(self, outs):
        tokens = []
        for o in outs:
            if o.finished:
                self.rooms.pop(o.rid, None)
            tokens.append(to_token_output(o, self.local_meta.pop(o.rid, None)))
        return tokens

    def poll(self) -> list[TokenOutput]:
        for sender, msg in self.pump.drain():
            self.receiver.on_message(sender, msg)
        outs = []
        for done in self.receiver.poll():
            log_handoff(done)
            req = self.pending.pop(done.room, None)
            if req is None:
                continue
            if not done.ok:
                self.rooms.pop(req.rid, None)
                if self.receiver.holds(done.room):  # a write may still land: no reuse yet
                    self.quarantined[done.room] = req.rid
                else:
                    self.engine.release(req.rid)
                refused = done.meta.get("admission") == "refused"  # back-pressure: 429, try elsewhere
                status, kind = (429, "overloaded_error") if refused else (500, "handoff_error")
                outs.append(error_output(req.rid, status, done.reason, kind, done.meta, done.stages))
                continue
            kv = done.aux  # the prefill's KvDone: a successful handoff has one
            assert kv is not None
            # SGLang's return_logprob leaves the prompt's logprobs to the prefill's reply (the
            # router puts them in front); an OpenAI echo gets them in this decode's reply
            echo = req.prompt_logprobs is PromptLogprobs.IN_REPLY
            step = self.engine.add_prefilled(
                engine_request(req), kv.first_token, kv.first_logprob, kv.first_top_logprobs,
                kv.input_logprobs if echo else None, kv.input_top_logprobs if echo else None)
            if step.finished:
                self.rooms.pop(req.rid, None)
            step.cached_tokens = kv.cached_tokens  # reused on the prefill side
            outs.append(to_token_output(step, done.meta, done.stages))
        for room in self.receiver.released():
            rid = self.quarantined.pop(room, None)
            if rid is not None:
                self.engine.release(rid)
        return outs

    def inflight_transfers(self) -> int:
        return self.receiver.inflight()

    def stats_extra(self) -> dict:
        stats = self.receiver.stats()
        stats["admission"]["num_reserved_decode_tokens"] = self.pool_math.reserve.tokens
        return stats

    def close(self) -> None:
        self.link.close()
        self.pump.close()
        self.receiver.close()
        self.backend.close()
