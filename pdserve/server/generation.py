"""The request path shared by every route and every role.

`Generator.start(items)` checks the items against the workers' limits, asks the role where
each goes and sends them; nothing is sent unless every item passes (else a PDServeError).
The returned `ActiveRequest` folds worker outputs into `ItemProgress` and yields it on every
change. A stop string match aborts that item's worker request; `close()` (always called by
the route, e.g. on client disconnect or error) aborts every unfinished one. Metrics are fed
on dispatch, on every output and at each item's end; a finished item's timeline is logged
at debug level.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator

from ..core.errors import BadRequest, Timeout
from ..core.log_format import fields
from ..core.messages import GenerateReq, TokenOutput
from .metrics import FrontMetrics
from .protocol import RequestItem
from .request_state import ItemProgress
from .roles import Dispatch, DPDispatcher, FrontRole
from .stall_watch import STALLED, StallWatch
from .tokenizer import ServerTokenizer
from .worker_pool import WorkerPool

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class Limits:
    max_context: int  # prompt + output tokens, the smallest over the ranks
    vocab_size: int
    output_timeout_s: float = 900.0  # a request with no output for this long fails with 504


def _cost(item: RequestItem) -> int:
    return len(item.input_ids) + item.sampling.max_new_tokens


class ActiveRequest:
    """Items already sent to workers. Iterate `events()` once; call `close()` exactly at the end."""

    def __init__(self, gen: "Generator", items: list[RequestItem], dispatches: list[Dispatch]):
        self._gen = gen
        self.items = items
        self._where = {it.rid: (it, d) for it, d in zip(items, dispatches)}
        arrival = time.monotonic()
        self.progress = {it.rid: ItemProgress(it, gen.tokenizer, arrival) for it in items}
        self._sink: asyncio.Queue = asyncio.Queue()
        self._sent: set[str] = set()
        self._released: set[str] = set()
        self._reused: dict[str, int] = {}  # rid -> cached prompt tokens taken off its rank's load
        self._closed = False

    def send_all(self) -> None:
        for it, d in self._where.values():
            req = GenerateReq(it.rid, it.input_ids, it.sampling, it.return_logprob, d.pd, time.time(), d.reason,
                              it.top_logprobs, it.prompt_logprobs, d.health_check)
            self._gen.pool.submit(d.dp_rank, req, self._sink)
            self._sent.add(it.rid)
            self.progress[it.rid].dispatched(d.dp_rank, d.reason)
            self._gen.metrics.dispatched(d.dp_rank, d.reason)

    def _release(self, rid: str) -> None:
        if rid not in self._released:
            self._released.add(rid)
            it, d = self._where[rid]
            self._gen.dispatcher.finished(d.dp_rank, _cost(it) - self._reused.get(rid, 0))
            self._gen.role.released(rid, d, self.progress[rid].finished and self.progress[rid].error is None)

    def _note_reuse(self, prog: ItemProgress) -> None:
        if prog.cached_tokens and prog.rid not in self._reused and prog.rid not in self._released:
            self._reused[prog.rid] = prog.cached_tokens
            self._gen.dispatcher.reused(self._where[prog.rid][1].dp_rank, prog.cached_tokens)

    def unfinished(self) -> list[str]:
        return [rid for rid, p in self.progress.items() if not p.finished]

    async def events(self) -> AsyncIterator[ItemProgress]:
        timeout = self._gen.limits.output_timeout_s
        watch = StallWatch(asyncio.get_running_loop(), timeout, self._sink)
        try:
            while self.unfinished():
                out = await self._sink.get()
                if out is STALLED:
                    pending = self.unfinished()
                    ranks = sorted({self._where[r][1].dp_rank for r in pending})
                    raise Timeout(f"no output for {timeout:.0f}s from dp ranks {ranks} for rids {pending}")
                watch.saw_output()
                prog = self._apply(out)
                if prog is not None:
                    yield prog
        finally:
            watch.cancel()

    def _apply(self, out: TokenOutput) -> ItemProgress | None:
        """Fold one worker output into its item's progress; None if that item already ended."""
        prog = self.progress.get(out.rid)
        if prog is None or prog.finished:
            return None
        n_before, prev_token_at = len(prog.output_ids), prog.last_token_at
        if prog.apply(out):
            self._gen.pool.abort(out.rid, "stop string matched")
        self._note_reuse(prog)
        self._gen.metrics.tokens_arrived(prog, len(prog.output_ids) - n_before, prev_token_at)
        if prog.finished:
            self._release(out.rid)
            self._gen.metrics.item_finished(prog)
            if log.isEnabledFor(logging.DEBUG):
                tl = prog.timeline()
                log.debug("timeline", extra=fields(rid=prog.rid, room=tl.get("bootstrap_room"), timeline=tl))
        return prog

    def abort_item(self, rid: str, reason: str) -> bool:
        """End one unfinished item now (SGLang's /abort_request): its worker drops it and frees
        its pages, and its progress finishes with finish_reason abort, so a stream ends cleanly."""
        prog = self.progress.get(rid)
        if self._closed or prog is None or prog.finished:
            return False
        if rid in self._sent:
            self._gen.pool.abort(rid, reason)
        self._sink.put_nowait(TokenOutput(rid, finished=True, finish_reason={"type": "abort", "message": reason}))
        return True

    def close(self, reason: str = "request closed before it finished (client gone or error)") -> None:
        """Abort every unfinished item at its worker and release its dispatcher load. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for rid in self.unfinished():
            if rid in self._sent:
                self._gen.pool.abort(rid, reason)
            self._gen.metrics.item_aborted()
        for rid in self._where:
            self._release(rid)


class Generator:
    def __init__(self, pool: WorkerPool, dispatcher: DPDispatcher, role: FrontRole,
                 tokenizer: ServerTokenizer, limits: Limits, metrics: FrontMetrics):
        self.pool = pool
        self.dispatcher = dispatcher
        self.role = role
        self.tokenizer = tokenizer
        self.limits = limits
        self.metrics = metrics

    def check(self, item: RequestItem) -> RequestItem:
        """Validate one item against vocabulary and context; fit a default max_new_tokens."""
        n_prompt = len(item.input_ids)
        if n_prompt == 0:
            raise BadRequest(f"the prompt of item {item.index} is empty")
        vocab = self.limits.vocab_size
        bad = next((t for t in item.input_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise BadRequest(f"token id {bad} in the prompt of item {item.index} is outside the "
                             f"vocabulary [0, {vocab})")
        ctx = self.limits.max_context
        room = ctx - n_prompt
        if room < 1:
            raise BadRequest(f"the prompt of item {item.index} has {n_prompt} tokens; the context "
                             f"length is {ctx}, leaving no room to generate")
        want = item.sampling.max_new_tokens
        if want > room:
            if item.max_new_tokens_given:
                raise BadRequest(f"prompt ({n_prompt} tokens) + max_new_tokens ({want}) exceeds the "
                                 f"context length {ctx}")
            item = replace(item, sampling=item.sampling.replace(max_new_tokens=room))
        return item

    def start(self, items: list[RequestItem], pinned: Dispatch | None = None) -> ActiveRequest:
        """Check, dispatch and send every item (no await: atomic on the event loop).
        `pinned` bypasses the role (health checks)."""
        dispatches: list[Dispatch] = []
        try:
            items = [self.check(it) for it in items]
            for it in items:
                d = pinned or self.role.dispatch(it, self.dispatcher)
                self.dispatcher.started(d.dp_rank, _cost(it))
                dispatches.append(d)
            self.pool.check_free([it.rid for it in items])
        except BaseException as e:
            for it, d in zip(items, dispatches):
                self.dispatcher.finished(d.dp_rank, _cost(it))
            self.role.rejected(items, e)
            if isinstance(e, Exception):
                self.metrics.rejected(e, len(items))
            raise
        active = ActiveRequest(self, items, dispatches)
        self.metrics.items_started(len(items))
        try:
            active.send_all()
        except BaseException:
            active.close("a worker was not reachable")
            raise
        return active
