"""The front's view of a request while it runs.

`ItemProgress`, one request item: output ids, incremental text with stop strings applied,
logprobs, finish reason or error, and the timeline stages recorded so far (its own and its
worker's). Both reply styles (native, OpenAI) and the metrics read it. The item's TextOptions
(text_options.py) say whether special tokens are skipped and whether a matched stop string or
stop token stays in the text.

`ActiveRequest`, the items `Generator.start` sent to workers: it folds worker outputs into each
item's `ItemProgress` and yields it on every change. A stop string match aborts that item's
worker request; `close()` (always called by the route, e.g. on client disconnect or error)
aborts every unfinished one and releases the dispatcher's load. Metrics are fed on every output
and at each item's end; a finished item's timeline is logged at debug level.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, AsyncIterator

from ..core.errors import Timeout
from ..core.log_format import fields
from ..core.logprobs import TopLogprobs
from ..core.messages import ErrorInfo, GenerateReq, TokenOutput
from ..core.timeline import Stage, build_timeline
from .protocol import RequestItem
from .stall_watch import STALLED, StallWatch
from .text_options import StopInText
from .tokenizer import IncrementalDetokenizer, ServerTokenizer

if TYPE_CHECKING:
    from .front import Generator
    from .roles import Dispatch

log = logging.getLogger(__name__)


def held_back(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of `text` that could still grow into a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class ItemProgress:
    """Fold TokenOutputs into cumulative state; `apply` says when a stop string matched."""

    def __init__(self, item: RequestItem, tokenizer: ServerTokenizer, arrival: float | None = None):
        self.item = item
        self.resumed = len(item.resume.ids) if item.resume else 0  # output ids generated before a migration
        self.detok = IncrementalDetokenizer(tokenizer, item.input_ids[:len(item.input_ids) - self.resumed],
                                            item.text.skip_special_tokens)
        self.stops = item.sampling.stop
        self.stop_in_text = item.text.stop_in_text
        self.max_stop = max((len(s) for s in self.stops), default=0)
        self.arrival = time.monotonic() if arrival is None else arrival
        self.text = ""
        self.output_ids: list[int] = []
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[TopLogprobs] = []  # per output token, when asked
        self.input_logprobs: list[float | None] | None = None
        self.input_top_logprobs: list[TopLogprobs | None] | None = None
        self.prompt_tokens = len(item.input_ids) - self.resumed
        self.cached_tokens = 0  # prompt tokens reused from a prefix cache (the worker says)
        self.finish_reason: dict | None = None
        self.error: ErrorInfo | None = None
        self.meta: dict = {}
        self.finished = False
        self.finish_time: float | None = None
        self.first_token_at: float | None = None  # monotonic, like arrival
        self.last_token_at: float | None = None
        self.stages: dict[str, float] = {Stage.ARRIVAL.value: time.time()}  # core.timeline, wall clock
        self.facts: dict = {}  # dp_rank, dispatch_reason: what the front decided
        if self.resumed:
            self._replay(item.input_ids[len(item.input_ids) - self.resumed:])

    def _replay(self, ids: list[int]) -> None:
        """A continuation (server/resume.py): the ids streamed before the migration, folded in as
        if generated here, so text, held-back stop prefixes and usage go on from the same point."""
        for tid in ids:  # a stop string cannot match: the old server would have ended the answer
            self.output_ids.append(tid)
            self._add_text(self.detok.add(tid))

    def dispatched(self, dp_rank: int, reason: str) -> None:
        self.stages[Stage.DISPATCH.value] = time.time()
        self.facts.update(dp_rank=dp_rank, dispatch_reason=reason)

    def timeline(self) -> dict:
        """meta_info["timeline"]: the stages so far with the room and both ranks."""
        return build_timeline(self.stages, {**self.meta, **self.facts, "cached_tokens": self.cached_tokens})

    @property
    def rid(self) -> str:
        return self.item.rid

    def visible_text(self) -> str:
        """Text safe to show now: a tail that may become a stop string waits for more tokens
        (unless a matched stop string stays in the text anyway)."""
        if self.finished or not self.stops or self.stop_in_text is not StopInText.TRIM:
            return self.text
        return self.text[:len(self.text) - held_back(self.text, self.stops)]

    def e2e_latency(self) -> float:
        return (self.finish_time or time.monotonic()) - self.arrival

    def apply(self, out: TokenOutput) -> bool:
        """Fold one output in; True means a stop string matched and the worker must be aborted."""
        if self.finished:
            return False
        self.meta.update(out.meta)
        if out.timeline:
            self.stages.update(out.timeline)
        if out.token_ids:
            now = time.monotonic()
            if self.first_token_at is None:
                self.first_token_at = now
                self.stages[Stage.FIRST_TOKEN.value] = time.time()
            self.last_token_at = now
        if out.prompt_tokens:
            self.prompt_tokens = out.prompt_tokens - self.resumed
        if out.cached_tokens:
            # a continuation's cached prefix may reach into its resumed ids: those are output
            self.cached_tokens = min(out.cached_tokens, self.prompt_tokens) if self.resumed else out.cached_tokens
        if out.input_logprobs is not None:
            self.input_logprobs = list(out.input_logprobs)
        if out.input_top_logprobs is not None:
            self.input_top_logprobs = list(out.input_top_logprobs)
        if out.error is not None:
            self.error = out.error
            self._finish(out.finish_reason or {"type": "abort", "message": out.error.message})
            return False
        matched = (out.finish_reason or {}).get("matched") if out.finished else None
        ids = out.token_ids
        for k, tid in enumerate(ids):
            self.output_ids.append(tid)
            if out.token_logprobs is not None and k < len(out.token_logprobs):
                self.output_logprobs.append(out.token_logprobs[k])
            if out.top_logprobs is not None and k < len(out.top_logprobs):
                self.output_top_logprobs.append(out.top_logprobs[k])
            if isinstance(matched, int) and k == len(ids) - 1 and tid == matched \
                    and self.stop_in_text is StopInText.TRIM:
                break  # a matched stop token is reported but not shown as text
            if self._add_text(self.detok.add(tid)):
                return True
        if out.finished:
            if self._add_text(self.detok.flush()):
                return True
            self._finish(out.finish_reason or {"type": "length", "length": len(self.output_ids)})
        return False

    def _add_text(self, delta: str) -> bool:
        if not delta:
            return False
        start = max(0, len(self.text) - self.max_stop + 1)
        self.text += delta
        if not self.stops:
            return False
        hits = [(p, s) for s in self.stops if (p := self.text.find(s, start)) >= 0]
        if not hits:
            return False
        pos, stop = min(hits)
        if self.stop_in_text is StopInText.TRIM:
            self.text = self.text[:pos]
        elif self.stop_in_text is StopInText.THROUGH_STOP:
            self.text = self.text[:pos + len(stop)]
        self._finish({"type": "stop", "matched": stop})
        return True

    def _finish(self, reason: dict) -> None:
        self.finished = True
        self.finish_reason = reason
        self.finish_time = time.monotonic()
        self.stages[Stage.FINISH.value] = time.time()


# ---- the request: its items in flight and the worker outputs folded into them


def item_cost(item: RequestItem) -> int:
    """The tokens an item in flight counts for on its rank (the dispatcher's load)."""
    return len(item.input_ids) + item.sampling.max_new_tokens


class ActiveRequest:
    """Items already sent to workers. Iterate `events()` once; call `close()` exactly at the end."""

    def __init__(self, gen: Generator, items: list[RequestItem], dispatches: list[Dispatch]):
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
            self._gen.dispatcher.finished(d.dp_rank, item_cost(it) - self._reused.get(rid, 0))
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
