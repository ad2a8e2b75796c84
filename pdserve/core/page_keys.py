"""The key of a full KV page: blake2b-128 of the previous page's key and this page's token ids,
so one key stands for every token from position 0 to the page's end. The same in every process:
a decode and a prefill agree on a prefix by comparing the key of its last page."""

from __future__ import annotations

import hashlib
from array import array


def chain_hashes(tokens: list[int], page_size: int, prev: list[bytes]) -> list[bytes]:
    """`prev` (the keys of the first len(prev) pages of `tokens`) extended to every full page."""
    out = list(prev)
    parent = out[-1] if out else b""
    for start in range(len(out) * page_size, len(tokens) - page_size + 1, page_size):
        h = hashlib.blake2b(parent, digest_size=16)
        h.update(array("i", tokens[start:start + page_size]).tobytes())
        parent = h.digest()
        out.append(parent)
    return out


def prefix_key(tokens: list[int], page_size: int, pages: int) -> str:
    """The hex key of the first `pages` full pages of `tokens` ("" for none)."""
    if pages <= 0:
        return ""
    keys = chain_hashes(tokens[:pages * page_size], page_size, [])
    if len(keys) < pages:
        raise ValueError(f"{len(tokens)} tokens hold fewer than {pages} full pages of {page_size}")
    return keys[-1].hex()
