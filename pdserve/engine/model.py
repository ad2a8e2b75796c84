"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) in plain PyTorch, over paged KV.

Tokens of all sequences in a step are one flat [T] batch; only attention needs to know which
sequence a token belongs to, and `paged_attention` handles that from the `AttnBatch`.
For speed, q/k/v are one matmul and gate/up another, RoPE reads a precomputed cos/sin
table by position, rotating q and k (adjacent in the fused output) in one go, and after loading
the matmul weights may be packed into the CPU kernel's own layout (`pack_weights`). Each
residual add runs with the next norm; norms and RoPE go through `TorchOps` or, in bf16 on CPU,
our bit-identical C versions (`use_fused_ops`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..model_files.hf_config import ModelConfig
from .attention import AttnBatch, paged_attention
from .kv_pool import KVPool
from .linear import PackedLinear, PlainLinear, can_pack


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Per-pair inverse frequencies [head_dim/2] (float32, as HF), with the config's rope scaling."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv
    kind = scaling["rope_type"]
    factor = float(scaling["factor"])
    if kind == "linear":
        return inv / factor
    if kind == "llama3":
        orig = float(scaling["original_max_position_embeddings"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        wavelen = 2 * math.pi / inv
        # long wavelengths are slowed by `factor`, short ones kept, the band between blended
        blend = ((orig / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        return (1 - blend) * inv / factor + blend * inv
    raise ValueError(f"rope_type {kind!r} is not supported")


def rope_table(cfg: ModelConfig, max_positions: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_positions, head_dim/2], computed in float32 like HF, stored in `dtype`."""
    inv = rope_inv_freq(cfg)
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv)
    return angles.cos().to(dtype).to(device), angles.sin().to(dtype).to(device)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves of x [T, H, D] by cos/sin [T, 1, D/2] (HF's rotate_half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's RMSNorm: normalize in float32, round to x's dtype, then scale. (F.rms_norm is
    several times slower on CPU in bfloat16 once there are more than a few rows.)"""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class TorchOps:
    """The norm and RoPE steps as torch formulas; `cpu_fused.FusedOps` is the same interface
    in C, bit-identical, for bfloat16 on CPU (one call instead of ~7 small ops)."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    @staticmethod
    def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        """x += delta in place (the residual stream), then rms_norm(x)."""
        return rms_norm(x.add_(delta), weight, eps)

    @staticmethod
    def rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(qk, cos, sin)


def _param(*shape: int, dtype, device) -> torch.nn.Parameter:
    return torch.nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class DecoderLayer(torch.nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, dtype, device):
        super().__init__()
        self.index = index
        self.n_q = cfg.num_heads
        self.n_kv = cfg.num_kv_heads
        self.d = cfg.head_dim
        self.eps = cfg.rms_norm_eps
        h, qkv = cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.input_norm = _param(h, dtype=dtype, device=device)
        self.qkv_proj = _param(qkv, h, dtype=dtype, device=device)
        self.qkv_bias = _param(qkv, dtype=dtype, device=device) if cfg.qkv_bias else None
        self.o_proj = _param(h, cfg.num_heads * cfg.head_dim, dtype=dtype, device=device)
        self.o_bias = _param(h, dtype=dtype, device=device) if cfg.o_bias else None
        self.post_norm = _param(h, dtype=dtype, device=device)
        self.gate_up_proj = _param(2 * cfg.intermediate_size, h, dtype=dtype, device=device)
        self.down_proj = _param(h, cfg.intermediate_size, dtype=dtype, device=device)
        self._linears = ("qkv", "o", "gate_up", "down")
        self.qkv = PlainLinear(self.qkv_proj, self.qkv_bias)
        self.o = PlainLinear(self.o_proj, self.o_bias)
        self.gate_up = PlainLinear(self.gate_up_proj)
        self.down = PlainLinear(self.down_proj)

    def pack_weights(self) -> None:
        """Swap each matmul for a PackedLinear and free the plain copy of its weight."""
        for name in self._linears:
            plain = getattr(self, name)
            setattr(self, name, PackedLinear(plain.weight, plain.bias))
            plain.weight.data = plain.weight.data.new_empty(0)

    def forward(self, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: AttnBatch, pool: KVPool, ops) -> torch.Tensor:
        """x [T, hidden] is the residual stream, h = input_norm(x). Adds the attention output
        to x in place and returns the MLP output: the caller adds it to x together with the
        next norm (ops.add_rms_norm), so each residual add and norm is one step."""
        T = x.shape[0]
        qkv = self.qkv(h)
        n_qk = self.n_q + self.n_kv
        qk = ops.rope(qkv[:, : n_qk * self.d].view(T, n_qk, self.d), cos, sin)
        v = qkv[:, n_qk * self.d:].view(T, self.n_kv, self.d)
        attn = paged_attention(qk[:, : self.n_q], qk[:, self.n_q:], v, self.index, batch, pool)
        gate_up = self.gate_up(ops.add_rms_norm(x, self.o(attn), self.post_norm, self.eps))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down(F.silu(gate).mul_(up))


class CausalLM(torch.nn.Module):
    """forward(ids, positions, batch, pool) -> final-normed hidden [T, hidden];
    logits(hidden) -> float32 [N, vocab]; raw_logits(hidden) -> the same in the model's dtype. Weights are left uninitialized: use loader.load_model."""

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device, max_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.embed_tokens = _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = torch.nn.ModuleList(DecoderLayer(cfg, i, dtype, device) for i in range(cfg.num_layers))
        self.norm = _param(cfg.hidden_size, dtype=dtype, device=device)
        self.lm_head = self.embed_tokens if cfg.tie_word_embeddings else \
            _param(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.head = PlainLinear(self.lm_head)
        self.packed = False
        self.fused = None  # cpu_fused.FusedOps, see use_fused_ops
        cos, sin = rope_table(cfg, max_positions or cfg.max_position_embeddings, dtype, device)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttnBatch,
                pool: KVPool) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed_tokens)
        cos = self.rope_cos.index_select(0, positions).unsqueeze(1)
        sin = self.rope_sin.index_select(0, positions).unsqueeze(1)
        ops = self.fused if self.fused is not None and self.fused.supports(x.dtype, x.device) \
            else TorchOps
        eps = self.cfg.rms_norm_eps
        h = ops.rms_norm(x, self.layers[0].input_norm, eps)
        norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm in zip(self.layers, norms):
            h = ops.add_rms_norm(x, layer(x, h, cos, sin, batch, pool, ops), next_norm, eps)
        return h

    def use_fused_ops(self, ops) -> None:
        """Run norms and RoPE through `ops` (a cpu_fused.FusedOps; bit-identical results)
        wherever it supports the model's dtype and device; None: torch formulas."""
        self.fused = ops

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden).float()

    @torch.inference_mode()
    def raw_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Unconverted: greedy argmax needs no float32 copy (32 x 49k rows: ~2 ms a step)."""
        return self.head(hidden)

    @torch.no_grad()
    def pack_weights(self) -> bool:
        """After loading: pack every matmul weight where `can_pack` (the embedding stays plain;
        a tied lm_head gets its own packed copy). True if packed; idempotent."""
        if self.packed or not can_pack(self.dtype, self.embed_tokens.device):
            return self.packed
        for layer in self.layers:
            layer.pack_weights()
        self.head = PackedLinear(self.lm_head)
        if self.lm_head is not self.embed_tokens:
            self.lm_head.data = self.lm_head.data.new_empty(0)
        self.packed = True
        return True
