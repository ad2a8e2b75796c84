"""The prefix cache: every KV page's reference count, and the full pages a later request may reuse.

A full page is keyed by a chained hash: blake2b-128 of the previous page's key and this page's
token ids, so a key stands for every token from position 0 to the page's end (and is the same
in every process, which lets a decode and a prefill agree on a prefix). A page is in exactly
one of three places: the allocator's free list (refcount 0, no key), referenced by one or more
sequences or holds (refcount >= 1, with or without a key), or the LRU of cached pages nobody
references (refcount 0, keyed). Allocation takes free pages first and then evicts from the
LRU's old end, so a request never waits for pages eviction could free. Only full pages are
keyed and a sequence only writes past its last full page, so shared pages are never written.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from ..core.page_keys import chain_hashes
from .allocator import PageAllocator

__all__ = ["CacheCounters", "PrefixCache", "chain_hashes"]


@dataclass(frozen=True)
class CacheCounters:
    """Cumulative since start: tokens looked up, tokens found, pages evicted."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    evicted_pages: int = 0


class PrefixCache:
    def __init__(self, allocator: PageAllocator, page_size: int, enabled: bool = True):
        self.allocator = allocator
        self.page_size = page_size
        self.enabled = enabled
        self._refs = [0] * allocator.num_pages
        self._key_of: dict[int, bytes] = {}  # page -> its key, for keyed pages
        self._page_of: dict[bytes, int] = {}  # key -> page
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced keyed pages, oldest first
        self.queried_tokens = self.hit_tokens = self.evicted_pages = 0

    # ---- counts --------------------------------------------------------------------------
    @property
    def available(self) -> int:
        """Pages alloc() can hand out now: free ones plus evictable cached ones."""
        return self.allocator.free_count + len(self._lru)

    @property
    def cached_pages(self) -> int:
        """Pages held only by the cache (free + cached == total when nothing runs)."""
        return len(self._lru)

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def counters(self) -> CacheCounters:
        return CacheCounters(self.queried_tokens, self.hit_tokens, self.evicted_pages)

    # ---- lookup ----------------------------------------------------------------------------
    def match(self, keys: list[bytes]) -> list[int]:
        """The pages of the longest cached run of `keys` from the first, each referenced once more."""
        if not self.enabled:
            return []
        pages = []
        for key in keys:
            page = self._page_of.get(key)
            if page is None:
                break
            pages.append(page)
        for page in pages:
            self._ref(page)
        return pages

    def peek(self, keys: list[bytes]) -> int:
        """How many of `keys`, from the first, are cached (nothing is referenced)."""
        n = 0
        while self.enabled and n < len(keys) and keys[n] in self._page_of:
            n += 1
        return n

    def count_lookup(self, queried: int, hit: int) -> None:
        self.queried_tokens += queried
        self.hit_tokens += hit

    def insert(self, page: int, key: bytes) -> None:
        """Offer a referenced full page under `key`. A key already cached keeps its page (the
        new copy stays private and is freed on release); a page never takes a second key."""
        if not self.enabled or key in self._page_of or page in self._key_of:
            return
        if self._refs[page] < 1:
            raise RuntimeError(f"KV page {page} offered to the prefix cache while unreferenced")
        self._page_of[key] = page
        self._key_of[page] = key

    # ---- pages -----------------------------------------------------------------------------
    def alloc(self, n: int) -> list[int] | None:
        """n fresh pages (refcount 1), evicting cached pages as needed; None, and nothing taken
        or evicted, when fewer than n are available."""
        if n > self.available:
            return None
        while self.allocator.free_count < n:
            self._evict_oldest()
        pages = self.allocator.alloc(n)
        for page in pages:
            self._refs[page] = 1
        return pages

    def release(self, pages: list[int]) -> None:
        """Drop one reference to each page; a page nobody references is cached if keyed, else
        freed. The last page is released first so a sequence's deepest pages are evicted first."""
        to_free = []
        for page in reversed(pages):
            refs = self._refs[page] - 1
            if refs < 0:
                raise RuntimeError(f"KV page {page} released more often than referenced")
            self._refs[page] = refs
            if refs:
                continue
            if page in self._key_of:
                self._lru[page] = None
            else:
                to_free.append(page)
        if to_free:
            self.allocator.free(to_free)

    def flush(self) -> int:
        """Forget every cached prefix: unreferenced cached pages are freed now, referenced ones
        lose their key (their holders keep them; they are freed, not cached, on release).
        -> pages freed now."""
        freed = list(self._lru)
        self._lru.clear()
        self._key_of.clear()
        self._page_of.clear()
        if freed:
            self.allocator.free(freed)
        return len(freed)

    def _ref(self, page: int) -> None:
        if self._refs[page] == 0:
            del self._lru[page]
        self._refs[page] += 1

    def _evict_oldest(self) -> None:
        page, _ = self._lru.popitem(last=False)
        del self._page_of[self._key_of.pop(page)]
        self.evicted_pages += 1
        self.allocator.free([page])
