"""The model's weight matmuls (y = x @ W.T + b), with the weight in the layout its kernel wants.

`PlainLinear` calls F.linear on the parameter as stored. On CPU in bfloat16, oneDNN re-lays
out a plain weight on every call; `PackedLinear` does that once at load time (oneDNN's
blocked layout), which makes SmolLM2's matmuls ~1.3x faster at 32 rows and ~1.4x at one row,
with bit-identical results (see docs/benchmarks.md, "Engine vs HF transformers").
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class PlainLinear:
    """F.linear on the weight (and bias) tensors as they are; sees later in-place updates."""

    packed = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PackedLinear:
    """The weight reordered once into oneDNN's blocked layout (an opaque tensor: the plain one
    can be dropped afterwards). CPU, bfloat16 only: see `can_pack`."""

    packed = True

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, rows_hint: int = 32):
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)
        self.bias = None if bias is None else bias.detach()
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


def can_pack(dtype: torch.dtype, device: torch.device | str) -> bool:
    """True where PackedLinear works and gives F.linear's results: CPU, bfloat16, a oneDNN
    build with bf16 support (float32 packing would change results in the last bits)."""
    if torch.device(device).type != "cpu" or dtype is not torch.bfloat16:
        return False
    ops = torch.ops.mkldnn
    try:
        return (torch.backends.mkldnn.is_available() and hasattr(ops, "_reorder_linear_weight")
                and hasattr(ops, "_linear_pointwise") and bool(ops._is_mkldnn_bf16_supported()))
    except (AttributeError, RuntimeError):
        return False
