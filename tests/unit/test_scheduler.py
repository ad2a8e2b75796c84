"""The scheduler alone, stepped with fake model outputs (no model, no processes): each step
decodes every running sequence and fills what the token budget leaves with prompt chunks."""

from __future__ import annotations

import pytest

from pdserve.core.sampling import SamplingParams
from pdserve.engine.allocator import PageAllocator
from pdserve.engine.prefix_cache import PrefixCache
from pdserve.engine.scheduler import Scheduler, StepKind
from pdserve.engine.sequence import EngineRequest, Sequence

PAGE = 4


def make(num_pages: int = 1024, budget: int = 64, max_batched: int = 0, max_running: int = 16,
         cache: bool = False) -> Scheduler:
    return Scheduler(PrefixCache(PageAllocator(num_pages), PAGE, cache), PAGE, max_running, budget,
                     max_batched)


def seq(rid: str, n_prompt: int, n_out: int = 50, base: int = 0) -> Sequence:
    return Sequence(EngineRequest(rid, [base + i % 97 for i in range(n_prompt)],
                                  SamplingParams(max_new_tokens=n_out, temperature=0.0)))


def step(s: Scheduler) -> tuple | None:
    """One scheduled step with a fake forward: what the engine does with its results."""
    b = s.schedule()
    if b is None:
        return None
    for i, (q, n) in enumerate(zip(b.seqs, b.new_lens)):
        assert len(q.pages) * PAGE >= q.num_computed + n  # every new token has a slot
        if i < b.num_decode:
            q.num_computed += 1
            s.offer_full_pages(q)
            q.output_ids.append(5)
        elif s.after_prefill(q, n):
            q.output_ids.append(5)
    for q in list(s.running):  # finish at max_new_tokens
        if len(q.output_ids) >= q.req.sampling.max_new_tokens:
            s.remove(q)
    return b


def test_a_long_prompt_never_stalls_running_decodes():
    s = make(budget=64, max_batched=80)
    decoders = [seq(f"d{i}", 10, n_out=200) for i in range(3)]
    s.waiting.extend(decoders)
    step(s)  # all three prefill in one step (30 tokens)
    assert all(d in s.running for d in decoders)
    long = seq("long", 1000)
    s.waiting.append(long)
    steps = 0
    while long not in s.running:
        left = 1000 - long.num_computed
        b = step(s)
        steps += 1
        assert b.kind is StepKind.MIXED
        assert b.seqs[:3] == decoders and b.new_lens[:3] == [1, 1, 1]  # decodes every step
        assert sum(b.new_lens) <= 80 and b.new_lens[3] == min(64, left)  # min(64, 80 - 3)
    assert steps == -(-1000 // 64)
    assert all(len(d.output_ids) == 1 + steps for d in decoders)


def test_the_token_budget_caps_prefill_when_decodes_use_it():
    s = make(budget=512, max_batched=40, max_running=32)
    s.waiting.extend(seq(f"d{i}", 3, n_out=100) for i in range(30))
    while len(s.running) < 30:  # 90 prompt tokens at most 40 a step, decodes included
        b = step(s)
        assert sum(b.new_lens) <= 40
    s.waiting.append(seq("p", 100))
    b = step(s)
    assert b.num_decode == 30 and b.new_lens[30:] == [10]  # 40 - 30 decodes


def test_without_running_decodes_a_step_is_pure_prefill_and_prompts_go_in_order():
    s = make(budget=64)
    a, b_ = seq("a", 100), seq("b", 40)
    s.waiting.extend([a, b_])
    b = step(s)
    assert b.kind is StepKind.PREFILL and b.seqs == [a] and b.new_lens == [64]
    b = step(s)  # a's last 36 tokens and b's first 28 share the budget
    assert b.seqs == [a, b_] and b.new_lens == [36, 28]
    b = step(s)
    assert b.kind is StepKind.MIXED and b.seqs == [a, b_] and b.new_lens == [1, 12]
    b = step(s)
    assert b.kind is StepKind.DECODE and b.seqs == [a, b_]


def test_decodes_get_their_pages_before_prompts_and_preempt_the_newest():
    s = make(num_pages=12, budget=64)
    x, y = seq("x", 16, n_out=30), seq("y", 16, n_out=30)
    s.waiting.extend([x, y])
    step(s)  # 8 pages for the two prompts
    step(s)  # each decodes its first position past the prompt: 10 pages
    s.waiting.append(seq("z", 20, n_out=4))
    b = step(s)  # z needs 6 pages, 2 are free: it waits; the decodes run
    assert b.kind is StepKind.DECODE
    for _ in range(8):
        step(s)
    # growing past 12 pages preempts y (the newest running): x keeps decoding
    assert x in s.running and y not in s.running
    while s.running or s.waiting:
        step(s)
    assert s.cache.available == 12


def test_max_batched_tokens_must_leave_prompts_room():
    with pytest.raises(ValueError, match="must exceed max_running"):
        make(max_batched=16, max_running=16)
