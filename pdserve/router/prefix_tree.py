"""An approximate, multi-tenant radix tree of what each upstream has been sent, for cache_aware.

The router cannot see a server's prefix cache; it remembers instead which keys it sent where. One
`PrefixTree` overlays one radix tree per tenant (a tenant is one upstream, or one (upstream, DP
rank) with --dp-aware): a node lists the tenants that were sent its path and when each last was.

A key is a sequence: a `str` (matched per character, as sglang-router does) or a tuple of token
ids. A tree holds one kind only; the caller keeps one tree per key space so text never matches ids.

API (all O(key length) but eviction and removal, which walk the tree):
- `insert(key, tenant)`: record that `tenant` was sent `key` (its path becomes the most recent).
- `longest_match(key, tenants=None) -> (tenant | None, matched)`: the tenant (among `tenants` when
  given) whose sent keys share the longest prefix with `key`, and that prefix's length; ties go to
  the tenant that used the deepest matched node most recently. Reads only: no access time changes.
- `size(tenant)`: how many key elements the tenant's own tree holds (its nodes' label lengths).
- `evict(max_size, tenant=None)`: drop least recently used leaves of each tenant over `max_size`
  (or of `tenant` only) until it fits; returns the number of elements dropped.
- `remove_tenant(tenant)`: forget a tenant entirely.

Invariant: a tenant on a node is on every ancestor of it (insert marks the whole path; eviction
takes a tenant off leaves of its own tree first; splits copy the tenant set), so a tenant's part
of the tree is itself a tree and its size is the sum of its nodes' label lengths. Access times are
a logical clock (one tick per insert), which makes LRU order exact and deterministic.
Not thread-safe: the router uses it from its event loop only.
"""

from __future__ import annotations

import heapq
import itertools
from typing import Hashable, Iterable, Sequence

Tenant = Hashable


class _Node:
    __slots__ = ("label", "children", "tenants", "parent")

    def __init__(self, label: Sequence, parent: "_Node | None"):
        self.label = label
        self.children: dict = {}  # first element of the child's label -> child
        self.tenants: dict = {}  # tenant -> logical time of its last insert through this node
        self.parent = parent


def _shared_len(label: Sequence, key: Sequence, start: int) -> int:
    """Length of the common prefix of `label` and `key[start:]`, given their first elements match."""
    seg = key[start:start + len(label)]
    if seg == label:
        return len(label)
    hi = min(len(seg), len(label))
    if seg[:hi] == label[:hi]:
        return hi  # the key ends inside the label
    lo = 1  # seg[:lo] matches, seg[:hi] does not: bisect with C-speed slice compares
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if seg[:mid] == label[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class PrefixTree:
    def __init__(self) -> None:
        self._root = _Node((), None)
        self._sizes: dict = {}
        self._clock = itertools.count(1)

    # ---- queries ---------------------------------------------------------------------------
    def size(self, tenant: Tenant) -> int:
        return self._sizes.get(tenant, 0)

    def sizes(self) -> dict:
        """tenant -> size, for every tenant the tree knows."""
        return dict(self._sizes)

    def tenants(self) -> list:
        return list(self._sizes)

    def __contains__(self, tenant: Tenant) -> bool:
        return tenant in self._sizes

    def longest_match(self, key: Sequence, tenants: Iterable[Tenant] | None = None) -> tuple[Tenant | None, int]:
        allowed = None if tenants is None else (tenants if isinstance(tenants, (set, frozenset)) else set(tenants))
        node, i, n = self._root, 0, len(key)
        best: _Node | None = None
        holders: Iterable = ()
        while i < n:
            child = node.children.get(key[i])
            if child is None:
                break
            here = child.tenants.keys() if allowed is None else child.tenants.keys() & allowed
            if not here:
                break
            m = _shared_len(child.label, key, i)
            i, best, holders = i + m, child, here
            if m < len(child.label):
                break
            node = child
        if best is None:
            return None, 0
        stamps = best.tenants
        return max(holders, key=stamps.__getitem__), i

    # ---- updates ---------------------------------------------------------------------------
    def insert(self, key: Sequence, tenant: Tenant) -> None:
        tick = next(self._clock)
        sizes = self._sizes
        sizes.setdefault(tenant, 0)
        node, i, n = self._root, 0, len(key)
        while i < n:
            first = key[i]
            child = node.children.get(first)
            if child is None:
                leaf = _Node(key[i:], node)
                leaf.tenants[tenant] = tick
                node.children[first] = leaf
                sizes[tenant] += n - i
                return
            label = child.label
            m = _shared_len(label, key, i)
            if m < len(label):  # split: node -> mid (shared part) -> child (the rest)
                mid = _Node(label[:m], node)
                mid.tenants = dict(child.tenants)
                child.label = label[m:]
                child.parent = mid
                mid.children[child.label[0]] = child
                node.children[first] = mid
                child = mid
            if tenant not in child.tenants:
                sizes[tenant] += len(child.label)
            child.tenants[tenant] = tick
            node, i = child, i + m

    def evict(self, max_size: int, tenant: Tenant | None = None) -> int:
        over = {t for t, s in self._sizes.items() if s > max_size and (tenant is None or t == tenant)}
        if not over:
            return 0
        heap: list = []
        order = itertools.count()  # ties (one insert's path shares a tick) never compare nodes
        for node in self._walk():
            for t in node.tenants.keys() & over:
                if self._is_leaf_of(node, t):
                    heap.append((node.tenants[t], next(order), t, node))
        heapq.heapify(heap)
        dropped = 0
        while heap:
            _, _, t, node = heapq.heappop(heap)
            if self._sizes[t] <= max_size or t not in node.tenants:
                continue
            del node.tenants[t]
            self._sizes[t] -= len(node.label)
            dropped += len(node.label)
            parent = node.parent
            if not node.tenants and not node.children:
                del parent.children[node.label[0]]
            if parent is not self._root and t in parent.tenants and self._is_leaf_of(parent, t):
                heapq.heappush(heap, (parent.tenants[t], next(order), t, parent))
        return dropped

    def remove_tenant(self, tenant: Tenant) -> None:
        if self._sizes.pop(tenant, None) is None:
            return
        for node in reversed(list(self._walk())):  # children before their parents
            if node.tenants.pop(tenant, None) is not None and not node.tenants and not node.children:
                del node.parent.children[node.label[0]]

    def clear(self) -> None:
        self.__init__()

    # ---- helpers ---------------------------------------------------------------------------
    @staticmethod
    def _is_leaf_of(node: _Node, tenant: Tenant) -> bool:
        return not any(tenant in c.tenants for c in node.children.values())

    def _walk(self):
        """Every node but the root, parents before children."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def node_count(self) -> int:
        return sum(1 for _ in self._walk())
