"""Attention with a sliding window and/or tanh soft-capped scores, over paged KV, any device.

For layers that `paged_attention` cannot give to SDPA or our C kernel: a window shorter than
the step's longest sequence (Mistral, Gemma, Phi-3 past the window) or soft-capped scores
(Gemma 2). Same math and rounding points as HF's eager attention: scores in the model's
dtype, scaled, capped, masked, softmax in float32, rounded back, times V. A query at
position p sees keys k with p - window < k <= p (HF's sliding-window mask).
The K/V of the new tokens are already in the pool when this runs.
"""

from __future__ import annotations

import torch

from .attention import AttnBatch, AttnParams, AttnShape
from .kv_pool import KVPool


def windowed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int,
                       batch: AttnBatch, pool: KVPool, params: AttnParams) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] of the new tokens -> [T, Hq*D]."""
    if batch.shape is AttnShape.DECODE:
        B, L = batch.gather_slots.shape
        key = ("decode", params.window)
        if key not in batch.masks:
            seq = torch.tensor(batch.seq_lens).view(B, 1)
            batch.masks[key] = _mask(seq - 1, torch.arange(L).view(1, L), seq, params.window,
                                     q.device).view(B, 1, 1, L)
        kk, vv = _gather(pool, layer, batch.gather_slots.reshape(-1), q.dtype)
        Hkv, D = kk.shape[1], kk.shape[2]
        kk = kk.view(B, L, Hkv, D).transpose(1, 2)
        vv = vv.view(B, L, Hkv, D).transpose(1, 2)
        out = _eager(q.view(B, Hkv, -1, 1, D), kk.unsqueeze(2), vv.unsqueeze(2),
                     batch.masks[key].unsqueeze(2), params)
        return out.reshape(B, -1)
    outs = []
    for i, span in enumerate(batch.spans):
        rows = slice(span.start, span.start + span.new)
        n = batch.seq_lens[i]
        key = ("span", i, params.window)
        if key not in batch.masks:
            qpos = torch.arange(n - span.new, n).view(-1, 1)
            batch.masks[key] = _mask(qpos, torch.arange(n).view(1, n), None, params.window, q.device)
        if span.slots is None:
            kk, vv = k[rows].to(q.dtype), v[rows].to(q.dtype)
        else:
            kk, vv = _gather(pool, layer, span.slots, q.dtype)
        Hkv, D = kk.shape[1], kk.shape[2]
        qq = q[rows].view(span.new, Hkv, -1, D).permute(1, 2, 0, 3)  # [Hkv, G, new, D]
        out = _eager(qq, kk.transpose(0, 1).unsqueeze(1), vv.transpose(0, 1).unsqueeze(1),
                     batch.masks[key], params)  # [Hkv, G, new, D]
        outs.append(out.permute(2, 0, 1, 3).reshape(span.new, -1))
    return torch.cat(outs)


def _mask(qpos: torch.Tensor, kpos: torch.Tensor, seq: torch.Tensor | None, window: int | None,
          device) -> torch.Tensor:
    """True where a query (at qpos) may read a key (at kpos): causal, inside the sequence,
    inside the window."""
    ok = kpos <= qpos
    if seq is not None:
        ok = ok & (kpos < seq)
    if window is not None:
        ok = ok & (kpos > qpos - window)
    return ok.to(device)


def _gather(pool: KVPool, layer: int, slots: torch.Tensor, dtype: torch.dtype):
    return (pool.k(layer).index_select(0, slots).to(dtype),
            pool.v(layer).index_select(0, slots).to(dtype))


def _eager(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
           params: AttnParams) -> torch.Tensor:
    """q [..., Tq, D], k/v [..., L, D] (broadcast over the query heads of a KV head),
    mask [Tq, L] or broadcastable -> [..., Tq, D]."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * params.scale
    if params.softcap is not None:
        scores = torch.tanh(scores / params.softcap) * params.softcap
    scores = scores.float().masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, v)
