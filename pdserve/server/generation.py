"""The request path shared by every route and every role.

`Generator.start(items)` checks the items against the workers' limits, asks the role where
each goes and sends them; nothing is sent unless every item passes (else a PDServeError).
It returns the request's `ActiveRequest` (request_state.py), which folds the worker outputs
that come back. Metrics are fed on dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..core.errors import BadRequest
from .metrics import FrontMetrics
from .protocol import RequestItem
from .request_state import ActiveRequest, item_cost
from .roles import Dispatch, DPDispatcher, FrontRole
from .tokenizer import ServerTokenizer
from .worker_pool import WorkerPool


@dataclass(frozen=True)
class Limits:
    max_context: int  # prompt + output tokens, the smallest over the ranks
    vocab_size: int
    output_timeout_s: float = 900.0  # a request with no output for this long fails with 504


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
                self.dispatcher.started(d.dp_rank, item_cost(it))
                dispatches.append(d)
            self.pool.check_free([it.rid for it in items])
        except BaseException as e:
            for it, d in zip(items, dispatches):
                self.dispatcher.finished(d.dp_rank, item_cost(it))
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
