"""Decode admission: does a handoff's prompt fit in the KV pool without starving generation?

A handoff is admitted (its pages reserved) only when, after taking the pages for its prompt
(less those reused from the prefix cache), the pool still holds a generation reserve for every
request on the engine and for the new one: per request `min(--num-reserved-decode-tokens,
max_new_tokens still to come)` tokens beyond what it holds (SGLang's rule, capped by the
request's own budget so that short answers do not block admission). Free and cached pages both
count as available: eviction frees cached ones on demand. So a burst of handoffs cannot take
the pages the running batch needs to decode; a handoff that does not fit waits in the decode
machine's admission queue (disagg/decode_rooms.py) instead.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..disagg.decode_events import Reservation


@dataclass(frozen=True)
class GenerationReserve:
    """`tokens` per request (0: none, admission is then "the prompt fits")."""

    tokens: int

    def for_request(self, max_new_tokens: int, generated: int = 0) -> int:
        return max(0, min(self.tokens, max_new_tokens - generated))


class PoolArithmetic:
    """Admission's view of one engine's KV pool (the engine API it uses: seqs, held, allocator,
    cache.cached_pages, cached_prefix_tokens, reserve_prompt, release)."""

    def __init__(self, engine, page_size: int, reserve: GenerationReserve):
        self.engine, self.page_size, self.reserve = engine, page_size, reserve

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.page_size)

    def available(self) -> int:
        """Pages an allocation can get now: free ones and cached ones nobody holds (evictable)."""
        return self.engine.allocator.free_count + self.engine.cache.cached_pages

    def reserve_in_use(self, held: dict[str, tuple[int, int]]) -> int:
        """Pages the requests already on the engine may still take for their reserve: every
        sequence (running or waiting, whose pages fall short of prompt + output + reserve) and
        every reservation held for a handoff (`held`: rid -> (prompt tokens, max_new_tokens))."""
        need = 0
        for seq in self.engine.seqs.values():
            have = len(seq.req.prompt_ids) + len(seq.output_ids)
            extra = self.reserve.for_request(seq.req.sampling.max_new_tokens, len(seq.output_ids))
            need += max(0, self.pages_for(have + extra) - len(seq.pages))
        for rid, pages in self.engine.held.items():
            if rid in held:  # its pages cover its prompt: the reserve comes on top
                prompt, max_new = held[rid]
                need += max(0, self.pages_for(prompt + self.reserve.for_request(max_new)) - len(pages))
        return need

    def admit(self, rid: str, prompt_ids: list[int], max_new_tokens: int,
              held: dict[str, tuple[int, int]]) -> Reservation | None:
        """Reserve `rid`'s prompt pages if they and every generation reserve fit, else None (and
        nothing held). `held`: the handoffs already holding pages, not `rid`."""
        prompt_pages = self.pages_for(len(prompt_ids))
        own = self.pages_for(len(prompt_ids) + self.reserve.for_request(max_new_tokens)) - prompt_pages
        need = own + self.reserve_in_use(held)
        # optimistic (one page more than the cache may give, a reused page held elsewhere costs
        # nothing), so that a handoff far from fitting costs no reservation and no cache lookup
        reused = self.engine.cached_prefix_tokens(prompt_ids) // self.page_size + 1
        if self.available() - max(0, prompt_pages - reused) < need:
            return None
        got = self.engine.reserve_prompt(rid, prompt_ids)
        if got is None:
            return None
        if self.available() < need:  # the exact check, now that its pages are taken
            self.engine.release(rid)
            return None
        return Reservation(*got)
