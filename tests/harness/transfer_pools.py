"""Shared by the transfer-backend tests: host-memory KV pools with a guard area, a pair of
started backends of one kind (a writes into b), a recv loop with a deadline, and probes for the
threads a backend leaves behind."""

from __future__ import annotations

import os
import threading
import time

import numpy as np

from pdserve.core.kv_layout import KVLayout
from pdserve.transfer import create_backend
from pdserve.transfer.fake import FakeFabric

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
    """Backend a (pool a, filled) writes into backend b (pool b, zeros, another stride), both of
    kind `backend` (two fakes share one FakeFabric)."""

    def __init__(self, backend: str, a: Pool, b: Pool, **opts):
        self.backend = backend
        self.a_pool, self.b_pool = a, b
        opts = {"fabric": FakeFabric(), **opts} if backend == "fake" else {"connect_timeout": 5.0, **opts}
        self.a = create_backend(backend, **opts)
        self.b = create_backend(backend, **opts)
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


def tcp_threads(*endpoints: dict) -> list[str]:
    """Live threads of these endpoints' tcp channels, named pdserve-tcp-<role>-<port> (tcp's
    own, and the control channel of mooncake and nixl)."""
    ports = {f"-{ep['port']}" for ep in endpoints}
    return [t.name for t in threading.enumerate()
            if t.name.startswith("pdserve-tcp-") and any(t.name.endswith(p) for p in ports)]


def native_threads() -> int:
    """This process's threads as the kernel counts them (the engines' own C++ threads too)."""
    return len(os.listdir("/proc/self/task"))
