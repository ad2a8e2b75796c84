"""Logprobs of chosen tokens and their k most likely alternatives, for a batch of rows at once.

Which distribution: the model's raw one, log_softmax of the logits before any logit processor
(penalties, logit_bias, min_tokens), temperature, top-k/p or min-p. That is vLLM's default
(`logprobs_mode="raw_logprobs"`) and what OpenAI's shape implies: the alternatives are the
model's most likely next tokens whatever the sampler did, and the chosen token's logprob is read
from the same row, so it equals its entry in the alternatives whenever it is among them.
"""

from __future__ import annotations

import torch

from ..core.logprobs import TopLogprobs


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor,
                tops: list[int]) -> tuple[list[float], list[TopLogprobs | None]]:
    """logits [B, V] (any float dtype), tokens [B] -> (each row's logprob of its token, each
    row's `tops[i]` most likely (token, logprob) pairs, largest first, or None where tops[i]
    is 0). One log_softmax and one topk over the whole batch."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, tokens.view(-1, 1).to(lp.device)).view(-1).tolist()
    k = min(max(tops, default=0), lp.shape[1])
    if k == 0:
        return chosen, [None] * len(tops)
    vals, ids = torch.topk(lp, k, dim=-1)  # sorted, largest first
    vals, ids = vals.tolist(), ids.tolist()
    alts = [list(zip(ids[i][:n], vals[i][:n])) if n else None for i, n in enumerate(tops)]
    return chosen, alts
