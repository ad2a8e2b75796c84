"""Continuous batching: decides which sequences run in the next step and gives them pages.

A step is either a prefill step (waiting sequences, chunked to a token budget) or a decode
step (every running sequence adds one token). Prefill goes first so new prompts join soon;
when a decode step runs out of pages the newest running sequence is preempted (pages freed,
recomputed later from its tokens). A prompt part-way through its prefill holds pages too; when
the head of the queue cannot grow, the partial prefills queued behind it give theirs back, so
the queue never stalls (every request fits the pool alone, see Engine.validate).
"""

from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass

from .allocator import PageAllocator
from .sequence import Sequence, SeqStatus


class StepKind(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


@dataclass
class Batch:
    kind: StepKind
    seqs: list[Sequence]
    new_lens: list[int]


class Scheduler:
    def __init__(self, allocator: PageAllocator, page_size: int, max_running: int,
                 prefill_budget: int):
        self.allocator = allocator
        self.page_size = page_size
        self.max_running = max_running
        self.prefill_budget = prefill_budget
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        need = self.pages_for(num_tokens) - len(seq.pages)
        if need <= 0:
            return True
        got = self.allocator.alloc(need)
        if got is None:
            return False
        seq.pages.extend(got)
        return True

    def schedule(self) -> Batch | None:
        return self._schedule_prefill() or self._schedule_decode()

    def _schedule_prefill(self) -> Batch | None:
        seqs, lens, budget = [], [], self.prefill_budget
        active = len(self.running)
        for seq in self.waiting:
            if budget <= 0 or active + len(seqs) >= self.max_running:
                break
            chunk = min(seq.num_tokens - seq.num_computed, budget)
            grown = self._grow(seq, seq.num_computed + chunk)
            if not grown and not seqs and self._reclaim_behind(seq, seq.num_computed + chunk):
                grown = self._grow(seq, seq.num_computed + chunk)
            if not grown:
                break
            seqs.append(seq)
            lens.append(chunk)
            budget -= chunk
        return Batch(StepKind.PREFILL, seqs, lens) if seqs else None

    def _reclaim_behind(self, head: Sequence, num_tokens: int) -> bool:
        """Free enough pages for `head` to hold num_tokens by taking them from partial prefills
        queued behind it, newest first (they restart their prefill later). True on success."""
        need = self.pages_for(num_tokens) - len(head.pages)
        for seq in reversed(self.waiting):
            if seq is head or self.allocator.free_count >= need:
                break
            if seq.pages:
                self.allocator.free(seq.pages)
                seq.pages = []
                seq.num_computed = 0
        return self.allocator.free_count >= need

    def _schedule_decode(self) -> Batch | None:
        while self.running:
            short = [s for s in self.running if not self._grow(s, s.num_tokens)]
            if not short:
                break
            self.preempt(self.running[-1])
        if not self.running:
            return None
        return Batch(StepKind.DECODE, list(self.running), [1] * len(self.running))

    def after_prefill(self, seq: Sequence, chunk: int) -> bool:
        """Account a prefilled chunk; True when the whole sequence is now in the pool."""
        seq.num_computed += chunk
        if seq.num_computed < seq.num_tokens:
            return False
        self.waiting.remove(seq)
        seq.status = SeqStatus.RUNNING
        self.running.append(seq)
        return True

    def preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.allocator.free(seq.pages)
        seq.pages = []
        seq.num_computed = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)

    def remove(self, seq: Sequence, free_pages: bool = True) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if free_pages:
            self.allocator.free(seq.pages)
            seq.pages = []
        seq.status = SeqStatus.FINISHED
