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
    def build(seq_lens: list[int], new_lens: list[int], slot_rows: list[list[int]],
              device: torch.device | str = "cpu") -> "AttnBatch":
        """seq_lens[i]: KV length after this step; new_lens[i]: tokens added this step;
        slot_rows[i]: the slots of all seq_lens[i] tokens of sequence i."""
        B = len(seq_lens)
        L = max(seq_lens)
        Tq = max(new_lens)
        gather = torch.zeros(B, L, dtype=torch.long)
        q_index = torch.zeros(B, Tq, dtype=torch.long)
        write: list[int] = []
        unpad: list[int] = []
        t = 0
        for i, (sl, nl, slots) in enumerate(zip(seq_lens, new_lens, slot_rows)):
            gather[i, :sl] = torch.tensor(slots, dtype=torch.long)
            q_index[i, :nl] = torch.arange(t, t + nl)
            write.extend(slots[sl - nl:sl])
            unpad.extend(range(i * Tq, i * Tq + nl))
            t += nl
        mask = None
        if not (Tq == 1 and all(s == L for s in seq_lens)):
            # query j of sequence i sits at KV position (seq_len - new_len + j)
            seq = torch.tensor(seq_lens).view(B, 1, 1)
            new = torch.tensor(new_lens).view(B, 1, 1)
            qpos = seq - new + torch.arange(Tq).view(1, Tq, 1)
            kpos = torch.arange(L).view(1, 1, L)
            mask = ((kpos <= qpos) & (kpos < seq)).unsqueeze(1)
            mask = mask.to(device)
        return AttnBatch(
            write_slots=torch.tensor(write, dtype=torch.long).to(device),
            gather_slots=gather.to(device),
            q_index=q_index.to(device),
            q_unpad=torch.tensor(unpad, dtype=torch.long).to(device),
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
