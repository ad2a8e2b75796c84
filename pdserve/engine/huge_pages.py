"""Ask Linux to back a large CPU tensor with 2 MiB pages (madvise MADV_HUGEPAGE).

Attention reads the KV pool at scattered pages; with 4 KiB pages nearly every KV page read
is a TLB miss. Where transparent huge pages are in "madvise" mode (a common default) nothing
is huge unless asked. Call before the memory is first touched. A no-op where unsupported.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

import torch

MADV_HUGEPAGE = 14
PAGE = 4096


def advise_huge_pages(t: torch.Tensor) -> bool:
    """True if the kernel accepted the advice for t's memory (CPU tensors on Linux)."""
    if not sys.platform.startswith("linux") or t.device.type != "cpu":
        return False
    nbytes = t.untyped_storage().nbytes()
    start = t.untyped_storage().data_ptr()
    first = -(-start // PAGE) * PAGE
    length = (start + nbytes - first) // PAGE * PAGE
    if length < (2 << 20):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return libc.madvise(first, length, MADV_HUGEPAGE) == 0
