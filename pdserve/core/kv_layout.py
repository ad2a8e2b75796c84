"""Where a worker's KV pages live in memory: what a transfer backend needs, nothing more.

A KV pool is `num_regions` equal regions (one K and one V region per layer) laid out back to
back from `base_ptr`; region r holds `num_pages` pages of `page_bytes` bytes each. Page p of
region r starts at `base_ptr + r * region_stride + p * page_bytes`, so a run of contiguous
pages is one contiguous byte range per region.
Every layer's regions have the same shape in every supported family: sliding-window layers
keep all their pages (their window only masks keys), so what else two workers must agree on
(per-layer windows, head dim, RoPE) is in the model fingerprint (hf_config.ModelConfig).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVLayout:
    base_ptr: int
    num_regions: int
    num_pages: int
    page_bytes: int
    region_stride: int
    page_size: int  # tokens per page
    dtype: str  # e.g. "bfloat16"

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
