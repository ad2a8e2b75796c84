"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/3, Phi-3, Gemma 2/3, SmolLM2) in plain
PyTorch, over paged KV.

Tokens of all sequences in a step are one flat [T] batch; only attention needs to know which
sequence a token belongs to, and `paged_attention` handles that from the `AttnBatch`.
For speed, q/k/v are one matmul and gate/up another, RoPE reads a precomputed cos/sin
table by position, rotating q and k (adjacent in the fused output) in one go, and after loading
the matmul weights are put on the path measured fastest on this CPU (`use_matmul`). Each
residual add runs with the next norm; norms and RoPE go through `TorchOps` or, in bf16 on CPU,
our bit-identical C versions (`use_fused_ops`). Family differences are config fields, not
branches on the architecture: per-head q/k norms (Qwen3, Gemma 3), Gemma's (1 + w) norms
(`GemmaOps`), norms around attention and MLP, embedding scale and soft-caps, GeGLU, partial
RoPE (Phi-3), per-layer windows and RoPE (rope.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..model_files.hf_config import ModelConfig
from .attention import AttnBatch, AttnParams, paged_attention
from .cpu_matmul import MatmulKernels
from .kv_pool import KVPool
from .linear import NO_KERNELS, MatmulPath, PlainLinear, make_linear
from .moe import MoEMLP
from .rope import Rotary

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate halves of x [T, H, D] by cos/sin [T, 1, D/2] (HF's rotate_half convention)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first 2 * cos.shape[-1] dims of each head; the rest pass (Phi-3's
    partial_rotary_factor)."""
    rot = 2 * cos.shape[-1]
    return torch.cat((apply_rope(x[..., :rot], cos, sin), x[..., rot:]), dim=-1)


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


class GemmaOps(TorchOps):
    """Gemma's RMSNorm: normalize and scale by (1 + w) in float32, then round (HF's order)."""

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
                * (1.0 + weight.float())).to(x.dtype)

    @classmethod
    def add_rms_norm(cls, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                     eps: float) -> torch.Tensor:
        return cls.rms_norm(x.add_(delta), weight, eps)


def _rope_key(rope: tuple[float, dict | None]) -> tuple:
    """A hashable key of one (theta, scaling)."""
    theta, scaling = rope
    return theta, None if scaling is None else tuple(sorted(
        (k, tuple(v) if isinstance(v, list) else v) for k, v in scaling.items()))


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
        self.attn = AttnParams(cfg.scale, cfg.layer_window(index), cfg.attn_softcap)
        self.partial_rope = cfg.rotary_dim < cfg.head_dim
        h, qkv = cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.input_norm = _param(h, dtype=dtype, device=device)
        self.qkv_proj = _param(qkv, h, dtype=dtype, device=device)
        self.qkv_bias = _param(qkv, dtype=dtype, device=device) if cfg.qkv_bias else None
        self.q_norm = _param(cfg.head_dim, dtype=dtype, device=device) if cfg.qk_norm else None
        self.k_norm = _param(cfg.head_dim, dtype=dtype, device=device) if cfg.qk_norm else None
        self.qk_ops = GemmaOps if cfg.gemma else TorchOps
        self.o_proj = _param(h, cfg.num_heads * cfg.head_dim, dtype=dtype, device=device)
        self.o_bias = _param(h, dtype=dtype, device=device) if cfg.o_bias else None
        # Gemma: norms of the attention output and of the MLP output, before each residual add
        self.attn_out_norm = _param(h, dtype=dtype, device=device) if cfg.gemma else None
        self.mlp_out_norm = _param(h, dtype=dtype, device=device) if cfg.gemma else None
        self.post_norm = _param(h, dtype=dtype, device=device)  # the MLP's input norm
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.qkv = PlainLinear(self.qkv_proj, self.qkv_bias)
        self.o = PlainLinear(self.o_proj, self.o_bias)
        self.moe = MoEMLP(cfg.moe, h, self.act, dtype, device) \
            if cfg.moe is not None and index in cfg.moe.layers else None
        self._linears = ("qkv", "o") if self.moe is not None else ("qkv", "o", "gate_up", "down")
        if self.moe is None:
            self.gate_up_proj = _param(2 * cfg.intermediate_size, h, dtype=dtype, device=device)
            self.down_proj = _param(h, cfg.intermediate_size, dtype=dtype, device=device)
            self.gate_up = PlainLinear(self.gate_up_proj)
            self.down = PlainLinear(self.down_proj)

    def use_matmul(self, path: MatmulPath, kernels: MatmulKernels = NO_KERNELS) -> None:
        """Put each matmul on `path` (linear.make_linear) and free the plain copy of its weight
        where the new layout replaces it."""
        for name in self._linears:
            plain = getattr(self, name)
            setattr(self, name, make_linear(path, plain.weight, plain.bias, kernels))
            if path is not MatmulPath.TORCH:
                plain.weight.data = plain.weight.data.new_empty(0)

    def _rope_qk(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ops) -> torch.Tensor:
        """q and k heads [T, Hq + Hkv, D] of the fused projection, normed (q/k norms) and rotated."""
        T, n_qk = qkv.shape[0], self.n_q + self.n_kv
        qk = qkv[:, : n_qk * self.d].view(T, n_qk, self.d)
        if self.q_norm is not None:  # torch formulas: the fused ops take 2-D rows only
            norm = self.qk_ops.rms_norm
            qk = torch.cat((norm(qk[:, : self.n_q], self.q_norm, self.eps),
                            norm(qk[:, self.n_q:], self.k_norm, self.eps)), dim=1)
        return apply_partial_rope(qk, cos, sin) if self.partial_rope else ops.rope(qk, cos, sin)

    def forward(self, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                batch: AttnBatch, pool: KVPool, ops) -> torch.Tensor:
        """x [T, hidden] is the residual stream, h = input_norm(x). Adds the attention output
        to x in place and returns the MLP output: the caller adds it to x together with the
        next norm (ops.add_rms_norm), so each residual add and norm is one step."""
        T = x.shape[0]
        qkv = self.qkv(h)
        qk = self._rope_qk(qkv, cos, sin, ops)
        v = qkv[:, (self.n_q + self.n_kv) * self.d:].view(T, self.n_kv, self.d)
        attn = self.o(paged_attention(qk[:, : self.n_q], qk[:, self.n_q:], v, self.index, batch,
                                      pool, self.attn))
        if self.attn_out_norm is not None:
            attn = ops.rms_norm(attn, self.attn_out_norm, self.eps)
        h = ops.add_rms_norm(x, attn, self.post_norm, self.eps)
        if self.moe is not None:
            out = self.moe(h)
        else:
            gate, up = self.gate_up(h).chunk(2, dim=-1)
            out = self.down(self.act(gate).mul_(up))
        return out if self.mlp_out_norm is None else ops.rms_norm(out, self.mlp_out_norm, self.eps)


class CausalLM(torch.nn.Module):
    """forward(ids, positions, batch, pool) -> final-normed hidden [T, hidden];
    logits(hidden) -> float32 [N, vocab]; raw_logits(hidden) -> the same in the model's dtype.
    Weights are left uninitialized: use loader.load_model."""

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
        self.matmul = MatmulPath.TORCH  # see use_matmul
        self.fused = None  # cpu_fused.FusedOps, see use_fused_ops
        self.torch_ops = GemmaOps if cfg.gemma else TorchOps
        self.embed_scale = torch.tensor(cfg.hidden_size ** 0.5, dtype=dtype) if cfg.gemma else None
        n = max_positions or cfg.max_position_embeddings
        self.layer_ropes = [_rope_key(cfg.layer_rope(i)) for i in range(cfg.num_layers)]
        self.ropes: dict[tuple, Rotary] = {}  # one per distinct (theta, scaling) (Gemma 3: two)
        for i, key in enumerate(self.layer_ropes):
            if key not in self.ropes:
                self.ropes[key] = Rotary(*cfg.layer_rope(i), cfg.rotary_dim, cfg.max_position_embeddings,
                                         n, dtype, device)

    @property
    def rope_depends_on_length(self) -> bool:
        """A key's rotation depends on its sequence's length (longrope, dynamic NTK), so KV
        pages cannot be shared between sequences (no prefix cache)."""
        return any(r.needs_seq_lens for r in self.ropes.values())

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttnBatch,
                pool: KVPool) -> torch.Tensor:
        x = F.embedding(input_ids, self.embed_tokens)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        seq_lens = batch.token_seq_lens() if self.rope_depends_on_length else None
        rope = {key: r(positions, seq_lens) for key, r in self.ropes.items()}
        ops = self.fused if self.fused is not None and not self.cfg.gemma \
            and self.fused.supports(x.dtype, x.device) else self.torch_ops
        eps = self.cfg.rms_norm_eps
        h = ops.rms_norm(x, self.layers[0].input_norm, eps)
        norms = [layer.input_norm for layer in self.layers[1:]] + [self.norm]
        for layer, next_norm, key in zip(self.layers, norms, self.layer_ropes):
            cos, sin = rope[key]
            h = ops.add_rms_norm(x, layer(x, h, cos, sin, batch, pool, ops), next_norm, eps)
        return h

    def use_fused_ops(self, ops) -> None:
        """Run norms and RoPE through `ops` (a cpu_fused.FusedOps; bit-identical results)
        wherever it supports the model's dtype and device; None: torch formulas."""
        self.fused = ops

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.raw_logits(hidden).float()

    @torch.inference_mode()
    def raw_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Unconverted: greedy argmax needs no float32 copy (32 x 49k rows: ~2 ms a step).
        Soft-capped in the model's dtype where the config says (Gemma 2), as HF does."""
        out = self.head(hidden)
        cap = self.cfg.final_softcap
        return out if cap is None else torch.tanh(out / cap) * cap

    @torch.no_grad()
    def use_matmul(self, path: MatmulPath, kernels: MatmulKernels = NO_KERNELS) -> None:
        """After loading: every matmul on `path` (one of linear.available_paths; kernels: ours
        that were built, for the paths that need them). The embedding stays plain; a tied
        lm_head gets its own copy in the path's layout. Once only: the plain weights are freed."""
        if path is self.matmul:
            return
        if self.matmul is not MatmulPath.TORCH:
            raise RuntimeError(f"matmuls already on {self.matmul.value}; cannot move to {path.value}")
        for layer in self.layers:
            layer.use_matmul(path, kernels)
        self.head = make_linear(path, self.lm_head, None, kernels)
        if path is not MatmulPath.TORCH and self.lm_head is not self.embed_tokens:
            self.lm_head.data = self.lm_head.data.new_empty(0)
        self.matmul = path
