"""A torch-free stand-in for `pdserve.engine.engine.Engine`, for worker-role tests and the fake
worker processes (tests only).

It has what the roles and the worker loop (pdserve/worker/*.py) call -- validate, add, abort,
release, reserve, add_prefilled, has_work, step, stats, flush_cache, seqs, pool.layout() --
with the real engine's semantics where they depend on them, built from the engine's own
torch-free parts: its page allocator (`engine/allocator.PageAllocator`), its prefix cache turned
off (`engine/prefix_cache.PrefixCache`: nothing cached, what decode admission reads), and its
step types (`engine/step_io`: EngineRequest, StepOutput, EngineStats).

- No model. One `step()` prefills every waiting request whose whole prompt fits the free pages
  (arrival order, stopping at the first that does not fit) and decodes one token of every
  request already running (one that cannot get a page for its next token skips the step; the
  real engine would preempt). Tokens are deterministic: next = (last * 31 + 7) % vocab_size,
  from the prompt's last id (`next_token`; a subclass may script them, see `_next_token`);
  logprobs are `fake_logprob(token)`. `step_s` > 0 paces the steps (the fake worker's knob).
- A real KV pool: a numpy float32 buffer [num_layers, 2, num_pages, page_size, heads, dim] whose
  `layout()` a transfer backend can register, so FakeBackend page writes really move bytes.
  Computing a token writes `kv_pattern(token, position)` into its slot of every region, so a
  test can compare pages across engines (`pool.read`) and `add_prefilled` records in `imports`
  whether the imported pages really hold the prompt's KV.
- Finished requests free their pages unless they asked to hold them (hold_kv): those stay in
  `held` (and in StepOutput.held_pages) until abort() or release(), as do reserve()d pages
  until release() or add_prefilled(). No prefix cache: freed pages are free at once.
- `leaks()` says which pages are not back (held, reserved, owned by a request, or lost).

Importing this module does not import torch (the engine's model and kernels do).
Requests are `EngineRequest`s, or anything with their fields.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from pdserve.core.errors import BadRequest
from pdserve.core.kv_layout import KVLayout
from pdserve.engine.allocator import PageAllocator
from pdserve.engine.prefix_cache import PrefixCache
from pdserve.engine.step_io import EngineStats, StepOutput


def next_token(prev: int, vocab: int) -> int:
    return (prev * 31 + 7) % vocab


def fake_logprob(token: int) -> float:
    return -((token % 7) + 1) / 8.0


def fake_continuation(prompt: list[int], n: int, vocab: int) -> list[int]:
    """The first n tokens any FakeEngine generates after `prompt` (no stop tokens)."""
    out, prev = [], prompt[-1]
    for _ in range(n):
        prev = next_token(prev, vocab)
        out.append(prev)
    return out


@dataclass(frozen=True)
class FakeModelConfig:
    """What RoleContext.model_cfg is asked for: the KV compatibility fingerprint."""

    architecture: str = "FakeForCausalLM"
    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 4

    def fingerprint(self) -> dict:
        return {"architecture": self.architecture, "num_layers": self.num_layers,
                "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim}


class FakeKVPool:
    """The paged pool of engine/kv_pool.py over numpy; region r = (layer r // 2, K or V)."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int):
        self.num_pages, self.page_size = num_pages, page_size
        self.num_regions = num_layers * 2
        self.buffer = np.zeros((num_layers, 2, num_pages, page_size, num_kv_heads, head_dim), np.float32)
        # [region, slot, heads, dim] view of the same memory; slot = page * page_size + offset
        self.slots = self.buffer.reshape(self.num_regions, num_pages * page_size, num_kv_heads, head_dim)

    def layout(self) -> KVLayout:
        page_bytes = self.buffer[0, 0, 0].nbytes
        return KVLayout(base_ptr=self.buffer.ctypes.data, num_regions=self.num_regions,
                        num_pages=self.num_pages, page_bytes=page_bytes,
                        region_stride=page_bytes * self.num_pages, page_size=self.page_size,
                        dtype="float32")

    def _slot_ids(self, pages: list[int], start: int, end: int) -> np.ndarray:
        pos = np.arange(start, end)
        return np.asarray(pages, np.int64)[pos // self.page_size] * self.page_size + pos % self.page_size

    def write(self, pages: list[int], start: int, tokens: list[int]) -> None:
        """Store the KV of `tokens` at positions start.. of the sequence owning `pages`."""
        self.slots[:, self._slot_ids(pages, start, start + len(tokens))] = \
            kv_pattern(tokens, start, self.slots.shape[0], self.slots.shape[2:])

    def read(self, pages: list[int], num_tokens: int) -> np.ndarray:
        """A copy of the KV of positions [0, num_tokens) of the sequence owning `pages`."""
        return self.slots[:, self._slot_ids(pages, 0, num_tokens)].copy()


def kv_pattern(tokens: list[int], start: int, regions: int, shape: tuple[int, int]) -> np.ndarray:
    """The fake KV of `tokens` at positions start..: [regions, len(tokens), heads, dim], never 0."""
    tok = np.asarray(tokens, np.int64)[None, :, None, None]
    pos = np.arange(start, start + len(tokens))[None, :, None, None]
    reg = np.arange(regions)[:, None, None, None]
    elem = np.arange(shape[0] * shape[1]).reshape(1, 1, *shape)
    return (((tok * 131 + pos * 17 + reg * 7) % 997) + 1 + elem / 64).astype(np.float32)


@dataclass(eq=False)
class FakeSeq:
    req: object  # EngineRequest-like: rid, prompt_ids, sampling, return_logprob, hold_kv
    pages: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0  # positions whose KV is in the pool
    sent_input_logprobs: bool = False

    @property
    def rid(self) -> str:
        return self.req.rid

    @property
    def num_tokens(self) -> int:
        return len(self.req.prompt_ids) + len(self.output_ids)


class FakeEngine:
    def __init__(self, num_pages: int = 16, page_size: int = 4, *, model_cfg: FakeModelConfig | None = None,
                 vocab_size: int = 1000, max_context: int = 256, max_running: int = 64,
                 eos_token_ids: tuple[int, ...] = (), step_s: float = 0.0):
        self.model_cfg = model_cfg or FakeModelConfig()
        m = self.model_cfg
        self.pool = FakeKVPool(m.num_layers, num_pages, page_size, m.num_kv_heads, m.head_dim)
        self.allocator = PageAllocator(num_pages)
        self.cache = PrefixCache(self.allocator, page_size, enabled=False)
        self.step_s = step_s
        self._next_step = 0.0  # monotonic time the next paced step may start
        self.num_pages, self.page_size = num_pages, page_size
        self.vocab_size, self.max_context, self.max_running = vocab_size, max_context, max_running
        self.eos_token_ids = eos_token_ids
        self.seqs: dict[str, FakeSeq] = {}
        self.waiting: deque[FakeSeq] = deque()
        self.running: list[FakeSeq] = []
        self.held: dict[str, list[int]] = {}  # finished hold_kv requests and reservations
        self.reserve_calls: list[tuple[str, int, list[int] | None]] = []  # (rid, tokens, pages)
        self.held_log: dict[str, list[int]] = {}  # rid -> pages it held after finishing (hold_kv)
        self.imports: dict[str, bool] = {}  # add_prefilled rid -> its pages held the prompt's KV

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- requests (Engine's API) ----------------------------------------------------------
    def validate(self, req) -> None:
        n = len(req.prompt_ids)
        if n == 0:
            raise BadRequest(f"request {req.rid}: empty prompt")
        total = n + req.sampling.max_new_tokens
        if total > self.max_context:
            raise BadRequest(f"request {req.rid}: prompt ({n} tokens) + max_new_tokens "
                             f"({req.sampling.max_new_tokens}) exceeds the context length {self.max_context}")
        if self.pages_for(total) > self.num_pages:
            raise BadRequest(f"request {req.rid}: needs {total} tokens of KV, more than the pool "
                             f"holds ({self.num_pages * self.page_size})")
        if req.rid in self.seqs or req.rid in self.held:
            raise BadRequest(f"request id {req.rid} is already in use")

    def add(self, req) -> None:
        self.validate(req)
        seq = FakeSeq(req)
        self.seqs[req.rid] = seq
        self.waiting.append(seq)

    def abort(self, rid: str) -> bool:
        seq = self.seqs.pop(rid, None)
        if seq is not None:
            self._remove(seq, free_pages=True)
        return self.release(rid) or seq is not None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def reserve(self, rid: str, num_tokens: int) -> list[int] | None:
        if rid in self.held or rid in self.seqs:
            raise BadRequest(f"request id {rid} is already in use")
        pages = self.allocator.alloc(self.pages_for(num_tokens))
        self.reserve_calls.append((rid, num_tokens, pages))
        if pages is not None:
            self.held[rid] = pages
        return pages

    def cached_prefix_tokens(self, prompt_ids: list[int]) -> int:
        return 0  # no prefix cache

    def reserve_prompt(self, rid: str, prompt_ids: list[int]) -> tuple[list[int], int, str] | None:
        """As Engine.reserve_prompt, with no prefix cache: nothing is ever reused."""
        pages = self.reserve(rid, len(prompt_ids))
        return None if pages is None else (pages, 0, "")

    def release(self, rid: str) -> bool:
        pages = self.held.pop(rid, None)
        if pages is None:
            return False
        self.allocator.free(pages)
        return True

    def add_prefilled(self, req, first_token: int, first_logprob: float | None = None, first_top=None,
                      prompt_logprobs=None, prompt_top=None) -> StepOutput:
        pages = self.held.pop(req.rid)
        n = len(req.prompt_ids)
        self.imports[req.rid] = bool(np.array_equal(
            self.pool.read(pages, n), kv_pattern(req.prompt_ids, 0, self.pool.num_regions,
                                                 self.pool.slots.shape[2:])))
        seq = FakeSeq(req, pages=pages, num_computed=n, sent_input_logprobs=True)  # as Engine: none here
        self.seqs[req.rid] = seq
        self.running.append(seq)
        out = self._emit(seq, first_token, first_logprob)
        if req.return_logprob:  # as Engine: the prefill's alternatives and (echo) prompt logprobs
            out.top_logprobs = first_top
            if prompt_logprobs is not None:
                out.input_logprobs, out.input_top_logprobs = prompt_logprobs, prompt_top
        return out

    def stats(self) -> EngineStats:
        return EngineStats(total_pages=self.num_pages, free_pages=self.allocator.free_count,
                           cached_pages=self.cache.cached_pages, running=len(self.running),
                           waiting=len(self.waiting), held_pages=sum(len(p) for p in self.held.values()),
                           cache=self.cache.counters())

    def flush_cache(self) -> int:
        return self.cache.flush()

    # ---- one step ---------------------------------------------------------------------------
    def _next_token(self, seq: FakeSeq) -> int:
        """The token `seq` samples next (subclasses script their own)."""
        return next_token((seq.output_ids or seq.req.prompt_ids)[-1], self.vocab_size)

    def _pace(self) -> None:
        if self.step_s > 0:
            time.sleep(max(0.0, self._next_step - time.monotonic()))
            self._next_step = time.monotonic() + self.step_s

    def step(self) -> list[StepOutput]:
        self._pace()
        decodes = list(self.running)
        outs = [o for seq in decodes if (o := self._decode(seq)) is not None]
        for seq in list(self.waiting):
            if len(self.running) >= self.max_running:
                break
            prompt = seq.req.prompt_ids
            pages = self.allocator.alloc(self.pages_for(len(prompt)))
            if pages is None:
                break
            seq.pages = pages
            self.pool.write(pages, 0, prompt)
            seq.num_computed = len(prompt)
            self.waiting.remove(seq)
            self.running.append(seq)
            if seq.req.sampling.max_new_tokens == 0:
                outs.append(self._finish(seq, None, None, {"type": "length", "length": 0}))
            else:
                tok = self._next_token(seq)
                outs.append(self._emit(seq, tok, fake_logprob(tok)))
        return outs

    def _decode(self, seq: FakeSeq) -> StepOutput | None:
        """Compute the KV of the last token and sample the next; None while no page is free."""
        need = self.pages_for(seq.num_tokens) - len(seq.pages)
        if need > 0:
            got = self.allocator.alloc(need)
            if got is None:
                return None
            seq.pages.extend(got)
        last = seq.output_ids[-1]
        self.pool.write(seq.pages, seq.num_computed, [last])
        seq.num_computed += 1
        tok = self._next_token(seq)
        return self._emit(seq, tok, fake_logprob(tok))

    def _emit(self, seq: FakeSeq, token: int, logprob: float | None) -> StepOutput:
        seq.output_ids.append(token)
        p = seq.req.sampling
        reason = None
        if token in p.stop_token_ids or (not p.ignore_eos and token in self.eos_token_ids):
            reason = {"type": "stop", "matched": token}
        elif len(seq.output_ids) >= p.max_new_tokens or seq.num_tokens >= self.max_context:
            reason = {"type": "length", "length": len(seq.output_ids)}
        if reason is not None:
            return self._finish(seq, token, logprob, reason)
        return self._output(seq, token, logprob)

    def _output(self, seq: FakeSeq, token: int | None, logprob: float | None, **kw) -> StepOutput:
        out = StepOutput(seq.rid, token, logprob if seq.req.return_logprob else None,
                         prompt_tokens=len(seq.req.prompt_ids), **kw)
        if seq.req.return_logprob and not seq.sent_input_logprobs:
            out.input_logprobs = [None] + [fake_logprob(t) for t in seq.req.prompt_ids[1:]]
            seq.sent_input_logprobs = True
        return out

    def _finish(self, seq: FakeSeq, token: int | None, logprob: float | None, reason: dict) -> StepOutput:
        hold = bool(getattr(seq.req, "hold_kv", False))
        held = list(seq.pages) if hold else None
        self._remove(seq, free_pages=not hold)
        self.seqs.pop(seq.rid, None)
        if hold:
            self.held[seq.rid] = held
            self.held_log[seq.rid] = held
        return self._output(seq, token, logprob, finished=True, finish_reason=reason, held_pages=held)

    def _remove(self, seq: FakeSeq, free_pages: bool) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if free_pages and seq.pages:
            self.allocator.free(seq.pages)
        seq.pages = []

    # ---- for tests --------------------------------------------------------------------------
    def leaks(self) -> list[str]:
        """Why the pool is not back to all pages free and nothing in flight; [] when it is."""
        problems = []
        if self.seqs:
            problems.append(f"requests still in the engine: {sorted(self.seqs)}")
        if self.held:
            problems.append(f"held or reserved pages: {self.held}")
        if self.allocator.free_count != self.num_pages:
            lost = self.num_pages - self.allocator.free_count
            problems.append(f"{lost} of {self.num_pages} pages not free")
        return problems
