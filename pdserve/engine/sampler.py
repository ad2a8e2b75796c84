"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds."""

from __future__ import annotations

import torch

from ..core.sampling import SamplingParams


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits [B, V] (any float dtype; greedy rows are not converted) -> token ids [B] (long, CPU)."""
    if all(p.greedy for p in params):
        # max(dim).indices: the first maximum, as argmax, but vectorized for bfloat16 (~5x faster)
        return logits.max(dim=-1).indices.cpu()
    out = torch.empty(len(params), dtype=torch.long)
    for i, (p, g) in enumerate(zip(params, generators)):
        row = logits[i]
        if p.greedy:
            out[i] = int(row.argmax())
            continue
        out[i] = _sample_row(row, p, g)
    return out


def _sample_row(row: torch.Tensor, p: SamplingParams, gen: torch.Generator | None) -> int:
    row = row.float() / p.temperature
    if 0 < p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    if p.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_p, dim=-1)
        drop = (cum - sorted_p) > p.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, idx, sorted_p)
    return int(torch.multinomial(probs.cpu(), 1, generator=gen))


def make_generator(seed: int | None) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator()
    g.manual_seed(seed)
    return g
