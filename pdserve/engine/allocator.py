"""Page allocator: a free list over the KV pool's pages. All-or-nothing allocation."""

from __future__ import annotations


class PageAllocator:
    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # pop() hands out low pages first
        self._used = bytearray(num_pages)

    @property
    def free_count(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """n pages, or None (and nothing taken) when fewer than n are free."""
        if n > len(self._free):
            return None
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._used[p] = 1
        return pages

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if not self._used[p]:
                raise RuntimeError(f"double free of KV page {p}")
            self._used[p] = 0
        self._free.extend(reversed(pages))
