"""Where a worker's KV pages live in memory: what a transfer backend needs, nothing more.

A KV pool is `num_regions` equal regions (one K and one V region per layer) laid out back to
back from `base_ptr`; region r holds `num_pages` pages of `page_bytes` bytes each. Page p of
region r starts at `base_ptr + r * region_stride + p * page_bytes`, so a run of contiguous
pages is one contiguous byte range per region.
Every layer's regions have the same shape in every supported family: sliding-window layers
keep all their pages (their window only masks keys), so what else two workers must agree on
(per-layer windows, head dim, RoPE) is in the model fingerprint (hf_config.ModelConfig).
A decode's KVLayout crosses the wire as is, in its KvReq (disagg/wire.py): msgspec decodes it
into this class, checking each field's type and then `__post_init__`'s bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

from .pd_vocab import KvDtype

_COUNTS = ("base_ptr", "num_regions", "num_pages", "page_bytes", "region_stride", "page_size")


@dataclass(frozen=True)
class KVLayout:
    base_ptr: int
    num_regions: int
    num_pages: int
    page_bytes: int
    region_stride: int
    page_size: int  # tokens per page
    dtype: KvDtype  # a dtype name is parsed (KvDtype.parse)

    def __post_init__(self) -> None:
        """Refuse what no pool can be (ValueError naming the field); a dtype name becomes a KvDtype."""
        for name in _COUNTS:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"KV layout {name}={v!r} is not a non-negative integer")
        if self.page_size < 1:
            raise ValueError(f"KV layout page_size={self.page_size} holds no token")
        object.__setattr__(self, "dtype", KvDtype.parse(self.dtype))

    @property
    def total_bytes(self) -> int:
        return self.num_regions * self.region_stride

    def page_offset(self, region: int, page: int) -> int:
        """Byte offset of (region, page) from base_ptr."""
        return region * self.region_stride + page * self.page_bytes


def coalesce(pages: list[int]) -> list[tuple[int, int]]:
    """Group page indices into (first_page, count) runs of consecutive pages, order kept."""
    runs: list[tuple[int, int]] = []
    for p in pages:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs
