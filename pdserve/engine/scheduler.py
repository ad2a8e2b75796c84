"""Continuous batching: decides which sequences run in the next step and gives them pages.

Every step is one forward pass over a mixed batch, as vLLM does: first every running sequence's
next token (decode), then prefill chunks of waiting prompts in arrival order, up to
min(prefill_budget, max_batched_tokens - decodes) prompt tokens (SGLang's
--chunked-prefill-size, vLLM's --max-num-batched-tokens). So a long new prompt neither stalls
running decodes (they advance every step, by one step's time) nor, being chunked, holds up the
prompts behind it for more than its turn in the queue. When a decode runs out of pages the
newest running sequence is preempted (pages freed, recomputed later from its tokens). A prompt
part-way through its prefill holds pages too; when the head of the queue cannot grow, the
partial prefills queued behind it give theirs back, so the queue never stalls (every request
fits the pool alone, see Engine.validate).

Pages come from the prefix cache (prefix_cache.py): a sequence scheduled for the first time
(or again after losing its pages) starts from its longest cached prefix of full pages, at
least one token short of its end so the step still yields logits; each full page it computes
is offered to the cache. Cached pages nobody references count as free: allocation evicts them.
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from .prefix_cache import PrefixCache, chain_hashes
from .sequence import SeqStatus, Sequence


class StepKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"


@dataclass
class Batch:
    """seqs[:num_decode] decode one token each; the rest prefill new_lens[i] prompt tokens."""

    seqs: list[Sequence]
    new_lens: list[int]
    num_decode: int

    @property
    def kind(self) -> StepKind:
        if self.num_decode == len(self.seqs):
            return StepKind.DECODE
        return StepKind.PREFILL if self.num_decode == 0 else StepKind.MIXED


class Scheduler:
    def __init__(self, cache: PrefixCache, page_size: int, max_running: int,
                 prefill_budget: int, max_batched_tokens: int = 0):
        if max_batched_tokens and max_batched_tokens <= max_running:
            raise ValueError(f"max_batched_tokens ({max_batched_tokens}) must exceed max_running "
                             f"({max_running}): a step full of decodes would leave prefills none")
        self.cache = cache
        self.page_size = page_size
        self.max_running = max_running
        self.prefill_budget = prefill_budget
        self.max_batched_tokens = max_batched_tokens  # 0: no cap beyond prefill_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = self.pages_for(num_tokens) - len(seq.pages)
        if need <= 0:
            return True
        got = self.cache.alloc(need)
        if got is None:
            return False
        seq.pages.extend(got)
        return True

    def schedule(self) -> Batch | None:
        decodes = self._schedule_decode()
        budget = self.prefill_budget
        if self.max_batched_tokens:
            budget = min(budget, self.max_batched_tokens - len(decodes))
        seqs, lens = self._schedule_prefill(budget)
        if not decodes and not seqs:
            return None
        return Batch(decodes + seqs, [1] * len(decodes) + lens, len(decodes))

    def _schedule_prefill(self, budget: int) -> tuple[list[Sequence], list[int]]:
        seqs, lens = [], []
        active = len(self.running)
        for seq in self.waiting:
            if budget <= 0 or active + len(seqs) >= self.max_running:
                break
            if not seq.pages:
                self._attach_prefix(seq)
            chunk = min(seq.num_tokens - seq.num_computed, budget)
            grown = self._grow(seq, seq.num_computed + chunk)
            if not grown and not seqs and self._reclaim_behind(seq, seq.num_computed + chunk):
                grown = self._grow(seq, seq.num_computed + chunk)
            if not grown:
                break
            seqs.append(seq)
            lens.append(chunk)
            budget -= chunk
        return seqs, lens

    def _attach_prefix(self, seq: Sequence) -> None:
        """Start a page-less sequence from its longest cached prefix (none when it wants
        logprobs of its prompt: those need every position computed)."""
        seq.num_computed = 0
        if not self.cache.enabled or seq.req.wants_prompt_logprobs:
            if seq.cached_tokens is None:
                seq.cached_tokens = 0
            return
        usable = (seq.num_tokens - 1) // self.page_size  # keep >= 1 token to compute
        if len(seq.page_keys) < usable:
            seq.page_keys = chain_hashes(seq.tokens(0, usable * self.page_size), self.page_size,
                                         seq.page_keys)
        seq.pages = self.cache.match(seq.page_keys[:usable])
        seq.num_computed = len(seq.pages) * self.page_size
        seq.offered = len(seq.pages)
        if seq.cached_tokens is None:
            seq.cached_tokens = min(seq.num_computed, len(seq.req.prompt_ids))
            self.cache.count_lookup(len(seq.req.prompt_ids), seq.cached_tokens)

    def offer_full_pages(self, seq: Sequence) -> None:
        """Offer the cache every full page of `seq` computed since the last offer."""
        full = seq.num_computed // self.page_size
        if full <= seq.offered or not self.cache.enabled:
            return
        if len(seq.page_keys) < full:
            seq.page_keys = chain_hashes(seq.tokens(0, full * self.page_size), self.page_size,
                                         seq.page_keys)
        for i in range(seq.offered, full):
            self.cache.insert(seq.pages[i], seq.page_keys[i])
        seq.offered = full

    def _drop_pages(self, seq: Sequence) -> None:
        self.cache.release(seq.pages)
        seq.pages = []
        seq.num_computed = seq.offered = 0

    def _reclaim_behind(self, head: Sequence, num_tokens: int) -> bool:
        """Free enough pages for `head` to hold num_tokens by taking them from partial prefills
        queued behind it, newest first (they restart their prefill later). True on success."""
        need = self.pages_for(num_tokens) - len(head.pages)
        for seq in reversed(self.waiting):
            if seq is head or self.cache.available >= need:
                break
            if seq.pages:
                self._drop_pages(seq)
        return self.cache.available >= need

    def _schedule_decode(self) -> list[Sequence]:
        """Every running sequence, each with a page for its next token (preempting the newest
        while pages are short)."""
        while self.running:
            short = [s for s in self.running if not self._grow(s, s.num_tokens)]
            if not short:
                break
            self.preempt(self.running[-1])
        return list(self.running)

    def after_prefill(self, seq: Sequence, chunk: int) -> bool:
        """Account a prefilled chunk; True when the whole sequence is now in the pool."""
        seq.num_computed += chunk
        self.offer_full_pages(seq)
        if seq.num_computed < seq.num_tokens:
            return False
        self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return True

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._drop_pages(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def remove(self, seq: Sequence, free_pages: bool = True) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if free_pages:
            self.cache.release(seq.pages)
            seq.pages = []
        seq.status = SeqStatus.FINISHED
