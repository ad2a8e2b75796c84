"""Paged attention for a mixed batch of sequences, on any torch device.

The runner builds one `AttnBatch` per step and every layer reuses it: new tokens' K/V are
written to their slots, then each sequence's whole K/V (cached prefix + new) is gathered by
slot into a padded [B, L] layout and attended with a causal mask through SDPA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kv_pool import KVPool


@dataclass
class AttnBatch:
    write_slots: torch.Tensor  # [T] slot of each new token, in flat token order
    gather_slots: torch.Tensor  # [B, L] slots of each sequence's full KV, padded with 0
    q_index: torch.Tensor  # [B, Tq] flat token index of each padded query position (pad -> 0)
    q_unpad: torch.Tensor  # [T] position of each flat token in the flattened [B*Tq] layout
    mask: torch.Tensor | None  # [B, 1, Tq, L] bool, True = attend; None when every row sees all
    # (single-token decode with equal lengths)

    @staticmethod
    def build(seq_lens: list[int], new_lens: list[int], page_rows: list[list[int]],
              page_size: int, device: torch.device | str = "cpu") -> "AttnBatch":
        """seq_lens[i]: KV length of sequence i after this step; new_lens[i]: tokens it adds
        this step (the last new_lens[i] of its seq_lens[i]); page_rows[i]: its pages in order."""
        B = len(seq_lens)
        L = max(seq_lens)
        Tq = max(new_lens)
        max_pages = max(len(r) for r in page_rows)
        table = torch.tensor([r + [0] * (max_pages - len(r)) for r in page_rows], dtype=torch.long)
        slots = (table.unsqueeze(-1) * page_size + torch.arange(page_size)).view(B, -1)[:, :L]
        seq = torch.tensor(seq_lens, dtype=torch.long)
        new = torch.tensor(new_lens, dtype=torch.long)
        if Tq == 1 and int(new.min()) == 1:
            # pure decode: one query per sequence, written at position seq_len - 1
            write = slots.gather(1, (seq - 1).view(B, 1)).view(B)
            q_index = torch.arange(B).view(B, 1)
            q_unpad = torch.arange(B)
        else:
            j = torch.arange(Tq).view(1, Tq)
            valid = j < new.view(B, 1)
            pos = (seq - new).view(B, 1) + j
            write = slots.gather(1, pos.clamp(max=L - 1))[valid]
            starts = torch.cumsum(new, 0) - new
            q_index = torch.where(valid, starts.view(B, 1) + j, 0)
            q_unpad = (torch.arange(B).view(B, 1) * Tq + j)[valid]
        mask = None
        if not (Tq == 1 and int(seq.min()) == L):
            qpos = (seq - new).view(B, 1, 1) + torch.arange(Tq).view(1, Tq, 1)
            kpos = torch.arange(L).view(1, 1, L)
            mask = ((kpos <= qpos) & (kpos < seq.view(B, 1, 1))).unsqueeze(1).to(device)
        return AttnBatch(
            write_slots=write.to(device),
            gather_slots=slots.contiguous().to(device),
            q_index=q_index.to(device),
            q_unpad=q_unpad.to(device),
            mask=mask,
        )


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                    batch: AttnBatch, pool: KVPool) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] for the new tokens -> attention output [T, Hq*D]."""
    T, Hq, D = q.shape
    pool.write(layer, batch.write_slots, k.to(pool.dtype), v.to(pool.dtype))
    B, L = batch.gather_slots.shape
    Tq = batch.q_index.shape[1]
    flat = batch.gather_slots.reshape(-1)
    kk = pool.k(layer).index_select(0, flat).view(B, L, -1, D).transpose(1, 2)
    vv = pool.v(layer).index_select(0, flat).view(B, L, -1, D).transpose(1, 2)
    qq = q.index_select(0, batch.q_index.reshape(-1)).view(B, Tq, Hq, D).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        qq, kk.to(q.dtype), vv.to(q.dtype), attn_mask=batch.mask,
        enable_gqa=kk.shape[1] != Hq)
    out = out.transpose(1, 2).reshape(B * Tq, Hq * D)
    return out.index_select(0, batch.q_unpad)
