"""The paged KV pool: one preallocated buffer, a K and a V region per layer, addressed by page.

Shape [num_layers, 2, num_pages, page_size, num_kv_heads, head_dim]. A token's slot is
`page * page_size + offset`; layer l's K (or V) is a contiguous [num_slots, heads, dim] view,
so attention gathers by slot and a transfer backend writes whole pages by pointer.
"""

from __future__ import annotations

import torch

from ..core.kv_layout import KVLayout
from ..core.pd_vocab import KvDtype


class KVPool:
    def __init__(self, num_layers: int, num_pages: int, page_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str | torch.device = "cpu"):
        self.num_layers = num_layers
        self.num_pages = num_pages
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.buffer = torch.empty(num_layers, 2, num_pages, page_size, num_kv_heads, head_dim,
                                  dtype=dtype, device=device)
        if self.buffer.device.type == "cpu":
            from .huge_pages import advise_huge_pages
            advise_huge_pages(self.buffer)
        self.buffer.zero_()
        slots = num_pages * page_size
        self._k = [self.buffer[i, 0].view(slots, num_kv_heads, head_dim) for i in range(num_layers)]
        self._v = [self.buffer[i, 1].view(slots, num_kv_heads, head_dim) for i in range(num_layers)]

    def k(self, layer: int) -> torch.Tensor:
        return self._k[layer]

    def v(self, layer: int) -> torch.Tensor:
        return self._v[layer]

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v of shape [T, heads, dim] at flat slots [T]."""
        self._k[layer].index_copy_(0, slots, k)
        self._v[layer].index_copy_(0, slots, v)

    def layout(self) -> KVLayout:
        page_bytes = self.page_size * self.num_kv_heads * self.head_dim * self.buffer.element_size()
        return KVLayout(
            base_ptr=self.buffer.data_ptr(),
            num_regions=self.num_layers * 2,
            num_pages=self.num_pages,
            page_bytes=page_bytes,
            region_stride=page_bytes * self.num_pages,
            page_size=self.page_size,
            dtype=KvDtype.parse(str(self.dtype)),
        )

    @staticmethod
    def bytes_per_page(num_layers: int, page_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
        elem = torch.tensor([], dtype=dtype).element_size()
        return num_layers * 2 * page_size * num_kv_heads * head_dim * elem
