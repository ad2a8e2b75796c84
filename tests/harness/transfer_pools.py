"""Shared by the transfer-backend tests: host-memory KV pools with a guard area, a pair of
started backends of one kind (a writes into b), and a recv loop with a deadline."""

from __future__ import annotations

import time

import numpy as np

from pdserve.core.kv_layout import KVLayout
from pdserve.transfer import create_backend

GUARD = 4096


class Pool:
    """`regions x pages x page_bytes` bytes plus a guard area that must stay 0."""

    def __init__(self, regions: int, pages: int, page_bytes: int, seed: int | None = None):
        total = regions * pages * page_bytes
        self.arr = np.zeros(total + GUARD, dtype=np.uint8)
        if seed is not None:
            self.arr[:total] = np.random.default_rng(seed).integers(1, 256, total, dtype=np.uint8)
        self.layout = KVLayout(base_ptr=self.arr.ctypes.data, num_regions=regions, num_pages=pages,
                               page_bytes=page_bytes, region_stride=pages * page_bytes, page_size=16,
                               dtype="bfloat16")
        self.pages = self.arr[:total].reshape(regions, pages, page_bytes)
        self.guard = self.arr[total:]


class BackendPair:
    """Backend a (pool a, filled) writes into backend b (pool b, zeros, another stride)."""

    backend = ""  # set by each test module's subclass

    def __init__(self, a: Pool, b: Pool, **opts):
        self.a_pool, self.b_pool = a, b
        self.a = create_backend(self.backend, connect_timeout=5.0, **opts)
        self.b = create_backend(self.backend, connect_timeout=5.0, **opts)
        self.a_ep = self.a.start(a.layout)
        self.b_ep = self.b.start(b.layout)
        self.b_layout = b.layout

    def close(self) -> None:
        self.a.close()
        self.b.close()


def recv_until(backend, count: int, deadline_s: float = 15.0) -> list[tuple[dict, dict]]:
    got: list = []
    end = time.monotonic() + deadline_s
    while len(got) < count and time.monotonic() < end:
        got += backend.recv(0.1)
    return got
