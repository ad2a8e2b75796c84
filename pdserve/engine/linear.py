"""The model's weight matmuls (y = x @ W.T + b), with the weight in the layout its kernel wants.

Which path is fastest depends on the CPU, so it is measured (engine/calibration.py) rather
than assumed; every path takes and returns the model's dtype:
- `torch`: F.linear on the weight as stored (any dtype, any device);
- `onednn`: CPU bf16, the weight reordered once into oneDNN's blocked layout (it re-lays out a
  plain weight on every call): ~1.3-1.4x plain F.linear on AVX-512 BF16, bit-identical;
- `panel`: CPU bf16, our AVX2 kernel (cpu_matmul.c) on 16-column bf16 panels: where oneDNN
  has no bf16 (no AVX-512) torch's bf16 F.linear is 10-80x slower than this;
- `float32`: CPU bf16, the weight held in float32 and MKL's sgemm, output rounded to bf16
  (twice the weight memory: for CPUs where neither bf16 path is fast);
- `onednn_gemv`: CPU bf16 with AVX-512 BF16, oneDNN's packed path for more than GEMV_ROWS rows
  and our streaming kernel (cpu_gemv.c) on the plain weight for decode's one or two rows
  (both layouts kept: twice the weight memory).
"""

from __future__ import annotations

import enum
from typing import Protocol

import torch
import torch.nn.functional as F

from .cpu_matmul import GEMV_ROWS, MatmulKernels


class MatmulPath(str, enum.Enum):
    TORCH = "torch"
    ONEDNN = "onednn"
    PANEL = "panel"
    FLOAT32 = "float32"
    ONEDNN_GEMV = "onednn_gemv"


class Linear(Protocol):
    weight: torch.Tensor
    bias: torch.Tensor | None
    path: MatmulPath

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class PlainLinear:
    """F.linear on the weight (and bias) tensors as they are; sees later in-place updates."""

    path = MatmulPath.TORCH

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class PackedLinear:
    """The weight reordered once into oneDNN's blocked layout (an opaque tensor: the plain one
    can be dropped afterwards). CPU, bfloat16 only: see `can_pack`."""

    path = MatmulPath.ONEDNN

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, rows_hint: int = 32):
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), rows_hint)
        self.bias = None if bias is None else bias.detach()
        self.out_features = weight.shape[0]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")


class PanelLinear:
    """The weight packed once into our kernel's bf16 panels (cpu_matmul.PanelMatmul)."""

    path = MatmulPath.PANEL

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel):
        self.kernel = kernel
        self.out_features = weight.shape[0]
        self.weight = kernel.pack(weight.detach().contiguous())
        self.bias = None if bias is None else bias.detach().contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or (x.stride(1) != 1 and x.shape[1] > 1):
            x = x.reshape(-1, x.shape[-1]).contiguous()
        return self.kernel.linear(x, self.weight, self.out_features, self.bias)


class GemvLinear:
    """oneDNN's packed weight for more than GEMV_ROWS rows, our few-row kernel on the plain weight
    (kept beside it) for fewer: the matmuls of decoding one or two sequences."""

    path = MatmulPath.ONEDNN_GEMV

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel):
        self.kernel = kernel
        self.packed = PackedLinear(weight, bias)
        self.weight = weight.detach().contiguous()
        self.bias = self.packed.bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 2 and x.shape[0] <= GEMV_ROWS and x.stride(1) == 1:
            return self.kernel.linear(x, self.weight, self.bias)
        return self.packed(x)


class Float32Linear:
    """The weight held in float32; x upcast, MKL's sgemm, the result rounded to x's dtype."""

    path = MatmulPath.FLOAT32

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight = weight.detach().float()
        self.bias = None if bias is None else bias.detach().float()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight, self.bias).to(x.dtype)


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


NO_KERNELS = MatmulKernels()


def available_paths(dtype: torch.dtype, device: torch.device | str,
                    kernels: MatmulKernels = NO_KERNELS) -> list[MatmulPath]:
    """The paths that work for a model of this dtype on this device (torch first); kernels: ours
    that were built here."""
    paths = [MatmulPath.TORCH]
    if torch.device(device).type == "cpu" and dtype is torch.bfloat16:
        if can_pack(dtype, device):
            paths.append(MatmulPath.ONEDNN)
            if kernels.gemv is not None:
                paths.append(MatmulPath.ONEDNN_GEMV)
        if kernels.panel is not None:
            paths.append(MatmulPath.PANEL)
        paths.append(MatmulPath.FLOAT32)
    return paths


def default_path(dtype: torch.dtype, device: torch.device | str,
                 kernels: MatmulKernels = NO_KERNELS) -> MatmulPath:
    """The path to use without a measurement: oneDNN's packed bf16 where it has bf16, else our
    panel kernel where built, else F.linear."""
    paths = available_paths(dtype, device, kernels)
    for p in (MatmulPath.ONEDNN, MatmulPath.PANEL):
        if p in paths:
            return p
    return MatmulPath.TORCH


def make_linear(path: MatmulPath, weight: torch.Tensor, bias: torch.Tensor | None = None,
                kernels: MatmulKernels = NO_KERNELS) -> Linear:
    """A matmul of `weight` (and `bias`) on `path` (one of available_paths)."""
    if path is MatmulPath.TORCH:
        return PlainLinear(weight, bias)
    if path is MatmulPath.ONEDNN:
        return PackedLinear(weight, bias)
    if path is MatmulPath.PANEL:
        if kernels.panel is None:
            raise ValueError("matmul path 'panel' needs the built panel kernel (cpu_matmul.c)")
        return PanelLinear(weight, bias, kernels.panel)
    if path is MatmulPath.ONEDNN_GEMV:
        if kernels.gemv is None:
            raise ValueError("matmul path 'onednn_gemv' needs the built few-row kernel (cpu_gemv.c)")
        return GemvLinear(weight, bias, kernels.gemv)
    return Float32Linear(weight, bias)
