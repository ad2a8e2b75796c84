"""Rotary position embeddings: inverse frequencies for every supported rope_type, and the
cos/sin of each new token.

Static kinds (default, linear, llama3, yarn) are one table by position. Two kinds depend on
the sequence length, as HF transformers computes them during generation (the length of the
sequence after this step, its new tokens included):
- longrope: `short_factor` while the sequence is at most original_max_position_embeddings
  long, `long_factor` once it is longer (a table each);
- dynamic (NTK): the base grows with the sequence once it passes max_position_embeddings,
  so a token's frequencies are computed for its sequence's length.
Keys are stored rotated, so a key keeps the rotation it got when it was written (as in HF).
cos/sin are computed in float32 (times yarn's/longrope's attention factor) and rounded to
the model's dtype, as HF does.
"""

from __future__ import annotations

import math

import torch

SEQ_DEPENDENT = ("longrope", "dynamic")


def default_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def inv_freq(theta: float, scaling: dict | None, dim: int, max_positions: int,
             seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(per-pair inverse frequencies [dim/2] float32, attention factor) of one rope_type;
    seq_len matters for longrope and dynamic only; max_positions: max_position_embeddings."""
    inv = default_inv_freq(theta, dim)
    if scaling is None:
        return inv, 1.0
    kind = scaling["rope_type"]
    if kind == "linear":
        return inv / float(scaling["factor"]), 1.0
    if kind == "llama3":
        factor = float(scaling["factor"])
        orig = float(scaling["original_max_position_embeddings"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        wavelen = 2 * math.pi / inv
        # long wavelengths are slowed by `factor`, short ones kept, the band between blended
        blend = ((orig / wavelen - low) / (high - low)).clamp(0.0, 1.0)
        return (1 - blend) * inv / factor + blend * inv, 1.0
    if kind == "yarn":
        return _yarn(theta, scaling, dim, max_positions)
    if kind == "longrope":
        return _longrope(theta, scaling, dim, max_positions, seq_len)
    if kind == "dynamic":
        factor = float(scaling["factor"])
        n = max(seq_len or max_positions, max_positions)
        base = theta * ((factor * n / max_positions) - (factor - 1)) ** (dim / (dim - 2))
        return default_inv_freq(base, dim), 1.0
    raise ValueError(f"rope_type {kind!r} is not supported")


def _yarn(theta: float, s: dict, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the low frequencies by `factor`, keep the high ones, ramp between
    (the band set by beta_fast/beta_slow rotations over the original length)."""
    orig = int(s["original_max_position_embeddings"])
    factor = s.get("factor") or max_positions / orig
    mscale, mscale_all = s.get("mscale"), s.get("mscale_all_dim")

    def get_mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = s.get("attention_factor")
    if attention is None:
        attention = get_mscale(factor, mscale) / get_mscale(factor, mscale_all) \
            if mscale and mscale_all else get_mscale(factor)
    fast, slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(fast), correction_dim(slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).float() / dim)
    keep = 1 - ramp  # share of the unscaled (extrapolated) frequency
    inv = (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep
    return inv, float(attention)


def _longrope(theta: float, s: dict, dim: int, max_positions: int,
              seq_len: int | None) -> tuple[torch.Tensor, float]:
    orig = int(s["original_max_position_embeddings"])
    factor = s.get("factor") or max_positions / orig
    attention = s.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    ext = s["long_factor"] if seq_len and seq_len > orig else s["short_factor"]
    if len(ext) != dim // 2:
        raise ValueError(f"longrope factors have {len(ext)} entries, rotary dim {dim} needs {dim // 2}")
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    return 1.0 / (torch.tensor(ext, dtype=torch.float32) * theta ** shape), float(attention)


def _cos_sin(positions: torch.Tensor, inv: torch.Tensor, attention: float, dtype):
    angles = torch.outer(positions.float(), inv)
    return (angles.cos() * attention).to(dtype), (angles.sin() * attention).to(dtype)


class Rotary:
    """cos/sin [T, 1, dim/2] of the new tokens for one RoPE (theta, scaling) of `dim` dims."""

    def __init__(self, theta: float, scaling: dict | None, dim: int, max_position_embeddings: int,
                 table_len: int, dtype: torch.dtype, device):
        self.theta, self.scaling, self.dim = theta, scaling, dim
        self.kind = None if scaling is None else scaling["rope_type"]
        self.max_pos, self.dtype, self.device = max_position_embeddings, dtype, device
        self.orig = int(scaling["original_max_position_embeddings"]) if self.kind == "longrope" \
            else max_position_embeddings
        positions = torch.arange(table_len)
        inv, att = inv_freq(theta, scaling, dim, max_position_embeddings)
        tables = [_cos_sin(positions, inv, att, dtype)]
        if self.kind == "longrope":
            inv, att = inv_freq(theta, scaling, dim, max_position_embeddings, seq_len=self.orig + 1)
            tables.append(_cos_sin(positions, inv, att, dtype))
        self.cos = torch.cat([c for c, _ in tables]).to(device)
        self.sin = torch.cat([s for _, s in tables]).to(device)
        self.table_len = table_len

    @property
    def needs_seq_lens(self) -> bool:
        return self.kind in SEQ_DEPENDENT

    def __call__(self, positions: torch.Tensor, seq_lens: torch.Tensor | None = None):
        """positions [T] on the model's device; seq_lens [T] on CPU (needs_seq_lens only)."""
        if self.kind == "longrope":
            rows = positions + (seq_lens > self.orig).to(positions.device) * self.table_len
            return self.cos.index_select(0, rows).unsqueeze(1), self.sin.index_select(0, rows).unsqueeze(1)
        cos = self.cos.index_select(0, positions)
        sin = self.sin.index_select(0, positions)
        if self.kind == "dynamic" and bool((seq_lens > self.max_pos).any()):
            cos, sin = cos.clone(), sin.clone()
            for n in torch.unique(seq_lens[seq_lens > self.max_pos]).tolist():
                rows = (seq_lens == n).nonzero().view(-1).to(positions.device)
                inv, att = inv_freq(self.theta, self.scaling, self.dim, self.max_pos, seq_len=n)
                c, s = _cos_sin(positions.index_select(0, rows).cpu(), inv, att, self.dtype)
                cos[rows], sin[rows] = c.to(cos.device), s.to(sin.device)
        return cos.unsqueeze(1), sin.unsqueeze(1)
