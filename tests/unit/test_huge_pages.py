"""engine/huge_pages.py: the KV pool asks for 2 MiB pages (attention reads it at scattered
pages) and still starts zeroed; small or non-CPU tensors are left alone."""

from __future__ import annotations

import sys

import pytest
import torch

from pdserve.engine.huge_pages import advise_huge_pages
from pdserve.engine.kv_pool import KVPool


def _thp_mode() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "none"


def test_small_tensors_are_left_alone():
    assert not advise_huge_pages(torch.empty(1024))


@pytest.mark.skipif(not sys.platform.startswith("linux") or _thp_mode() == "none",
                    reason="no transparent huge pages here")
def test_large_tensor_is_advised():
    assert advise_huge_pages(torch.empty(8 << 20, dtype=torch.uint8))


@pytest.mark.skipif(_thp_mode() != "madvise", reason="THP is not in madvise mode here")
def test_kv_pool_memory_is_huge_and_zeroed():
    pool = KVPool(4, 2048, 16, 4, 64, torch.bfloat16)  # 64 MiB
    assert pool.buffer.count_nonzero() == 0

    def anon_huge_kb() -> int:
        with open("/proc/self/smaps_rollup") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("AnonHugePages"))
    # the pool's own 2 MiB pages (the kernel may refuse some when memory is fragmented)
    assert anon_huge_kb() >= 16 << 10
