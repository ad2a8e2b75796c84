"""Routed-expert MLP (Mixtral, Qwen2/3-MoE): top-k routing, then each expert's SwiGLU over the
tokens routed to it, one matmul pair per expert per step; Qwen2-MoE adds a shared expert
that every token runs, scaled by sigmoid(shared gate).

The router's logits are softmaxed in float32 and the top_k kept (renormalized where the
config says). Tokens are grouped by expert (one sort), so expert e multiplies only its rows;
outputs are scaled by the routing weight and summed into the result expert by expert, in
expert order, with HF's rounding points (Mixtral scales in float32, Qwen3-MoE rounds the
weights to the model's dtype first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model_files.hf_config import MoESpec


class MoEMLP(torch.nn.Module):
    """forward(h [T, hidden]) -> [T, hidden]. Weights: router [E, hidden]; gate_up
    [E, 2 * inter, hidden] (gate rows, then up rows); down [E, hidden, inter]."""

    def __init__(self, spec: MoESpec, hidden: int, act, dtype, device):
        super().__init__()
        self.spec = spec
        E, inter = spec.num_experts, spec.intermediate_size
        p = lambda *s: torch.nn.Parameter(torch.empty(*s, dtype=dtype, device=device),  # noqa: E731
                                          requires_grad=False)
        self.router = p(E, hidden)
        self.gate_up = p(E, 2 * inter, hidden)
        self.down = p(E, hidden, inter)
        self.act = act
        shared = spec.shared_intermediate_size
        self.shared_gate_up = p(2 * shared, hidden) if shared else None
        self.shared_down = p(hidden, shared) if shared else None
        self.shared_gate = p(1, hidden) if shared else None

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k], expert ids [T, k]) of each token."""
        probs = torch.softmax(F.linear(h, self.router).float(), dim=-1)
        weights, experts = torch.topk(probs, self.spec.top_k, dim=-1)
        if self.spec.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.spec.float32_weights else weights.to(h.dtype)), experts

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.shared_gate_up is None:
            return self.routed(h)
        gate, up = F.linear(h, self.shared_gate_up).chunk(2, dim=-1)
        shared = F.linear(self.act(gate) * up, self.shared_down)
        return self.routed(h) + torch.sigmoid(F.linear(h, self.shared_gate)) * shared

    def routed(self, h: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(h)
        k = self.spec.top_k
        flat = experts.view(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.spec.num_experts).tolist()
        tokens, w = order // k, weights.view(-1)[order]
        out = torch.zeros_like(h)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start:start + n]
            gate, up = F.linear(h.index_select(0, rows), self.gate_up[e]).chunk(2, dim=-1)
            y = F.linear(self.act(gate) * up, self.down[e]) * w[start:start + n, None]
            out.index_add_(0, rows, y.to(out.dtype))
            start += n
        return out
